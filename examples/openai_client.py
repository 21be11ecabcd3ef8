"""Talking to `k3trt serve` with the official `openai` client: chat, streaming (reasoning and content),
tool calls, JSON-schema output, and speculative decoding (acceptance on /metrics, a per-request opt-out).

    k3trt serve ENGINE_DIR --port 8000 [--speculative mtp --spec-tokens 3] &      # then:
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 [--api-key KEY]

Without --base-url it builds the tiny random-weight engine and serves it in this process, so the
script runs anywhere in a few seconds. Random weights write gibberish and never close a channel on
their own, so for that demo only the tool call raises the `<|close|>` token with logit_bias (the
grammar decides where it may go) and thinking is turned off for the structured calls; a real K3
needs neither.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import tempfile
import urllib.request
from pathlib import Path

from openai import OpenAI

from k3trt.builder.build import build_engine
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.serve import ServeConfig, ServerThread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "n"]}


@contextlib.contextmanager
def tiny_server(workdir: Path, speculative: str = "ngram"):
    """Build the tiny engine (once) and serve it on a free loopback port for the duration."""
    ckpt, engine = workdir / "tiny-ckpt", workdir / "tiny-engine"
    if not ckpt.exists():
        make_checkpoint("tiny", ckpt, seed=0)
    if not engine.exists():
        build_engine(ckpt, engine, dtype="fp32", capacities=[1, 2, 4], max_num_tokens=64, spec_tokens=0,
                     block_size=16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServeConfig(engine, port=port, json_max_whitespace=0, engine_options={"speculative": speculative})
    with ServerThread(cfg) as server:
        yield server.url + "/v1"


def demo(client: OpenAI, tiny: bool) -> None:
    model = client.models.list().data[0].id
    structured = {"chat_template_kwargs": {"thinking": False}} if tiny else {}
    ask = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]

    # 1. chat: K3 thinks first; the reasoning comes back apart from the answer
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=32, temperature=0.6, seed=1)
    msg = r.choices[0].message
    print("chat reasoning:", repr(getattr(msg, "reasoning_content", None)))
    print("chat content:  ", repr(msg.content), "| finish:", r.choices[0].finish_reason, "| usage:", r.usage)

    # 2. streaming: reasoning_content and content deltas as they are generated
    print("stream: ", end="")
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count."}],
                                                max_tokens=24, stream=True):
        delta = chunk.choices[0].delta
        print(getattr(delta, "reasoning_content", None) or delta.content or "", end="", flush=True)
    print()

    # 3. tools: tool_choice "required" (or a named tool) constrains the output to a valid call
    bias = {"logit_bias": {"129282": 50}} if tiny else {}
    r = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice="required",
                                       max_tokens=256, temperature=0, extra_body=structured, **bias)
    for call in r.choices[0].message.tool_calls or []:
        print("tool call:", call.function.name, json.loads(call.function.arguments))
    print("finish:", r.choices[0].finish_reason)

    # 4. structured output: the answer matches the JSON schema
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Pick a color and a digit, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK}},
        max_tokens=64, temperature=0, extra_body=structured)
    print("json_schema:", json.loads(r.choices[0].message.content))

    # 5. speculative decoding (a server started with --speculative): greedy output is the same with
    # drafts as without; "speculative": false opts one request out; /metrics counts acceptance live
    kw = dict(model=model, messages=[{"role": "user", "content": "Repeat: la la la la la la"}], max_tokens=32,
              temperature=0)
    drafted = client.chat.completions.create(**kw).choices[0].message.content
    plain = client.chat.completions.create(**kw, extra_body={"speculative": False}).choices[0].message.content
    print("speculative == plain:", drafted == plain)
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
    metrics = urllib.request.urlopen(url, timeout=30).read().decode()
    print("\n".join(line for line in metrics.splitlines() if line.startswith("k3trt_spec_")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server's /v1 URL (default: serve the tiny engine)")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--workdir", type=Path, default=None, help="where to build the tiny engine")
    ap.add_argument("--speculative", default="ngram", help="the tiny server's drafter: none | ngram | mtp")
    args = ap.parse_args()
    if args.base_url:
        demo(OpenAI(base_url=args.base_url, api_key=args.api_key), tiny=False)
        return
    with tiny_server(args.workdir or Path(tempfile.mkdtemp(prefix="k3trt-serve-")), args.speculative) as url:
        demo(OpenAI(base_url=url, api_key=args.api_key), tiny=True)


if __name__ == "__main__":
    main()
