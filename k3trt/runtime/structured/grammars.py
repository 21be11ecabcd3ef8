"""From a `GuidedSpec` to an xgrammar `Grammar` over one vocabulary: plain JSON / regex / EBNF, the
XTML chat frame around them, and the XTML tool-call structural tag.

XTML markers are always asked for as tokens by id (`vocab.py` makes them unreachable as text), and
the bodies between them are text grammars, so a marker can neither be skipped nor appear inside a
value; the fixed text between markers (channel names, headers) is asked for as the tokenizer's own
ids. A forced tool call bounds its reasoning, leaves the response body empty and allows at most
`GuidedSpec.tool_call_limit` calls, so it always ends. A tool call (spec/XTML.md):
    <|open|>call tool="NAME" index="N"<|sep|>ARGUMENTS<|close|>call<|sep|>
ARGUMENTS is one `<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>` per
property of the tool's schema, in schema order, required ones always and optional ones maybe,
when every property is simple enough to check argument by argument: a string property's VALUE is
its raw text (enum / const / pattern / length encoded exactly), any other type's VALUE is JSON
checked against the property's schema. Otherwise (unions, $ref, formats, property-count limits,
no properties) the call holds one `<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>`
element checked against the whole schema, which the XTML parser reads the same way.

Bounded reasoning (`GuidedSpec.max_reasoning_chars`): the grammar starts at the first output
token with at most n characters of reasoning text, then `<|close|>think<|sep|>`; the reasoning
text cannot hold a marker, so the close the grammar asks for is the one that ends it. Unbounded
reasoning stays outside the grammar (state.py's gate).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from k3trt.runtime.structured.spec import GrammarError, GuidedSpec
from k3trt.runtime.structured.vocab import GrammarVocab, xgr
from k3trt.runtime.xtml_values import escape_attr

log = logging.getLogger(__name__)

Format = dict[str, Any]  # one structural-tag format, as JSON

# keywords that keep a schema from being checked argument by argument (see the module doc)
_TOP_LEVEL_BLOCKERS = frozenset({
    "$ref", "$defs", "definitions", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
    "minProperties", "maxProperties", "unevaluatedProperties", "enum", "const"})
_VALUE_BLOCKERS = frozenset({"$ref", "allOf", "anyOf", "oneOf", "not", "if", "then", "else"})
_ARG_TYPES = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null",
              "object": "object", "array": "array"}  # as chat.py writes argument types


def _tok(token_id: int) -> Format:
    return {"type": "token", "token": token_id}


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def _seq(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def _any_of(elements: list[Format]) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}


def _tag(elements: list[Format]) -> str:
    return json.dumps({"type": "structural_tag", "format": _seq(elements)}, ensure_ascii=False)


class _Xtml:
    """Marker formats for one vocabulary."""

    def __init__(self, vocab: GrammarVocab) -> None:
        self.v = vocab

    def text(self, fixed: str) -> list[Format]:
        """Fixed text between markers, as the tokenizer's own ids where it has them."""
        ids = self.v.canonical_ids(fixed)
        return [_const(fixed)] if ids is None else [_tok(i) for i in ids]

    def open(self, header: str) -> list[Format]:
        return [_tok(self.v.open_id), *self.text(header), _tok(self.v.sep_id)]

    def close(self, name: str) -> list[Format]:
        return [_tok(self.v.close_id), *self.text(name), _tok(self.v.sep_id)]


def _json_ws(spec: GuidedSpec) -> dict[str, Any]:
    """Whitespace options of Grammar.from_json_schema."""
    if spec.max_whitespace == 0:
        return {"any_whitespace": False}
    return {"max_whitespace_cnt": spec.max_whitespace}


def _tag_ws(spec: GuidedSpec) -> dict[str, Any]:
    """Whitespace options of a structural tag's json_schema format (it has no fixed layout)."""
    return {"max_whitespace_cnt": max(1, spec.max_whitespace)}


def _body(spec: GuidedSpec) -> Any:
    x = xgr()
    if spec.json_schema is not None:
        return x.Grammar.from_json_schema(spec.json_schema, strict_mode=True, **_json_ws(spec))
    if spec.json_object:
        return x.Grammar.from_json_schema('{"type":"object"}', strict_mode=True, **_json_ws(spec))
    if spec.regex is not None:
        return x.Grammar.from_regex(spec.regex)
    return x.Grammar.from_ebnf(spec.grammar)


