"""Structured output that always ends, on the tiny engine (greedy): the README's Python example
gives valid JSON, and a forced tool call (tool_choice "required", built as the OpenAI server builds
it) completes within max_tokens 64 with its argument inside the schema's bound, with thinking off
and with thinking on (the grammar bounds the reasoning: GuidedSpec.max_reasoning_chars)."""

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


REASONING_CHARS = 8   # at most 8 tokens of ASCII reasoning, 32 of any: the call still fits in 64


@pytest.mark.parametrize("thinking", [False, True], ids=["thinking-off", "thinking-on"])
@pytest.mark.parametrize("choice", ["required", "lookup"])
def test_forced_tool_call_completes(llm, choice, thinking):
    ids = chat_ids(llm.tokenizer, [{"role": "user", "content": "Find cats."}], tools=[LOOKUP], thinking=thinking)
    # as serve/adapt.py builds it: chat, after_reasoning as the prompt says, the server's default
    # whitespace (None)
    spec = GuidedSpec.for_tools([LOOKUP], choice, parallel_tool_calls=True, chat=True, after_reasoning=thinking,
                                max_whitespace=None, max_reasoning_chars=REASONING_CHARS if thinking else None)
    out = llm.generate([ids], SamplingParams(max_tokens=64, guided=spec))[0]
    text = llm.tokenizer.decode(out.token_ids)
    assert out.finish_reason == "stop", (out.finish_reason, text)
    parsed = xtml.parse(text, thinking=thinking)
    assert not parsed.content
    assert len(parsed.reasoning or "") <= (REASONING_CHARS if thinking else 0)
    (call,) = parsed.tool_calls
    assert call.name == "lookup" and set(call.arguments) == {"q"}
    assert isinstance(call.arguments["q"], str) and len(call.arguments["q"]) <= 12
    assert_released(llm)
