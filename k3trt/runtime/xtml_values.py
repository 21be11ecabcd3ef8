"""XTML's values and outputs (spec/XTML.md): attribute escaping, typed argument values, and the
types the parser (xtml.py) produces: deltas, tool calls, the parsed whole."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any


def escape_attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    # &quot; first: "&amp;quot;" is an escaped literal "&quot;" and must survive as such.
    return value.replace("&quot;", '"').replace("&amp;", "&")


def arguments_json(arguments: dict[str, Any]) -> str:
    """The one JSON form of a call's arguments; TOOL_ARGS deltas concatenate to exactly this."""
    return json.dumps(arguments, ensure_ascii=False)


def dumps_value(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _finite(text: str) -> float:
    value = float(text)
    if math.isfinite(value):
        return value
    raise ValueError(text)  # NaN, Infinity, 1e999: json.dumps would write them, but not as JSON


def typed_value(raw: str, type_: str) -> Any:
    """An argument's value: `string` is the raw text; other types json.loads, else the raw text."""
    if type_ == "string":
        return raw
    try:
        return json.loads(raw, parse_float=_finite, parse_constant=_finite)
    except ValueError:
        return raw


class DeltaKind(str, enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL_NAME = "tool_name"
    TOOL_ARGS = "tool_args"


@dataclass(frozen=True)
class Delta:
    kind: DeltaKind
    text: str
    index: int = -1  # tool call index (0-based, in order of opening); -1 for text deltas


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    index: int


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