def build_grammar(spec: GuidedSpec, vocab: GrammarVocab) -> Any:
    """The xgrammar Grammar of `spec` (markers resolved against `vocab`)."""
    x = xgr()
    if spec.chat and not vocab.has_markers:
        raise GrammarError("chat", "the tokenizer has no <|open|>/<|close|>/<|sep|> tokens; chat "
                                   "and tool-call grammars need a K3 tokenizer")
    if spec.bounds_reasoning and not vocab.has_markers:
        raise GrammarError("max_reasoning_chars", "the tokenizer has no <|close|>/<|sep|> tokens; "
                                                  "bounded reasoning needs a K3 tokenizer")
    m = _Xtml(vocab)
    if spec.tool_choice is not None:
        return x.Grammar.from_structural_tag(_tool_tag(spec, m))
    # the prompt opened think: in chat form the grammar opens the response after it
    head = _reasoning(spec, m) + (m.open("response") if spec.chat and spec.after_reasoning else [])
    parts = [x.Grammar.from_structural_tag(_tag(head))] if head else []
    parts.append(_body(spec))
    if spec.chat:
        parts.append(x.Grammar.from_structural_tag(_tag(m.close("response") + m.close("message"))))
    return parts[0] if len(parts) == 1 else x.Grammar.concat(*parts)


def _reasoning(spec: GuidedSpec, m: _Xtml) -> list[Format]:
    """The bounded reasoning and the close of `think`, or nothing where reasoning is free."""
    if not spec.bounds_reasoning:
        return []
    n = spec.max_reasoning_chars
    text = [{"type": "regex", "pattern": f"[\\s\\S]{{0,{n}}}"}] if n else []
    return text + m.close("think")


# ---- tool calls ---------------------------------------------------------------------------------
def _tool_tag(spec: GuidedSpec, m: _Xtml) -> str:
    calls = _any_of([_call(tool, m, spec) for tool in spec.tool_list()])
    if spec.tool_call_limit > 1:
        calls = {"type": "repeat", "min": 1, "max": spec.tool_call_limit, "content": calls}
    head = _reasoning(spec, m) + (m.open("response") if spec.after_reasoning else [])
    # the response body is empty: free text there is unbounded, and a model that never closes it
    # never reaches the call the request forces (OpenAI's forced calls carry no content either)
    return _tag(head + m.close("response") + m.open("tools") + [calls] + m.close("tools")
                + m.close("message"))


def _call(tool: dict[str, Any], m: _Xtml, spec: GuidedSpec) -> Format:
    header = [_tok(m.v.open_id), *m.text(f'call tool="{escape_attr(tool["name"])}" index="'),
              {"type": "regex", "pattern": "[1-9][0-9]{0,2}"}, _const('"'), _tok(m.v.sep_id)]
    return _seq(header + _arguments(tool["parameters"], m, spec) + m.close("call"))


def _arguments(schema: Any, m: _Xtml, spec: GuidedSpec) -> list[Format]:
    plan = _per_argument(schema)
    if plan is None:
        log.debug("tool schema checked as one json element: %s", json.dumps(schema)[:200])
        value = {"type": "json_schema", "json_schema": schema, **_tag_ws(spec)}
        return m.open('json type="object"') + [value] + m.close("json")
    out: list[Format] = []
    for key, type_attr, value, required in plan:
        if value["type"] == "json_schema":
            value = {**value, **_tag_ws(spec)}
        element = _seq(m.open(f'argument key="{escape_attr(key)}" type="{type_attr}"') + [value]
                       + m.close("argument"))
        out.append(element if required else {"type": "optional", "content": element})
    return out


def _per_argument(schema: Any) -> list[tuple[str, str, Format, bool]] | None:
    """[(key, type attribute, value format, required)] or None where the schema needs the json
    element (see the module doc)."""
    if not isinstance(schema, dict) or _TOP_LEVEL_BLOCKERS & schema.keys():
        return None
    props, required = schema.get("properties"), schema.get("required", [])
    if (schema.get("type", "object") != "object" or not isinstance(props, dict)
            or not isinstance(required, list)):
        return None
    if not props:
        # no declared arguments: none at all if no others are allowed, else any object
        return [] if schema.get("additionalProperties") is False and not required else None
    if not set(required) <= props.keys():
        return None
    plan = []
    for key, sub in props.items():
        typed = _value(sub)
        if typed is None:
            return None
        plan.append((key, *typed, key in required))
    return plan


