"""Tool-call grammars enforce each argument's schema (structured/grammars.py), checked with
xgrammar's matcher directly: a whole XTML call block is accepted or rejected. Markers go in by id,
the fixed text between them as the tokenizer's own ids (as the grammar asks for it), values as text.
Also: the default JSON whitespace cap, the bounded call count and the reasoning budget of
GuidedSpec."""

from __future__ import annotations

import re

import pytest

xgr = pytest.importorskip("xgrammar")

from k3trt.runtime.params import SamplingParams  # noqa: E402
from k3trt.runtime.structured import (  # noqa: E402
    DEFAULT_MAX_WHITESPACE,
    DEFAULT_TOOL_REASONING_CHARS,
    GrammarError,
    GrammarVocab,
    GuidedSpec,
    compile_guide,
)

_MARKER = re.compile(r"(<\|open\|>|<\|close\|>|<\|sep\|>)")


@pytest.fixture(scope="module")
def vocab(tok):
    return GrammarVocab(tok, vocab_size=tok.vocab_size + 64)


def obj(required: list[str], **properties) -> dict:
    return {"type": "object", "properties": properties, "required": required}


def arg(key: str, type_: str, value: str) -> str:
    return f'<|open|>argument key="{key}" type="{type_}"<|sep|>{value}<|close|>argument<|sep|>'


def whole(value: str) -> str:
    """The json element a call holds where its schema is not checked argument by argument."""
    return f'<|open|>json type="object"<|sep|>{value}<|close|>json<|sep|>'


def call(arguments: str, index: int = 1, name: str = "f") -> str:
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{arguments}<|close|>call<|sep|>'


def turn(*calls: str) -> str:
    return ("<|close|>response<|sep|><|open|>tools<|sep|>" + "".join(calls)
            + "<|close|>tools<|sep|><|close|>message<|sep|>")


def accepts(vocab, tok, spec: GuidedSpec, text: str) -> bool:
    """The grammar takes `text` and then ends (eos)."""
    m = xgr.GrammarMatcher(compile_guide(spec, vocab).grammar)
    ids = {"<|open|>": vocab.open_id, "<|close|>": vocab.close_id, "<|sep|>": vocab.sep_id}
    after = None
    for piece in _MARKER.split(text):
        if piece in ids:
            ok = m.accept_token(ids[piece])
            after = piece
        elif not piece:
            continue
        elif after in ("<|open|>", "<|close|>"):      # fixed text: the tokenizer's own ids
            ok = all(m.accept_token(t) for t in tok.encode(piece))
        else:
            ok = m.accept_string(piece)
        if not ok:
            return False
    return m.accept_token(vocab.eos_id) and m.is_terminated()


def one_tool(parameters: dict, **kw) -> GuidedSpec:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    return GuidedSpec.for_tools([tool], "required", **kw)


S12 = obj(["q"], q={"type": "string", "maxLength": 12})

