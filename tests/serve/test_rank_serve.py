"""`k3trt serve` over a two-rank engine dir (TP2 x EP2 rank dirs, gloo): the openai client gets the
same greedy text as from the one-rank build; then a worker rank is killed, and the next request
and /health answer 503 naming the rank, within a bounded time, while the server stays up.
Skipped where the multi-rank runtime (k3trt.runtime.rank_session) is not installed."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("k3trt.runtime.rank_session", reason="needs the multi-rank runtime")

from runtime_utils import one_thread  # noqa: E402

from k3trt.builder.build import build_engine  # noqa: E402
from k3trt.parallel import ParallelConfig  # noqa: E402
from k3trt.runtime.llm import LLM  # noqa: E402
from k3trt.serve import ServeConfig, ServerThread  # noqa: E402

BUILD = dict(dtype="fp32", capacities=[1, 2], max_num_tokens=32, spec_tokens=0, block_size=16)
HELLO = [{"role": "user", "content": "Say hello."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_on_two_ranks_then_a_killed_rank_gives_503(tiny_ckpt, tmp_path):
    one = build_engine(tiny_ckpt, tmp_path / "one", **BUILD)
    two = build_engine(tiny_ckpt, tmp_path / "two", parallel=ParallelConfig(tp=2, ep=2), **BUILD)
    ask = dict(model="tiny", messages=HELLO, max_tokens=8, temperature=0,
               extra_body={"chat_template_kwargs": {"thinking": False}})
    with one_thread():
        ref = LLM(one, verify_checksums=False)
        try:
            with ServerThread(ServeConfig(one, port=_free_port(), model_name="tiny"), llm=ref) as s:
                client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
                want = client.chat.completions.create(**ask).choices[0].message.content
        finally:
            ref.close()
        llm = LLM(two, verify_checksums=False, rank_timeout_s=20)
        try:
            with ServerThread(ServeConfig(two, port=_free_port(), model_name="tiny"), llm=llm) as s:
                client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
                assert client.chat.completions.create(**ask).choices[0].message.content == want
                assert _health(s.url) == (200, {"status": "ok"})
                llm.session.group.procs[0].kill()            # rank 1's process
                t0 = time.monotonic()
                with pytest.raises(openai.APIStatusError) as e:
                    client.chat.completions.create(**ask)
                assert e.value.status_code == 503 and "rank 1" in e.value.message
                status, body = _health(s.url)
                assert status == 503 and "rank 1" in body["error"]
                assert time.monotonic() - t0 < 60
                assert s.state.engine.alive
        finally:
            llm.close()
