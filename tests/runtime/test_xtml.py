"""XTML parsing: the spec's examples, recovery cases, and streaming == whole-text parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3trt.runtime.chat import render
from k3trt.runtime.xtml import (
    SPECIALS,
    DeltaKind,
    ParsedOutput,
    StreamingParser,
    ToolCall,
    parse,
    reasoning_open,
)
from k3trt.runtime.xtml_values import arguments_json, escape_attr

O, S, C, E = "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"


def op(tag: str, **attrs) -> str:
    return O + tag + "".join(f' {k}="{escape_attr(str(v))}"' for k, v in attrs.items()) + S


def cl(tag: str) -> str:
    return C + tag + S


def arg(key: str, type_: str, raw: str) -> str:
    return op("argument", key=key, type=type_) + raw + cl("argument")


def call(name: str, *args: str, index: int = 1) -> str:
    return op("call", tool=name, index=index) + "".join(args) + cl("call")


def stream(text: str, cuts: list[int], thinking: bool = True):
    """Feed `text` split at `cuts`; return (reasoning, content, {index: [name, args]}, parser)."""
    parser, deltas, prev = StreamingParser(thinking=thinking), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        deltas += parser.feed(text[prev:cut])
        prev = cut
    deltas += parser.finish()
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.kind is DeltaKind.TOOL_NAME:
            assert d.index not in calls, "a call's name goes out once, first"
            calls[d.index] = [d.text, ""]
        elif d.kind is DeltaKind.TOOL_ARGS:
            calls[d.index][1] += d.text
    join = lambda k: "".join(d.text for d in deltas if d.kind is k) or None  # noqa: E731
    return join(DeltaKind.REASONING), join(DeltaKind.CONTENT), calls, parser


def assert_streams_like_parse(text: str, cuts: list[int], thinking: bool = True) -> ParsedOutput:
    whole = parse(text, thinking=thinking)
    reasoning, content, calls, parser = stream(text, cuts, thinking)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    assert tuple(parser.tool_calls) == whole.tool_calls
    for tc in whole.tool_calls:
        assert calls[tc.index] == [tc.name, arguments_json(tc.arguments)]
        assert json.loads(calls[tc.index][1]) == tc.arguments
    for part in (whole.reasoning, whole.content):
        assert part is None or not any(s in part for s in SPECIALS)
    return whole


# ---- the spec's examples ----------------------------------------------------------------------
SPEC_FULL = ("<|open|>think<|sep|>reasoning text<|close|>think<|sep|>\n"
             "<|open|>response<|sep|>visible answer<|close|>response<|sep|>\n"
             "<|open|>tools<|sep|>\n"
             '<|open|>call tool="get_weather" index="1"<|sep|>\n'
             '<|open|>argument key="city" type="string"<|sep|>Hangzhou<|close|>argument<|sep|>\n'
             '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>\n'
             "<|close|>call<|sep|>\n<|close|>tools<|sep|>\n<|close|>message<|sep|>")

SPEC_CASES = [
    (SPEC_FULL, True, ParsedOutput("reasoning text", "visible answer",
                                   (ToolCall("get_weather", {"city": "Hangzhou", "days": 3}, 0),))),
    ('<|open|>response<|sep|>answer<|close|>response<|sep|><|open|>tools<|sep|><|open|>call '
     'tool="calc" index="1"<|sep|><|open|>argument key="x" type="number"<|sep|>1<|close|>argument'
     '<|sep|><|close|>call<|sep|><|close|>tools<|sep|>', True,
     ParsedOutput(None, "answer", (ToolCall("calc", {"x": 1}, 0),))),
    ("<|open|>think<|sep|>step<|close|>think<|sep|><|open|>response<|sep|>answer", True,
     ParsedOutput("step", "answer")),
    ("unfinished reasoning", True, ParsedOutput("unfinished reasoning", None)),
]

NAMED_CASES = [
    # output starts with body text / a close marker (the prompt opened the channel)
    ("step<|close|>think<|sep|><|open|>response<|sep|>hi<|close|>response<|sep|>", True,
     ParsedOutput("step", "hi")),
    ("<|close|>think<|sep|><|open|>response<|sep|>hi", True, ParsedOutput(None, "hi")),
    ("hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", False,
     ParsedOutput(None, "hello")),
    # thinking off: everything is content, a think block included
    ("<|open|>think<|sep|>a<|close|>think<|sep|><|open|>response<|sep|>b", False,
     ParsedOutput(None, "ab")),
    # whitespace inside markers
    ("r<|close|> think <|sep|><|open|> response <|sep|>c<|close|>response <|sep|>"
     "<|open|>  call   tool=\"f\"   index=\"1\" <|sep|><|close|> call<|sep|>", True,
     ParsedOutput("r", "c", (ToolCall("f", {}, 0),))),
    # attribute escaping: &quot; decodes before &amp;, so an escaped literal "&quot;" survives
    ('<|close|>think<|sep|>' + call('a&quot;b', '<|open|>argument key="k&quot;&amp;" '
                                    'type="string"<|sep|>x<|close|>argument<|sep|>'), True,
     ParsedOutput(None, None, (ToolCall("a&quot;b", {'k"&': "x"}, 0),))),
    # typed arguments: strings raw (no unescaping), others json.loads, raw text when that fails
    ("<|close|>think<|sep|>" + call(
        "t", arg("s", "string", ' "1" &amp; \\n '), arg("n", "number", "2.5"), arg("b", "boolean", "true"),
        arg("z", "null", "null"), arg("o", "object", '{"a": [1, {"b": null}]}'),
        arg("l", "array", "[1, \"x\"]"), arg("bad", "number", "12abc"), arg("inf", "number", "1e999"),
        arg("nan", "number", "NaN"), arg("untyped", "integer", " 7 ")), True,
     ParsedOutput(None, None, (ToolCall("t", {"s": ' "1" &amp; \\n ', "n": 2.5, "b": True, "z": None,
                                              "o": {"a": [1, {"b": None}]}, "l": [1, "x"],
                                              "bad": "12abc", "inf": "1e999", "nan": "NaN",
                                              "untyped": 7}, 0),))),
    # the json element of the chat template; a repeated key keeps its first value
    ("<|close|>think<|sep|>" + call("j", op("json", type="object") + '{"a": 1, "b": "x"}' + cl("json"),
                                     arg("a", "number", "2"), arg("c", "string", "y")), True,
     ParsedOutput(None, None, (ToolCall("j", {"a": 1, "b": "x", "c": "y"}, 0),))),
    # two calls, no arguments, index in order of opening
    ("<|close|>think<|sep|><|open|>tools<|sep|>" + call("a") + "\n" + call("b", index=2) + cl("tools"),
     True, ParsedOutput(None, None, (ToolCall("a", {}, 0), ToolCall("b", {}, 1)))),
    # a call outside tools still parses; text in tools / call is dropped
    ("<|close|>think<|sep|>" + call("x", "junk", arg("k", "string", "v")) + "tail", True,
     ParsedOutput(None, "tail", (ToolCall("x", {"k": "v"}, 0),))),
    # truncation: inside the call marker, inside an argument → no call and no markup
    ('<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>'
     '<|open|>call tool="x"', True, ParsedOutput(None, "ok")),
    ('<|close|>think<|sep|>' + op("tools") + op("call", tool="x") + op("argument", key="k", type="string")
     + "val", True, ParsedOutput(None, None)),
    ("answer<|op", False, ParsedOutput(None, "answer<|op")),
    # malformed and stray markers are dropped, never shown
    ("a<|sep|>b<|open|>!!<|sep|>c<|open|>unfinished<|close|>response<|sep|>d", False,
     ParsedOutput(None, "abcd")),
    # marker text assembled across dropped markup does not become a marker
    ("<|op<|sep|>en|>x", False, ParsedOutput(None, "<|open|x")),
    # text between channels is content, stripped; after the end of the message it is ignored
    ("r<|close|>think<|sep|>\n  stray text \n<|open|>response<|sep|> c <|close|>response<|sep|>"
     "<|close|>message<|sep|><|end_of_msg|>late", True, ParsedOutput("r", "stray text c ")),
    # reasoning: a second think block continues it
    ("a<|close|>think<|sep|><|open|>think<|sep|>b<|close|>think<|sep|>c", True, ParsedOutput("ab", "c")),
]


@pytest.mark.parametrize("text,thinking,expected", SPEC_CASES + NAMED_CASES)
def test_cases(text, thinking, expected):
    assert parse(text, thinking=thinking) == expected
    assert_streams_like_parse(text, list(range(len(text))), thinking)  # one character at a time


def test_partial_marker_is_held_back_until_decided():
    p = StreamingParser(thinking=False)
    assert [d.text for d in p.feed("abc<|op")] == ["abc"]
    assert p.feed("en|>resp") == []
    assert [d.text for d in p.feed("onse<|sep|>x")] == ["x"]
    q = StreamingParser(thinking=False)
    assert [d.text for d in q.feed("x<|")] == ["x"]
    assert [d.text for d in q.feed("y")] == ["<|y"]


def test_tool_name_streams_before_arguments():
    p = StreamingParser()
    out = p.feed('<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="get" index="1"<|sep|>')
    assert [(d.kind, d.text, d.index) for d in out] == [(DeltaKind.TOOL_NAME, "get", 0)]
    out = p.feed('<|open|>argument key="city" type="string"<|sep|>Hang')
    assert "".join(d.text for d in out) == '{"city": "Hang'
    out = p.feed('zhou"<|close|>argument<|sep|><|open|>argument key="n" type="number"<|sep|>3')
    assert "".join(d.text for d in out) == 'zhou\\""'  # the number waits for its close
    out = p.feed("<|close|>argument<|sep|><|close|>call<|sep|>") + p.finish()
    assert "".join(d.text for d in out) == ', "n": 3}'
    assert p.tool_calls == [ToolCall("get", {"city": 'Hangzhou"', "n": 3}, 0)]


def test_reasoning_open():
    assert reasoning_open('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert not reasoning_open("<|open|>think<|sep|>a<|close|>think<|sep|><|open|>response<|sep|>")
    assert reasoning_open("<|open|>think<|sep|>old<|close|>think<|sep|>x<|open|> think <|sep|>")
    assert not reasoning_open("plain prompt")


# ---- properties -------------------------------------------------------------------------------
_TEXT = st.lists(st.sampled_from(list('ab <|>"&;\n\\é😀') + ["<|op", "|>", "<|", "en", "&quot;"]),
                 max_size=10).map("".join).map(lambda s: "" if any(x in s for x in SPECIALS) else s)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6)
                     | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=6)


@st.composite
def outputs(draw):
    """A valid K3 output (as after a `<|open|>think<|sep|>` prefix) and what it must parse to."""
    reasoning, content = draw(_TEXT), draw(_TEXT)
    calls = draw(st.lists(st.tuples(st.sampled_from(["get", "a&b", 'q"t']),
                                    st.dictionaries(_TEXT, _JSON, max_size=3)), max_size=2))
    message = {"role": "assistant", "reasoning_content": reasoning, "content": content,
               "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls]}
    prefix = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    text = render([message], add_generation_prompt=False)
    assert text.startswith(prefix)
    expected = ParsedOutput(reasoning if reasoning.strip() else None, content or None,
                            tuple(ToolCall(n, a, i) for i, (n, a) in enumerate(calls)))
    return text[len(prefix):] + draw(st.sampled_from(["", "<|end_of_msg|>"])), expected


@settings(max_examples=150, deadline=None, database=None)
@given(outputs(), st.lists(st.integers(0, 400), max_size=12))
def test_valid_outputs_parse_and_stream_alike(case, cuts):
    text, expected = case
    whole = assert_streams_like_parse(text, [c for c in cuts if c <= len(text)])
    assert whole == expected


_GARBAGE = st.lists(st.sampled_from(
    list(SPECIALS) + ["think", "response", "tools", "message", " call tool=\"f\"", ' argument key="k" '
                      'type="string"', ' type="number"', "json", "<|", "|>", "<|op", "en|>", "x", " ",
                      "\n", "1", "é", '"', "&amp;"]), max_size=40).map("".join)


@settings(max_examples=200, deadline=None, database=None)
@given(_GARBAGE, st.lists(st.integers(0, 300), max_size=10), st.booleans())
def test_random_text_never_raises_or_leaks(text, cuts, thinking):
    whole = assert_streams_like_parse(text, [c for c in cuts if c <= len(text)], thinking)
    for tc in whole.tool_calls:
        strings = [tc.name, *tc.arguments, *(v for v in tc.arguments.values() if isinstance(v, str))]
        assert not any(s in x for s in SPECIALS for x in strings)
