"""Hostile clients against a live tiny server: every malformed request is a 4xx in OpenAI's error
shape (never a 500, and for a stream, never a 200 first), bodies are bounded as their bytes arrive,
and /health answers within 100 ms while a maximal prompt is tokenized."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from runtime_utils import assert_idle_and_no_leak, one_thread  # noqa: E402

from k3trt.serve import ServeConfig, ServerThread  # noqa: E402
from k3trt.serve.protocol import MAX_DEPTH  # noqa: E402

MAX_PROMPT_CHARS = 1_000_000
HELLO = [{"role": "user", "content": "Say hello."}]
BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "nonsense"}}}}}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(engine):
    cfg = ServeConfig(engine, port=_free_port(), model_name="tiny", api_key="sesame", json_max_whitespace=0,
                      max_prompt_chars=MAX_PROMPT_CHARS, engine_options={"verify_checksums": False})
    with one_thread(), ServerThread(cfg) as s:
        yield s


def post(server, path: str, body: bytes | str, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.port, timeout=60)
    head = {"Content-Type": "application/json", "Authorization": "Bearer sesame", **(headers or {})}
    conn.request("POST", path, body.encode() if isinstance(body, str) else body, head)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def refused(server, path: str, body: bytes | str, headers: dict | None = None) -> dict:
    """The error of a request that must be refused with a 4xx in OpenAI's shape."""
    code, raw = post(server, path, body, headers)
    assert 400 <= code < 500, (code, raw[:300])
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return {"status": code, **err}


def chat(**over) -> str:
    return json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 2, **over})


def completion(**over) -> str:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, **over})


SURROGATE = '"a\\ud800b"'      # JSON's escape for a lone surrogate: json.loads accepts it
CASES = [  # (path, raw body, status, param)
    ("/v1/chat/completions", chat().replace('"Say hello."', SURROGATE), 400, "messages[0].content"),
    ("/v1/completions", completion().replace('"hi"', SURROGATE), 400, "prompt"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "description": "D"}}])
     .replace('"D"', SURROGATE), 400, "tools[0].function.description"),
    ("/v1/chat/completions", chat(seed=2 ** 70), 400, "seed"),
    ("/v1/chat/completions", chat(seed=2 ** 70, stream=True), 400, "seed"),
    ("/v1/completions", completion(seed=-(2 ** 64), stream=True), 400, "seed"),
    ("/v1/chat/completions", chat(max_tokens=10 ** 30), 400, "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=10 ** 12, stream=True), 400, "max_tokens"),
    ("/v1/completions", completion(max_tokens=-(10 ** 30)), 400, "max_tokens"),
    ("/v1/chat/completions", chat(top_k=2 ** 64), 400, "top_k"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, None),
    ("/v1/chat/completions", chat(metadata={"a": json.loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))}),
     400, "metadata"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]),
     400, "messages"),
]


@pytest.mark.parametrize("path,body,status,param", CASES, ids=range(len(CASES)))
def test_malformed_requests_are_4xx(server, path, body, status, param):
    err = refused(server, path, body)
    assert (err["status"], err["param"]) == (status, param), err


@pytest.mark.parametrize("choice", [None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_schema_that_does_not_compile_is_refused_under_every_tool_choice(server, choice):
    err = refused(server, "/v1/chat/completions", chat(tools=BAD_TOOL, **({} if choice is None else
                                                                          {"tool_choice": choice})))
    assert err["status"] == 400 and err["param"].startswith("tools[0]"), err


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_content_type_must_be_json(server, ctype):
    err = refused(server, "/v1/chat/completions", chat(), {"Content-Type": ctype})
    assert err["status"] == 415 and "application/json" in err["message"]


def test_chunked_upload_is_bounded_as_it_arrives(server):
    limit = server.state.max_body_bytes
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.port, timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")
    for k, v in {"Content-Type": "application/json", "Authorization": "Bearer sesame",
                 "Transfer-Encoding": "chunked"}.items():
        conn.putheader(k, v)
    conn.endheaders()
    piece, sent = b" " * (1 << 20), 0
    try:
        while sent <= limit + len(piece):
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        conn.send(b"0\r\n\r\n")
    except OSError:          # the server answered and closed before the upload ended: as it should
        pass
    resp = conn.getresponse()
    assert resp.status == 413 and "bytes" in json.loads(resp.read())["error"]["message"]
    conn.close()


def test_metrics_needs_the_api_key(server):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(server.url + "/metrics", timeout=10)
    assert e.value.code == 401
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": "Bearer sesame"})
    assert b"k3trt_" in urllib.request.urlopen(req, timeout=10).read()
    assert urllib.request.urlopen(server.url + "/health", timeout=10).status == 200


def text(word: str) -> str:
    """A maximal prompt of distinct words (the tokenizer caches words it has seen)."""
    return " ".join(f"{word}{i * 7919 % 100003}" for i in range(MAX_PROMPT_CHARS // 4))[:MAX_PROMPT_CHARS - 100]


def test_no_block_leaks_after_the_hostile_requests(server):
    """Every hostile request above was refused or ended: the engine holds no block, slot or request."""
    assert_idle_and_no_leak(server.state.llm)


@pytest.fixture(scope="module")
def server_process(engine):
    """The server in its own process: the client's threads must not share its GIL."""
    port = _free_port()
    code = ("import logging, sys; from k3trt.serve import serve_main; logging.basicConfig(level=logging.INFO); "
            f"serve_main(sys.argv[1], port={port}, model_name='tiny', max_prompt_chars={MAX_PROMPT_CHARS}, "
            "engine_options={'verify_checksums': False}, log_level='warning')")
    proc = subprocess.Popen([sys.executable, "-c", code, str(engine)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
    yield types.SimpleNamespace(url=url, cfg=types.SimpleNamespace(port=port))
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": text("chat")}])),
    ("/v1/completions", completion(prompt=text("text"))),
], ids=["chat", "completion"])
def test_health_answers_while_a_maximal_prompt_is_tokenized(server_process, path, body):
    done, result = threading.Event(), {}

    def big() -> None:
        result["status"] = post(server_process, path, body, {"Authorization": ""})[0]
        done.set()
    threading.Thread(target=big, daemon=True).start()
    worst, polls = 0.0, 0
    while not done.is_set():
        t = time.perf_counter()
        assert urllib.request.urlopen(server_process.url + "/health", timeout=10).status == 200
        worst, polls = max(worst, time.perf_counter() - t), polls + 1
        time.sleep(0.01)
    assert result["status"] == 400        # past the tiny engine's context, found once tokenized
    assert polls >= 3 and worst < 0.1, (polls, worst)
