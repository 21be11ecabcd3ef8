"""`serve_main`: what `k3trt serve` calls, and `ServerThread`: the same server inside a process (tests,
notebooks). Loopback by default: exposing the port is a deliberate `--host 0.0.0.0`."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3trt.runtime.llm import LLM
from k3trt.runtime.media import FilePolicy
from k3trt.serve.app import ServerState, create_app
from k3trt.serve.engine_loop import EngineLoop
from k3trt.serve.protocol import DEFAULT_MAX_PROMPT_CHARS

log = logging.getLogger(__name__)

BODY_IMAGES = 8       # images at the byte limit, as data URLs, that the default body limit leaves room for


@dataclass(frozen=True)
class ServeConfig:
    engine_dir: str | Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None            # None: the engine dir's name
    device: str = "cpu"
    max_queue: int = 256                     # choices waiting beyond the live batch before 429
    retry_after_s: int = 1
    json_max_whitespace: int | None = None   # grammar whitespace cap (None: structured.DEFAULT_MAX_WHITESPACE)
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS       # prompt text (messages, tools, prompt) refused past it, untokenized
    max_body_bytes: int | None = None        # None: room for max_prompt_chars, every one \u-escaped
    engine_options: dict[str, Any] = field(default_factory=dict)   # LLM(**options): max_batch, speculative,
                                                                    # spec_tokens, max_image_bytes, ...
    allowed_media_dir: str | Path | None = None   # image_url file:// paths only under it; None: data: URLs only
    log_level: str = "info"


def build_app(cfg: ServeConfig, llm: Any = None):
    """The Starlette app for `cfg` (loads the engine unless `llm` is given)."""
    if cfg.max_queue < 0 or cfg.max_prompt_chars < 1:
        raise ValueError(f"max_queue must be >= 0 and max_prompt_chars >= 1, got {cfg.max_queue}, "
                         f"{cfg.max_prompt_chars}")
    owns = llm is None
    llm = llm or LLM(cfg.engine_dir, device=cfg.device, **cfg.engine_options)
    if llm.tokenizer is None:
        raise ValueError(f"{cfg.engine_dir}: the engine dir has no tokenizer; the server needs one")
    engine = EngineLoop(llm, max_pending=llm.config.max_batch + cfg.max_queue)
    name = cfg.model_name or Path(cfg.engine_dir).resolve().name
    # 12: a \uXXXX\uXXXX pair per char; image data URLs (base64: 4/3) are not prompt characters
    body = cfg.max_body_bytes or 12 * cfg.max_prompt_chars + (1 << 20) + \
        BODY_IMAGES * (llm.images.limits.max_image_bytes * 4 // 3 + 64)
    files = FilePolicy(local=False, allowed_dir=None if cfg.allowed_media_dir is None else Path(cfg.allowed_media_dir))
    st = ServerState(llm, engine, name, cfg.api_key, cfg.json_max_whitespace, cfg.retry_after_s, int(time.time()),
                     max_prompt_chars=cfg.max_prompt_chars, max_body_bytes=body, owns_llm=owns, files=files)
    return create_app(st)


def _uvicorn(cfg: ServeConfig, app: Any):
    import uvicorn  # noqa: PLC0415 (optional: serve extras)
    return uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                         timeout_graceful_shutdown=5, access_log=False))


def serve_main(engine_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               **options: Any) -> None:
    """Serve ENGINE_DIR until interrupted. `options`: the other ServeConfig fields (model_name, device,
    max_queue, retry_after_s, json_max_whitespace, max_prompt_chars, max_body_bytes, engine_options,
    log_level)."""
    cfg = ServeConfig(engine_dir, host=host, port=port, api_key=api_key, **options)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach the port can use the model", host)
    server = _uvicorn(cfg, build_app(cfg))
    log.info("serving %s on http://%s:%d/v1", cfg.engine_dir, host, port)
    server.run()


class ServerThread:
    """The server on a background thread of this process: `with ServerThread(cfg) as s: s.url`."""

    def __init__(self, cfg: ServeConfig, llm: Any = None):
        self.cfg, self.app = cfg, build_app(cfg, llm)
        self.server = _uvicorn(cfg, self.app)     # off the main thread uvicorn leaves signals alone
        self._thread = threading.Thread(target=self.server.run, name="k3trt-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def state(self) -> Any:
        return self.app.state.k3

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
