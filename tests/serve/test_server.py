"""`k3trt serve` over loopback with the real `openai` client, on the tiny random-weight engine.

The weights are random, so the tests check structure, not prose: streaming equals non-streaming,
seeds reproduce, grammars hold, errors name their field, and every cache block comes back. A random
model never closes a channel by itself; where a test needs it to (tool calls), it raises the
`<|close|>` token with OpenAI's `logit_bias`, and the grammar decides where that token may go.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.request

import pytest
from click.testing import CliRunner

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from runtime_utils import build_tiny_engine, one_thread  # noqa: E402

import k3trt.serve  # noqa: E402
from k3trt.cli import main  # noqa: E402
from k3trt.runtime.request import RequestOutput  # noqa: E402
from k3trt.runtime.tokenizer import Tokenizer  # noqa: E402
from k3trt.serve import ServeConfig, ServerThread  # noqa: E402
from k3trt.serve.engine_loop import EngineLoop  # noqa: E402
from k3trt.serve.output import ChoiceStream  # noqa: E402

CLOSE_ID = "129282"                   # <|close|> in the K3 tokenizer
NO_THINK = {"chat_template_kwargs": {"thinking": False}}
HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine_dir(tiny_ckpt, tmp_path_factory):
    return build_tiny_engine(tiny_ckpt, tmp_path_factory.mktemp("serve") / "engine")


@pytest.fixture(scope="module")
def server(engine_dir):
    cfg = ServeConfig(engine_dir, port=_free_port(), model_name="tiny", json_max_whitespace=0,
                      engine_options={"verify_checksums": False})
    with one_thread(), ServerThread(cfg) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    key = server.cfg.api_key
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")}


def wait_idle(server, timeout: float = 20.0) -> dict[str, float]:
    """Poll until nothing runs and every block and slot is free (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["k3trt_requests_running"] == m["k3trt_requests_waiting"] == m["k3trt_requests_admitted"] == 0
                and m["k3trt_kv_cache_blocks_in_use"] == 0 and m["k3trt_kda_slots_in_use"] == 0):
            return m
        assert time.monotonic() < deadline, f"the engine did not go idle: {m}"
        time.sleep(0.05)


def collect(stream) -> dict:
    out = {"reasoning": "", "content": "", "finish": None, "usage": None, "calls": {}}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            out["content"] += d.content or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            out["finish"] = ch.finish_reason or out["finish"]
    return out


# ---- output reading, without the model ----------------------------------------------------------------
TURN = ('hmm<|close|>think<|sep|><|open|>response<|sep|>Hi{ph} there<|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="x" type="number"<|sep|>1<|close|>argument<|sep|>'
        '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("stops", [(), ("there",)])
def test_choice_stream_reads_xtml_token_by_token(tiny_ckpt, stops, step):
    """Markers kept, other special tokens (a placeholder) dropped, a stop string cuts and ends. With
    several tokens an update (a speculative step's accepted drafts), the choice still ends at the
    token that completes the stop string: the tokens after it are not counted."""
    tok = Tokenizer.from_dir(tiny_ckpt)
    ids = tok.encode(TURN.format(ph="<｜place▁holder▁no▁7｜>"), allow_special=True)
    cs, deltas, lps = ChoiceStream(0, tok, stops, thinking=True), [], []
    for n in [*range(step, len(ids), step), len(ids)]:
        fake_lps = [{t: -1.0} for t in ids[:n]]
        upd = cs.update(RequestOutput("r", 0, [], "", ids[:n], n == len(ids), "stop" if n == len(ids) else None,
                                      logprobs=fake_lps))
        deltas += upd.deltas
        lps += upd.logprobs
        if upd.finished:
            break
    text = "".join(d.text for d in deltas if d.kind.value in ("reasoning", "content"))
    assert [t for t, _ in lps] == cs.token_ids == ids[:len(cs.token_ids)]
    if stops:
        assert (cs.final_reason(), text, cs.tool_calls) == ("stop", "hmmHi ", [])
        assert tok.decode(cs.token_ids[:-1]).count("there") == 0 and "there" in tok.decode(cs.token_ids)
    else:
        msg = cs.message({})
        assert (msg["reasoning_content"], msg["content"], cs.final_reason()) == ("hmm", "Hi there", "tool_calls")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("f", '{"x": 1}')]


