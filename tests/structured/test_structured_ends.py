"""Structured output that always ends, on the tiny engine (greedy): the README's Python example
gives valid JSON, and a forced tool call (tool_choice "required", built as the OpenAI server builds
it) completes within max_tokens 64 with its argument inside the schema's bound."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from runtime_utils import assert_released  # noqa: E402

from k3trt.runtime import xtml  # noqa: E402
from k3trt.runtime.chat import chat_ids  # noqa: E402
from k3trt.runtime.llm import LLM  # noqa: E402
from k3trt.runtime.params import SamplingParams  # noqa: E402
from k3trt.runtime.structured import GuidedSpec  # noqa: E402

LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 12}}, "required": ["q"]}}}


@pytest.fixture(scope="module")
def llm(engine):
    out = LLM(engine, verify_checksums=False)
    yield out
    out.close()


def test_readme_python_example_gives_json(llm):
    out = llm.generate(["Hello"], SamplingParams(max_tokens=64, guided={"json_schema": {"type": "object"}}))[0]
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    assert isinstance(json.loads(out.text), dict)
    assert_released(llm)


@pytest.mark.parametrize("choice", ["required", "lookup"])
def test_forced_tool_call_completes(llm, choice):
    ids = chat_ids(llm.tokenizer, [{"role": "user", "content": "Find cats."}], tools=[LOOKUP], thinking=False)
    # as serve/adapt.py builds it: chat, reasoning off, the server's default whitespace (None)
    spec = GuidedSpec.for_tools([LOOKUP], choice, parallel_tool_calls=True, chat=True, after_reasoning=False,
                                max_whitespace=None)
    out = llm.generate([ids], SamplingParams(max_tokens=64, guided=spec))[0]
    text = llm.tokenizer.decode(out.token_ids)
    assert out.finish_reason == "stop", (out.finish_reason, text)
    parsed = xtml.parse(text, thinking=False)
    assert not parsed.content
    (call,) = parsed.tool_calls
    assert call.name == "lookup" and set(call.arguments) == {"q"}
    assert isinstance(call.arguments["q"], str) and len(call.arguments["q"]) <= 12
    assert_released(llm)