CASES = [  # (feature, parameters, arguments, accepted)
    ("maxLength", S12, arg("q", "string", "cats"), True),
    ("maxLength", S12, arg("q", "string", "x" * 12), True),
    ("maxLength", S12, arg("q", "string", "x" * 13), False),
    ("maxLength counts characters", obj(["q"], q={"type": "string", "maxLength": 5}),
     arg("q", "string", "héllo"), True),
    ("minLength", obj(["q"], q={"type": "string", "minLength": 2}), arg("q", "string", "x"), False),
    ("minLength", obj(["q"], q={"type": "string", "minLength": 2}), arg("q", "string", "xy"), True),
    ("pattern + maxLength", obj(["q"], q={"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}),
     arg("q", "string", "abcd"), False),
    ("pattern + maxLength", obj(["q"], q={"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}),
     arg("q", "string", "abc"), True),
    ("pattern + maxLength", obj(["q"], q={"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}),
     arg("q", "string", "aB"), False),
    ("pattern + minLength", obj(["q"], q={"type": "string", "pattern": "\\d{2,8}", "minLength": 4}),
     arg("q", "string", "123"), False),
    ("pattern + minLength", obj(["q"], q={"type": "string", "pattern": "\\d{2,8}", "minLength": 4}),
     arg("q", "string", "1234"), True),
    ("pattern", obj(["t"], t={"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}),
     arg("t", "string", "12:3"), False),
    ("string enum", obj(["u"], u={"enum": ["c", "f"]}), arg("u", "string", "k"), False),
    ("string enum", obj(["u"], u={"enum": ["c", "f"]}), arg("u", "string", "f"), True),
    ("string const", obj(["c"], c={"const": "x"}), arg("c", "string", "y"), False),
    ("number const", obj(["c"], c={"const": 3}), arg("c", "number", "4"), False),
    ("number const", obj(["c"], c={"const": 3}), arg("c", "number", "3"), True),
    ("number enum", obj(["e"], e={"enum": [1, 2]}), arg("e", "number", "3"), False),
    ("integer", obj(["n"], n={"type": "integer"}), arg("n", "number", "1.5"), False),
    ("integer", obj(["n"], n={"type": "integer"}), arg("n", "number", "15"), True),
    ("integer bounds", obj(["n"], n={"type": "integer", "minimum": 1, "maximum": 5}),
     arg("n", "number", "6"), False),
    ("number", obj(["x"], x={"type": "number"}), arg("x", "number", "-2.5e3"), True),
    ("number", obj(["x"], x={"type": "number"}), arg("x", "number", "abc"), False),
    ("boolean", obj(["b"], b={"type": "boolean"}), arg("b", "boolean", "true"), True),
    ("boolean", obj(["b"], b={"type": "boolean"}), arg("b", "boolean", "1"), False),
    ("nested object", obj(["o"], o=obj(["a"], a={"type": "string", "maxLength": 2})),
     arg("o", "object", '{"a": "xy"}'), True),
    ("nested object: extra key", obj(["o"], o=obj(["a"], a={"type": "string"})),
     arg("o", "object", '{"a": "x", "z": 1}'), False),
    ("nested object: required key", obj(["o"], o=obj(["a"], a={"type": "string"})),
     arg("o", "object", "{}"), False),
    ("nested object: maxLength", obj(["o"], o=obj(["a"], a={"type": "string", "maxLength": 2})),
     arg("o", "object", '{"a": "xyz"}'), False),
    ("array maxItems", obj(["a"], a={"type": "array", "items": {"type": "integer"}, "maxItems": 2}),
     arg("a", "array", "[1, 2, 3]"), False),
    ("required key", obj(["a", "b"], a={"type": "string"}, b={"type": "integer"}),
     arg("a", "string", "x"), False),
    ("optional key", obj(["a"], a={"type": "string"}, b={"type": "integer"}),
     arg("a", "string", "x"), True),
    ("optional key", obj(["a"], a={"type": "string"}, b={"type": "integer"}),
     arg("a", "string", "x") + arg("b", "number", "2"), True),
    ("undeclared key", obj(["a"], a={"type": "string"}),
     arg("a", "string", "x") + arg("z", "string", "y"), False),
    ("union (json element)", obj(["v"], v={"anyOf": [{"type": "string", "maxLength": 4},
                                                     {"type": "number"}]}),
     whole('{"v": "abcde"}'), False),
    ("union (json element)", obj(["v"], v={"anyOf": [{"type": "string", "maxLength": 4},
                                                     {"type": "number"}]}),
     whole('{"v": 3}'), True),
    ("type list (json element)", obj(["n"], n={"type": ["integer", "string"], "maxLength": 3}),
     whole('{"n": "abcd"}'), False),
]


@pytest.mark.parametrize("feature,parameters,arguments,accepted", CASES,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_argument_schema_is_enforced(feature, parameters, arguments, accepted, vocab, tok):
    spec = one_tool(parameters)
    assert accepts(vocab, tok, spec, turn(call(arguments))) is accepted, feature


def test_forced_call_has_no_free_text_and_a_bounded_count(vocab, tok):
    spec = one_tool(S12)
    ok = call(arg("q", "string", "cats"))
    assert accepts(vocab, tok, spec, turn(ok))
    assert not accepts(vocab, tok, spec, "hello" + turn(ok))                 # no response text
    assert not accepts(vocab, tok, spec, turn())                             # a call is forced
    # parallel calls: one per tool offered by default, max_tool_calls to allow more
    assert spec.tool_call_limit == 1 and not accepts(vocab, tok, spec, turn(ok, ok))
    three = one_tool(S12, max_tool_calls=3)
    assert three.tool_call_limit == 3
    assert accepts(vocab, tok, three, turn(ok, ok, ok))
    assert not accepts(vocab, tok, three, turn(ok, ok, ok, ok))
    assert one_tool(S12, max_tool_calls=3, parallel_tool_calls=False).tool_call_limit == 1
    with pytest.raises(GrammarError, match="max_tool_calls"):
        one_tool(S12, max_tool_calls=0)


def test_fixed_text_is_asked_for_as_the_tokenizers_ids(vocab, tok):
    """Any other split of a header into tokens is refused (a model pays for none of them)."""
    spec = one_tool(S12)
    m = xgr.GrammarMatcher(compile_guide(spec, vocab).grammar)
    assert m.accept_token(vocab.close_id)
    assert tok.encode("response") != [tok.encode(c)[0] for c in "response"]
    assert not m.accept_string("r")
    assert all(m.accept_token(t) for t in tok.encode("response"))
    assert vocab.canonical_ids("response") == tuple(tok.encode("response"))


def test_default_whitespace_cap():
    """Every front end passes None when nothing is configured: that is the default cap."""
    assert DEFAULT_MAX_WHITESPACE == 0
    default = GuidedSpec(json_object=True)
    assert default.max_whitespace == DEFAULT_MAX_WHITESPACE
    assert GuidedSpec(json_object=True, max_whitespace=None) == default
    assert GuidedSpec.from_response_format({"type": "json_object"}, max_whitespace=None) == default
    assert GuidedSpec(json_object=True, max_whitespace=4).max_whitespace == 4
    params = SamplingParams(guided={"json_schema": {"type": "object"}, "max_whitespace": 3})
    assert params.guided.max_whitespace == 3
    assert SamplingParams(guided={"json_schema": {"type": "object"}}).guided.max_whitespace == 0


def test_default_whitespace_cap_in_the_grammar(vocab):
    def takes(spec: GuidedSpec, text: str) -> bool:
        m = xgr.GrammarMatcher(compile_guide(spec, vocab).grammar)
        return m.accept_string(text) and m.accept_token(vocab.eos_id)

    schema = {"type": "object"}
    assert takes(GuidedSpec(json_schema=schema), '{"a": 1}')
    assert not takes(GuidedSpec(json_schema=schema), '{ "a": 1}')
    assert takes(GuidedSpec(json_schema=schema, max_whitespace=2), '{  "a":1}')
    assert not takes(GuidedSpec(json_schema=schema, max_whitespace=2), '{   "a":1}')


THINK = "<|close|>think<|sep|>"
RESPONSE = "<|open|>response<|sep|>"


def test_reasoning_budget_defaults():
    """A forced call always bounds its reasoning; other grammars only when asked; without
    reasoning (after_reasoning False) there is nothing to bound."""
    assert one_tool(S12, after_reasoning=True).max_reasoning_chars == DEFAULT_TOOL_REASONING_CHARS
    assert one_tool(S12, after_reasoning=True, max_reasoning_chars=None) == one_tool(S12, after_reasoning=True)
    assert one_tool(S12, after_reasoning=True, max_reasoning_chars=7).max_reasoning_chars == 7
    assert one_tool(S12, max_reasoning_chars=7).max_reasoning_chars is None
    assert GuidedSpec(json_object=True, after_reasoning=True).max_reasoning_chars is None
    assert GuidedSpec(json_object=True, after_reasoning=True, max_reasoning_chars=0).bounds_reasoning
    params = SamplingParams(guided={"json_object": True, "after_reasoning": True, "max_reasoning_chars": 9})
    assert params.guided.max_reasoning_chars == 9
    for bad in (-1, 2.5, True, "9"):
        with pytest.raises(GrammarError, match="max_reasoning_chars"):
            one_tool(S12, after_reasoning=True, max_reasoning_chars=bad)


def test_forced_call_reasoning_is_bounded(vocab, tok):
    spec = one_tool(S12, after_reasoning=True, max_reasoning_chars=5)
    ok = turn(call(arg("q", "string", "cats")))
    assert accepts(vocab, tok, spec, "héllo" + THINK + RESPONSE + ok)     # characters, not bytes
    assert accepts(vocab, tok, spec, THINK + RESPONSE + ok)
    assert not accepts(vocab, tok, spec, "hello!" + THINK + RESPONSE + ok)
    assert not accepts(vocab, tok, spec, "hi" + RESPONSE + ok)           # think must close
    assert not accepts(vocab, tok, spec, "hi" + THINK + RESPONSE + "<|close|>response<|sep|>"
                       "<|close|>message<|sep|>")                        # ...and a call follow
    m = xgr.GrammarMatcher(compile_guide(spec, vocab).grammar)
    assert m.accept_string("x" * 5)
    bm = vocab.allocate_bitmask(1)
    m.fill_next_token_bitmask(bm, 0)
    allowed = [t for t in range(vocab.vocab_size) if (int(bm[0, t >> 5]) >> (t & 31)) & 1]
    assert allowed == [vocab.close_id]                                   # the budget is spent


def test_default_budget_in_the_grammar(vocab, tok):
    spec = one_tool(S12, after_reasoning=True)
    ok = THINK + RESPONSE + turn(call(arg("q", "string", "cats")))
    assert accepts(vocab, tok, spec, "a" * DEFAULT_TOOL_REASONING_CHARS + ok)
    assert not accepts(vocab, tok, spec, "a" * (DEFAULT_TOOL_REASONING_CHARS + 1) + ok)


@pytest.mark.parametrize("chat", [True, False])
def test_json_reasoning_budget(vocab, tok, chat):
    spec = GuidedSpec(json_object=True, chat=chat, after_reasoning=True, max_reasoning_chars=3)
    tail = "<|close|>response<|sep|><|close|>message<|sep|>" if chat else ""
    head = RESPONSE if chat else ""
    assert accepts(vocab, tok, spec, "abc" + THINK + head + "{}" + tail)
    assert not accepts(vocab, tok, spec, "abcd" + THINK + head + "{}" + tail)
    assert compile_guide(spec, vocab).new_state().in_reasoning is False  # no gate: the grammar
    free = GuidedSpec(json_object=True, chat=chat, after_reasoning=True)
    assert compile_guide(free, vocab).new_state().in_reasoning is True   # the gate
