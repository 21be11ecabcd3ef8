"""Property-based fuzzing of the request schema against a live tiny server: random JSON bodies, some
close to valid requests and some hostile (wrong types, huge integers, lone surrogates, deep nesting,
odd keys), posted to both completion endpoints. No answer is ever a 5xx, every refusal has OpenAI's
error shape, and /health keeps answering fast. Examples are bounded so the test runs in well under
a minute on the tiny engine."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from runtime_utils import assert_idle_and_no_leak, one_thread  # noqa: E402

from k3trt.serve import ServeConfig, ServerThread  # noqa: E402

HEALTH_S = 0.1
ROLES = ["system", "user", "assistant", "tool", "developer", "wizard", ""]

# leaves a hostile client reaches for: integers past int64, non-finite floats, lone surrogates
hostile_ints = st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 63, -(2 ** 63) - 1, 2 ** 70, 10 ** 30])
leaves = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), hostile_ints,
                   st.floats(allow_nan=False, allow_infinity=False, width=32),
                   st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "<|open|>", "{", ""]))
json_values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES)},
                                          optional={"content": st.one_of(st.text(max_size=20), json_values),
                                                    "name": json_values}), max_size=3)
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "get_weather", "bad name!"])},
    optional={"description": st.text(max_size=10), "parameters": json_values})})
common = {"model": st.sampled_from(["tiny", "tiny", "gpt-4"]), "max_tokens": st.one_of(st.integers(-2, 3), hostile_ints)}
knobs = {"temperature": st.one_of(st.floats(-1, 3), json_values), "top_p": json_values, "top_k": json_values,
         "n": st.integers(-1, 3), "seed": st.one_of(st.integers(-9, 9), hostile_ints), "stop": json_values,
         "stream": st.booleans(), "logit_bias": json_values, "response_format": json_values,
         "stop_token_ids": json_values, "user": json_values, "no_such_field": json_values}
chat_bodies = st.fixed_dictionaries({**common, "messages": messages},
                                    optional={**knobs, "tools": st.lists(tool, max_size=2),
                                              "tool_choice": st.sampled_from(["auto", "none", "required", 7]),
                                              "logprobs": json_values, "top_logprobs": json_values,
                                              "chat_template_kwargs": json_values})
completion_bodies = st.fixed_dictionaries({**common, "prompt": st.one_of(st.text(max_size=20), json_values)},
                                          optional={**knobs, "echo": json_values, "logprobs": json_values})
# close to valid: mostly accepted, so the fuzz also runs requests through the engine
good_knobs = {"temperature": st.floats(0, 2), "top_p": st.floats(0.1, 1), "top_k": st.integers(0, 50),
              "n": st.integers(1, 2), "seed": st.integers(0, 2 ** 63 - 1), "stream": st.booleans(),
              "stop": st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=2),
              "presence_penalty": st.floats(-2, 2), "logit_bias": st.dictionaries(
                  st.integers(0, 200_000).map(str), st.floats(-100, 100), max_size=2)}
good_chat = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 3),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]),
                                                 "content": st.text(max_size=40)}), min_size=1, max_size=3)},
    optional={**good_knobs, "tools": st.lists(tool, max_size=1), "tool_choice": st.sampled_from(["auto", "none"]),
              "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3)})
good_completion = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 3),
     "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 129_407), min_size=1, max_size=8))},
    optional={**good_knobs, "echo": st.booleans(), "logprobs": st.integers(0, 3)})
raw_bodies = st.one_of(json_values.map(json.dumps), st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
                       st.integers(1, 3000).map(lambda d: "[" * d + "]" * d))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(engine):
    cfg = ServeConfig(engine, port=_free_port(), model_name="tiny", json_max_whitespace=0,
                      engine_options={"verify_checksums": False})
    with one_thread(), ServerThread(cfg) as s:
        yield s


def _request(server, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.cfg.port, timeout=60)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _check(server, path: str, body: str) -> None:
    status, raw = _request(server, "POST", path, body.encode("utf-8", "surrogatepass"))
    assert status < 500, (status, body[:300], raw[:300])
    if status >= 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    t = time.perf_counter()
    assert _request(server, "GET", "/health")[0] == 200
    assert time.perf_counter() - t < HEALTH_S


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@FUZZ
@given(body=st.one_of(chat_bodies, good_chat))
def test_chat_schema(server, body):
    _check(server, "/v1/chat/completions", json.dumps(body))


@FUZZ
@given(body=st.one_of(completion_bodies, good_completion))
def test_completion_schema(server, body):
    _check(server, "/v1/completions", json.dumps(body))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=raw_bodies)
def test_raw_bodies(server, path, body):
    _check(server, path, body)


def test_no_block_leaks_after_the_fuzz(server):
    """Every request above ended (answered or refused): the engine holds no block, slot or request."""
    assert_idle_and_no_leak(server.state.llm)