# ---- generation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("thinking", [True, False])
def test_chat_stream_equals_whole(client, thinking):
    kw = dict(model="tiny", messages=HELLO, max_tokens=20, temperature=0,
              extra_body={"chat_template_kwargs": {"thinking": thinking}})
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    streamed = collect(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    reasoning = getattr(msg, "reasoning_content", None) or ""
    assert (streamed["reasoning"], streamed["content"]) == (reasoning, msg.content or "")
    assert streamed["finish"] == whole.choices[0].finish_reason == "length"
    assert streamed["usage"].completion_tokens == whole.usage.completion_tokens == 20
    # thinking on: the prompt opened <think> and a random model never closes it; off: all content
    assert (reasoning and not msg.content) if thinking else (msg.content and not reasoning)


def test_completions_n_and_seed(client):
    greedy = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8,
                                       temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].text == greedy.choices[1].text
    assert greedy.usage.completion_tokens == 16 and greedy.choices[0].finish_reason == "length"

    batch = client.completions.create(model="tiny", prompt=["One", "Two"], max_tokens=3, temperature=0, n=2,
                                      echo=True)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text[:3] for c in batch.choices] == ["One", "One", "Two", "Two"]

    def sample(seed):
        r = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=8, temperature=1.0,
                                      seed=seed, n=2)
        return [c.text for c in r.choices]
    a = sample(7)
    assert sample(7) == a and a[0] != a[1]          # reproducible; the two choices draw differently
    assert sample(8) != a
    streamed = collect(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, seed=3,
                                                      temperature=0.9, stream=True, extra_body=NO_THINK))
    again = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, seed=3, temperature=0.9,
                                           extra_body=NO_THINK)
    assert streamed["content"] == again.choices[0].message.content


def test_stop_strings(client):
    kw = dict(model="tiny", messages=HELLO, max_tokens=24, temperature=0, extra_body=NO_THINK)
    text = client.chat.completions.create(**kw).choices[0].message.content
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i)
    cut = text[:text.find(stop)]
    r = client.chat.completions.create(**kw, stop=[stop, "never-in-output"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    streamed = collect(client.chat.completions.create(**kw, stop=stop, stream=True))
    assert streamed["content"] == cut and streamed["finish"] == "stop"


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=NO_THINK)
    items = r.choices[0].logprobs.content
    assert len(items) == 6 and "".join(i.token for i in items) == r.choices[0].message.content
    for i in items:
        tops = [t.logprob for t in i.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and i.logprob == tops[0] <= 0  # greedy
    c = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)


# ---- structured output --------------------------------------------------------------------------------
def test_response_format_json_schema(client):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["color", "n"]}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                       max_tokens=60, temperature=0, extra_body=NO_THINK,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "pick", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(client, stream):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    choice = {"type": "function", "function": {"name": "get_weather"}} if stream else "required"
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=200,
              temperature=0, tools=WEATHER, tool_choice=choice, logit_bias={CLOSE_ID: 50}, extra_body=NO_THINK)
    if stream:
        out = collect(client.chat.completions.create(**kw, stream=True))
        calls, finish = [(c["name"], c["arguments"]) for c in out["calls"].values()], out["finish"]
    else:
        r = client.chat.completions.create(**kw)
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        finish = r.choices[0].finish_reason
        assert r.choices[0].message.tool_calls[0].id.startswith("call_")
    assert finish == "tool_calls" and calls and all(name == "get_weather" for name, _ in calls)
    for _, args in calls:
        jsonschema.validate(json.loads(args), WEATHER[0]["function"]["parameters"])


