"""A multi-rank engine that stops (a rank dies, hangs or fails: the runtime's RankFailure) behind the
server: the request in flight ends with a 503-shaped error naming the cause, new requests get 503,
/health answers 503 with the reason, and the server stays up. The LLM is the real tiny engine
wrapped so that a chosen step raises and its health() turns not ok, as a multi-rank LLM's does."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from runtime_utils import build_tiny_engine, one_thread  # noqa: E402

from k3trt.runtime.llm import LLM  # noqa: E402
from k3trt.serve import ServeConfig, ServerThread  # noqa: E402

CAUSE = "multi-rank engine stopped (2 ranks): rank 1 exited with code -9"


class StoppingLLM:
    """The real LLM, whose steps raise once `stop()` was called, with a multi-rank LLM's health()."""

    def __init__(self, llm: LLM):
        self._llm, self.error = llm, None

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def stop(self) -> None:
        self.error = CAUSE

    def step(self):
        if self.error is not None:
            raise RuntimeError(self.error)        # RankFailure is a RuntimeError
        return self._llm.step()

    def health(self) -> dict:
        return {"ok": self.error is None, "ranks": [{"rank": 0, "alive": True, "exitcode": None},
                                                     {"rank": 1, "alive": self.error is None, "exitcode": -9}],
                "error": self.error}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def stopping_server(tiny_ckpt, tmp_path_factory):
    engine = build_tiny_engine(tiny_ckpt, tmp_path_factory.mktemp("rank_health") / "engine")
    with one_thread():
        llm = StoppingLLM(LLM(engine, verify_checksums=False))
        cfg = ServeConfig(engine, port=_free_port(), model_name="tiny")
        with ServerThread(cfg, llm=llm) as s:
            yield s, llm
        llm.close()


def test_a_stopped_multi_rank_engine_answers_503_and_the_server_stays_up(stopping_server):
    server, llm = stopping_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert _get(server.url + "/health") == (200, {"status": "ok"})
    ok = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"

    llm.stop()                                  # the next step raises, as a rank's failure does
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True)
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pass
    assert CAUSE in str(e.value) and "unavailable" in str(e.value)

    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert e.value.status_code == 503 and CAUSE in e.value.message
    status, body = _get(server.url + "/health")
    assert status == 503 and body["status"] == "engine unavailable" and body["error"] == CAUSE
    assert [r["alive"] for r in body["ranks"]] == [True, False]
    assert server.state.engine.alive                   # the engine thread and the server are still up
    assert _get(server.url + "/v1/models")[0] == 200