def _value(sub: Any) -> tuple[str, Format] | None:
    """(type attribute, value format) for one property, or None."""
    if not isinstance(sub, dict) or _VALUE_BLOCKERS & sub.keys() or '"$ref"' in json.dumps(sub):
        return None
    choices = [sub["const"]] if "const" in sub else sub.get("enum")
    type_ = sub.get("type")
    if choices is not None:
        if not isinstance(choices, list) or not choices:
            return None
        if all(isinstance(c, str) for c in choices):
            return "string", _string_choices(choices)
        if any(isinstance(c, str) for c in choices):
            return None  # mixed: one type attribute cannot cover both forms
        type_ = type_ or {bool: "boolean", type(None): "null", dict: "object", list: "array"}.get(
            type(choices[0]), "number")
    if isinstance(type_, list):
        if "string" in type_ or not type_:
            return None
        type_ = type_[0]
    if type_ == "string":
        value = _string_value(sub)
        return None if value is None else ("string", value)
    if type_ in _ARG_TYPES:
        return _ARG_TYPES[type_], {"type": "json_schema", "json_schema": sub}
    return None


def _string_choices(choices: list[str]) -> Format:
    nonempty = [_const(c) for c in dict.fromkeys(choices) if c]
    if not nonempty:
        return _const("")
    inner = _any_of(nonempty)
    return {"type": "optional", "content": inner} if "" in choices else inner


def _string_value(sub: dict[str, Any]) -> Format | None:
    """The raw text of a string argument: its pattern, its length bounds, or any text (a marker
    cannot occur in it). A pattern with length bounds takes both only where the pattern is one
    repeated character class (`^[a-z]+$`); any other needs the json element, where xgrammar keeps
    the pattern and drops the bounds."""
    lo, hi = sub.get("minLength", 0), sub.get("maxLength")
    bounded = bool(lo) or hi is not None
    if "format" in sub:
        return None
    if "pattern" in sub and bounded:
        pattern = _bounded_pattern(sub["pattern"], int(lo), None if hi is None else int(hi))
        if pattern is None:
            log.warning("string pattern %r with length bounds: only the pattern is enforced",
                        sub["pattern"])
            return None
        return {"type": "regex", "pattern": pattern}
    if "pattern" in sub:
        return {"type": "regex", "pattern": sub["pattern"]}
    if bounded:
        return {"type": "regex", "pattern": f"[\\s\\S]{{{int(lo)},{'' if hi is None else int(hi)}}}"}
    return {"type": "any_text"}


# one character class (or escape, `.`, or a plain character), repeated, optionally anchored
_REPEATED_CLASS = re.compile(r"\^?(\[(?:\\.|[^\]\\])+\]|\\[dDwWsS]|\.|[\w \-])"
                             r"(\*|\+|\?|\{(\d+)(,(\d*))?\})?\$?")
_QUANTIFIERS = {"*": (0, None), "+": (1, None), "?": (0, 1), None: (1, 1)}


def _bounded_pattern(pattern: str, lo: int, hi: int | None) -> str | None:
    """`pattern` with its length also within [lo, hi], or None where that is not a simple rewrite
    (or no string satisfies both). A pattern matches the whole value, as xgrammar reads it."""
    m = _REPEATED_CLASS.fullmatch(pattern)
    if m is None:
        return None
    atom, quant = m.group(1), m.group(2)
    if quant is not None and quant.startswith("{"):
        q_lo = int(m.group(3))
        q_hi = q_lo if m.group(4) is None else (int(m.group(5)) if m.group(5) else None)
    else:
        q_lo, q_hi = _QUANTIFIERS[quant]
    low, highs = max(lo, q_lo), [h for h in (hi, q_hi) if h is not None]
    high = min(highs) if highs else None
    if high is not None and high < low:
        return None
    return f"{atom}{{{low},{'' if high is None else high}}}"
