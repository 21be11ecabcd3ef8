"""`k3trt triton-serve ENGINE_DIR`: Triton in one command. Prepares, once per machine, the
`tritonserver` of the nvidia-pytriton wheel and the numpy<2 environment its Python backend stub
needs (both cached under ~/.cache/k3trt/triton: launch.py says why each is needed), writes the
model repository for the engine dir, and runs the server in the foreground until Ctrl-C."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from k3trt.triton import launch
from k3trt.triton.repository import write_model_repository

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800.0       # a large engine loads for minutes before Triton reports ready


def triton_serve_main(engine_dir: str | Path, *, repo: str | Path | None = None, host: str = "127.0.0.1",
                      http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                      **repo_options: Any) -> int:
    """Serve `engine_dir` with Triton; `repo_options` go to write_model_repository (instances,
    max_batch, device, engine_options, ...). Returns tritonserver's exit status."""
    cache = launch.default_cache()
    log.info("preparing tritonserver and its Python environment in %s (the first time takes minutes)", cache)
    site = launch.pytriton_site(cache)
    env = launch.stub_env(cache)
    with tempfile.TemporaryDirectory(prefix="k3trt-triton-") as tmp:
        out = Path(repo) if repo is not None else Path(tmp) / "repo"
        write_model_repository(engine_dir, out, execution_env=env, **repo_options)
        server = launch.TritonServer(out, site, log_path=None, cache=cache, host=host,
                                     ports={"http": http_port, "grpc": grpc_port, "metrics": metrics_port})
        try:
            server.start(timeout=READY_TIMEOUT_S)
        except KeyboardInterrupt:
            server.stop()
            return 0
        log.info("Triton serves %s: HTTP %s, gRPC %s, metrics %s (Ctrl-C stops it)", engine_dir, server.http,
                 server.grpc, server.metrics_url)
        return server.wait()