def test_tool_choice_auto_and_none(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=4, temperature=0,
              tools=WEATHER, extra_body=NO_THINK)
    auto = client.chat.completions.create(**kw, tool_choice="auto")
    none = client.chat.completions.create(**kw, tool_choice="none")
    # "none" leaves the tool declarations out of the prompt (and drops any call the model makes)
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"


# ---- errors -------------------------------------------------------------------------------------------
BAD = [  # (request overrides, status, param)
    ({"temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"no_such_field": 1}, 400, "no_such_field"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
    ({"model": "gpt-4"}, 404, "model"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools[0].function.name"),
    ({"stop": [""]}, 400, "stop"),
    ({"speculative": "no"}, 400, "speculative"),
    ({"n": 0}, 400, "n"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format.json_schema"),
]


def _post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(server.url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_bad_requests_name_the_field_while_good_ones_run(server, client):
    good: dict = {}

    def run_good():
        good["out"] = collect(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=48,
                                                             temperature=0, stream=True, extra_body=NO_THINK))
    t = threading.Thread(target=run_good)
    t.start()
    for override, status, param in BAD:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, **override}
        code, _, err = _post(server, "/v1/chat/completions", json.dumps(body).encode())
        assert (code, err["error"]["param"]) == (status, param), (override, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    code, _, err = _post(server, "/v1/chat/completions", b"{not json")
    assert code == 400 and "JSON" in err["error"]["message"]
    code, _, err = _post(server, "/v1/completions", json.dumps({"model": "tiny", "prompt": [10**9]}).encode())
    assert (code, err["error"]["param"]) == (400, "prompt")
    with pytest.raises(openai.BadRequestError) as e:       # and through the client
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=-5)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
    t.join(60)
    assert good["out"]["finish"] == "length" and good["out"]["content"]
    wait_idle(server)


# ---- admission, auth, cancellation ----------------------------------------------------------------------
def test_queue_bound_429_and_api_key(engine_dir):
    cfg = ServeConfig(engine_dir, port=_free_port(), model_name="tiny", api_key="sesame", max_queue=0,
                      engine_options={"max_batch": 2, "verify_checksums": False})
    with one_thread(), ServerThread(cfg) as s:
        anon = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            anon.models.list()
        assert e.value.body["code"] == "invalid_api_key"
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list()] == ["tiny"]
        # n=2 fills the bound (2 live + 0 queued); the next request is refused until it ends
        hog = c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3000, n=2, stream=True,
                                        extra_body={"ignore_eos": True})
        next(iter(hog))
        with pytest.raises(openai.RateLimitError) as e:
            c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
        assert e.value.response.headers["retry-after"] == "1" and e.value.body["code"] == "rate_limit_exceeded"
        hog.close()
        m = wait_idle(s)
        assert m["k3trt_requests_rejected_total"] == 1 and m['k3trt_requests_finished_total{reason="abort"}'] == 2
        assert c.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).choices[0].finish_reason


def test_client_disconnect_frees_blocks(server):
    before = metrics(server).get('k3trt_requests_finished_total{reason="abort"}', 0)
    for stream in (True, False):
        conn = http.client.HTTPConnection("127.0.0.1", server.cfg.port, timeout=30)
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 3000, "stream": stream, "ignore_eos": True}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200
            seen = 0
            while seen < 4:               # a few events in: the request is mid-generation
                seen += resp.fp.readline().startswith(b"data:")
        deadline = time.monotonic() + 20
        while (m := metrics(server))["k3trt_kv_cache_blocks_in_use"] == 0 or m["k3trt_requests_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        m = wait_idle(server)
        assert m["k3trt_generation_tokens_total"] < 10_000
    assert m['k3trt_requests_finished_total{reason="abort"}'] == before + 2


def test_health_models_metrics(server, client):
    assert json.loads(urllib.request.urlopen(server.url + "/health", timeout=10).read()) == {"status": "ok"}
    assert [(m.id, m.owned_by) for m in client.models.list()] == [("tiny", "k3trt")]
    assert client.models.retrieve("tiny").id == "tiny"
    resp = urllib.request.urlopen(server.url + "/metrics", timeout=10)
    assert resp.headers["Content-Type"].startswith("text/plain")
    m = metrics(server)
    for name in ("k3trt_requests_waiting", "k3trt_requests_running", "k3trt_generation_tokens_per_second",
                 "k3trt_spec_acceptance_rate", "k3trt_kv_cache_usage_ratio", "k3trt_kv_cache_blocks_total"):
        assert name in m
    assert m["k3trt_generation_tokens_total"] > 0 and m["k3trt_kv_cache_blocks_total"] > 0
    for path, method, status in (("/v1/nothing", "GET", 404), ("/v1/chat/completions", "GET", 405)):
        req = urllib.request.Request(server.url + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == status and json.loads(e.value.read())["error"]["message"]


def test_200_concurrent_streams_finish_and_free_everything(server):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            finish, text = None, ""
            stream = await c.chat.completions.create(model="tiny", max_tokens=4, temperature=0, stream=True,
                                                     messages=[{"role": "user", "content": f"Request {i}"}],
                                                     extra_body=NO_THINK)
            async for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            return finish, text
        try:
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await c.close()
    results = asyncio.run(main())
    assert len(results) == 200 and all(f == "length" and t for f, t in results)
    wait_idle(server)


def test_engine_fault_fails_requests_in_flight_and_the_loop_goes_on():
    class FlakyLLM:               # the first step raises, later ones finish everything
        counters = {"generated_tokens": 0}

        def __init__(self):
            self.reqs, self.fail = set(), True

        def add_request(self, prompt, params, request_id):
            self.reqs.add(request_id)

        def abort(self, rid):
            self.reqs.discard(rid)

        def has_unfinished(self):
            return bool(self.reqs)

        def step(self):
            if self.fail:
                self.fail = False
                raise RuntimeError("boom")
            outs = [RequestOutput(r, 0, [], "", [1], True, "length") for r in self.reqs]
            self.reqs.clear()
            return outs

    async def main():
        loop = EngineLoop(FlakyLLM(), max_pending=4)
        loop.start(asyncio.get_running_loop())
        q: asyncio.Queue = asyncio.Queue()
        try:
            loop.submit("a", [1], None, q)
            out = await asyncio.wait_for(q.get(), 10)
            assert (out.request_id, out.finish_reason) == ("a", "error") and "boom" in out.error
            loop.submit("b", [1], None, q)
            out = await asyncio.wait_for(q.get(), 10)
            assert (out.request_id, out.finish_reason) == ("b", "length") and loop.alive
        finally:
            await asyncio.to_thread(loop.stop)
    asyncio.run(main())


# ---- speculative decoding -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["ngram", "mtp"])
def spec_server(request, engine_dir):
    cfg = ServeConfig(engine_dir, port=_free_port(), model_name="tiny", json_max_whitespace=0,
                      engine_options={"verify_checksums": False, "speculative": request.param, "spec_tokens": 3})
    with one_thread(), ServerThread(cfg) as s:
        yield s


def _clients(*servers):
    return [openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60) for s in servers]


def _answer(r) -> tuple:
    """What a response says, ids and timestamps aside."""
    if r.object == "text_completion":
        return ([(c.text, c.finish_reason, c.logprobs and c.logprobs.tokens) for c in r.choices],
                r.usage.completion_tokens)
    return [(c.message.content, getattr(c.message, "reasoning_content", None), c.finish_reason,
             [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
             c.logprobs and [t.token for t in c.logprobs.content]) for c in r.choices], r.usage.completion_tokens


def _spec_counters(server_or_metrics) -> dict[str, float]:
    m = server_or_metrics if isinstance(server_or_metrics, dict) else metrics(server_or_metrics)
    return {k: v for k, v in m.items() if k.startswith("k3trt_spec_")}


def test_speculative_greedy_equals_plain(server, spec_server):
    """Greedy output is the same token for token with drafts as without: chat (thinking on and off,
    whole and streamed), completions (n, logprobs, a repetitive biased prompt the n-gram drafter
    predicts), stop strings (usage stops at the token that completes one)."""
    plain, spec = _clients(server, spec_server)
    text = plain.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, temperature=0,
                                         extra_body=NO_THINK).choices[0].message.content
    stop = next(text[i:i + 3] for i in range(6, len(text) - 3) if text.find(text[i:i + 3]) == i)
    asks = [("chat", dict(messages=HELLO, max_tokens=16)),
            ("chat", dict(messages=HELLO, max_tokens=16, extra_body=NO_THINK)),
            ("chat", dict(messages=HELLO, max_tokens=16, extra_body=NO_THINK, stop=[stop], logprobs=True)),
            ("chat", dict(messages=HELLO, max_tokens=16, extra_body={**NO_THINK, "speculative": False})),
            ("completions", dict(prompt=[5, 6, 7, 8] * 4, max_tokens=12, n=2, logprobs=2)),
            ("completions", dict(prompt="a b c", max_tokens=20, logit_bias={"100": 100}))]
    got = []
    for kind, kw in asks:
        create = (lambda c: c.chat.completions.create) if kind == "chat" else (lambda c: c.completions.create)
        want = _answer(create(plain)(model="tiny", temperature=0, **kw))
        got.append(_answer(create(spec)(model="tiny", temperature=0, **kw)))
        assert got[-1] == want, kw
    assert got[2][0][0][2] == "stop" and got[2][1] < 16            # the stop string ended it early
    streamed = collect(spec.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
    whole = plain.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, temperature=0)
    assert (streamed["reasoning"], streamed["content"], streamed["usage"].completion_tokens) == (
        whole.choices[0].message.reasoning_content or "", whole.choices[0].message.content or "", 16)
    assert _spec_counters(spec_server)["k3trt_spec_draft_tokens_total"] > 0
    wait_idle(spec_server)


@pytest.mark.parametrize("spec_server", ["ngram"], indirect=True)     # one drafter: each server compiles anew
def test_speculative_structured_output(server, spec_server):
    """Grammars under speculation: drafts are masked and cut by the runtime; json_schema validates,
    tool_choice required / named parse, and both equal the output without drafts."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    plain, spec = _clients(server, spec_server)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["color", "n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    ask = [{"role": "user", "content": "JSON please"}]
    r = spec.chat.completions.create(model="tiny", messages=ask, max_tokens=60, temperature=0, extra_body=NO_THINK,
                                     response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert _answer(r) == _answer(plain.chat.completions.create(model="tiny", messages=ask, max_tokens=60,
                                                              temperature=0, extra_body=NO_THINK, response_format=fmt))
    # thinking on: the grammar starts after the reasoning (after_reasoning matches the prompt)
    kw = dict(model="tiny", messages=ask, max_tokens=12, temperature=0, response_format=fmt)
    on = spec.chat.completions.create(**kw)
    assert on.choices[0].finish_reason == "length" and _answer(on) == _answer(plain.chat.completions.create(**kw))
    c = spec.completions.create(model="tiny", prompt="JSON:", max_tokens=40, temperature=0,
                                extra_body={"response_format": {"type": "json_object"}})
    assert c.choices[0].finish_reason == "stop" and isinstance(json.loads(c.choices[0].text), dict)

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=200,
                  temperature=0, tools=WEATHER, tool_choice=choice, logit_bias={CLOSE_ID: 50}, extra_body=NO_THINK)
        r = spec.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER[0]["function"]["parameters"])
        assert _answer(r) == _answer(plain.chat.completions.create(**kw))
    wait_idle(spec_server)


def test_speculative_metrics_opt_out_and_cancel(server, spec_server):
    """/metrics counts drafts live (not when requests finish); `speculative: false` drafts nothing;
    concurrent and cancelled speculative requests free every block."""
    (spec,) = _clients(spec_server)
    method = spec_server.state.llm.stats()["speculative"]["method"]
    plain_m = metrics(server)
    assert plain_m['k3trt_spec_tokens{method="none"}'] == 0 and plain_m["k3trt_spec_draft_tokens_total"] == 0
    m0 = _spec_counters(wait_idle(spec_server))
    assert m0[f'k3trt_spec_tokens{{method="{method}"}}'] == 3
    spec.completions.create(model="tiny", prompt="a b c", max_tokens=20, temperature=0, logit_bias={"100": 100},
                            extra_body={"speculative": False})
    assert _spec_counters(spec_server) == m0                      # opted out: not one draft

    # a long repetitive request, read while it runs: the counters move before it finishes
    stream = spec.completions.create(model="tiny", prompt="a b c", max_tokens=3000, temperature=0, stream=True,
                                     logit_bias={"100": 100}, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    deadline = time.monotonic() + 20
    while (m1 := _spec_counters(spec_server))["k3trt_spec_draft_tokens_total"] <= m0["k3trt_spec_draft_tokens_total"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for _ in range(8):
        next(chunks)
    stream.close()                                                # cancelled mid-generation
    m2 = _spec_counters(wait_idle(spec_server))
    steps = m2["k3trt_spec_verify_steps_total"]
    assert steps >= m1["k3trt_spec_verify_steps_total"] > m0["k3trt_spec_verify_steps_total"]
    assert sum(v for k, v in m2.items() if k.startswith("k3trt_spec_accepted_drafts_total")) == steps
    assert m2["k3trt_spec_mean_accepted_length"] == pytest.approx(1 + m2["k3trt_spec_accepted_tokens_total"] / steps)
    assert m2["k3trt_spec_acceptance_rate"] == pytest.approx(
        m2["k3trt_spec_accepted_tokens_total"] / m2["k3trt_spec_draft_tokens_total"])
    if method == "ngram":          # the biased output repeats one token: the n-gram drafts are right
        assert m2["k3trt_spec_accepted_tokens_total"] > m0["k3trt_spec_accepted_tokens_total"]
        assert m2["k3trt_spec_mean_accepted_length"] > 1 and m2["k3trt_spec_acceptance_rate"] > 0

    async def many():
        c = openai.AsyncOpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            finish = None
            stream = await c.chat.completions.create(
                model="tiny", max_tokens=8, temperature=0.8 if i % 3 else 0, seed=i, stream=True,
                messages=[{"role": "user", "content": f"Request {i}"}],
                extra_body={**NO_THINK, "speculative": i % 4 != 0})
            async for chunk in stream:
                finish = chunk.choices[0].finish_reason or finish
            return finish
        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await c.close()
    assert set(asyncio.run(many())) <= {"length", "stop", "tool_calls"}
    wait_idle(spec_server)


def test_serve_cli_passes_speculation(engine_dir, monkeypatch):
    seen = {}
    monkeypatch.setattr(k3trt.serve, "serve_main", lambda *a, **kw: seen.update(args=a, **kw))
    r = CliRunner().invoke(main, ["serve", str(engine_dir), "--speculative", "mtp", "--spec-tokens", "2",
                                  "--max-batch", "2"])
    assert r.exit_code == 0, r.output
    assert seen["engine_options"] == {"max_batch": 2, "speculative": "mtp", "spec_tokens": 2}
    r = CliRunner().invoke(main, ["serve", str(engine_dir)])
    assert r.exit_code == 0 and seen["engine_options"] == {}
