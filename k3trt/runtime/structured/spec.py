"""`GuidedSpec`: what a request's output must match. Frozen, hashable (it is the compile-cache
key, with the tokenizer), and checked when constructed, so a bad schema, regex, grammar or tool
list fails at submission with the field and xgrammar's reason, never inside a running step.

Exactly one of: `json_schema`, `json_object`, `regex`, `grammar` (EBNF, xgrammar's dialect, root
rule `root`), or `tool_choice` ("required" or a tool name, with `tools`: XTML tool calling).
Around it:
- `chat`: the output is a K3 assistant turn; the grammar's text is the body of its `response`
  channel, and the grammar also generates the turn's closing markers
  (`<|close|>response<|sep|><|close|>message<|sep|>`), then eos. Tool calling is always chat.
- `after_reasoning`: the prompt ends inside the `think` channel (thinking on): the output first
  reasons, then closes `think` (`<|close|>think<|sep|>`); the grammar's body follows, and in chat
  form it begins by opening the response channel (`<|open|>response<|sep|>`), as the chat
  template's turns do.
- `max_reasoning_chars` (with `after_reasoning`): the grammar bounds the reasoning to at most n
  characters, then requires the `think` close and the body; None leaves reasoning free (a gate
  outside the grammar waits for the close). Characters, not tokens: a grammar sees text, and every
  reasoning token carries at least one byte, so n characters are at most n tokens of ASCII text
  and at most 4n of any text (a character split over byte tokens). A forced tool call must end,
  so its reasoning is always bounded: None there is `DEFAULT_TOOL_REASONING_CHARS`. Without
  `after_reasoning` there is no reasoning and the field is stored as None.
- `max_whitespace` (JSON): at most n whitespace characters in a row; 0 is xgrammar's fixed layout
  (in tool arguments: at most 1). The default, `DEFAULT_MAX_WHITESPACE`, is the fixed layout: JSON
  allows any whitespace, and a sampled model left free to pad its output runs to `max_tokens`
  without closing it. None (what a front end passes when nothing is configured) is the default, so
  every front end gets the cap; a caller who wants pretty-printed JSON sets a larger n.
- `parallel_tool_calls`, `max_tool_calls` (tool calling): how many calls one turn may hold (see
  `tool_call_limit`); the count is always bounded, so a forced call always ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from k3trt.runtime.params import RequestError
from k3trt.runtime.structured.vocab import xgr

DEFAULT_MAX_WHITESPACE = 0
DEFAULT_TOOL_REASONING_CHARS = 4096   # about a thousand tokens of English reasoning
_MODES = ("json_schema", "json_object", "regex", "grammar", "tool_choice")
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*"          # [time] file.cc:123:
                         r"(?:Warning:\s*)?(?:Check failed:.*? is false:\s*)?")


class GrammarError(RequestError):
    """A grammar request the engine refuses, or output that broke its grammar; `field` names the
    request field (json_schema, regex, grammar, tools, tool_choice, ...)."""


def reason(e: BaseException) -> str:
    """xgrammar's message without its log prefix (time, C++ file and line)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGR_PREFIX.sub("", text).strip() or type(e).__name__


def _json_text(value: Any, field_name: str) -> str:
    """A schema as canonical JSON text: key order kept (xgrammar emits properties in that order)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise GrammarError(field_name, f"not valid JSON ({e})") from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError(field_name, f"a JSON schema must be an object or a boolean, got "
                                       f"{type(value).__name__}")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _check_schema(text: str, field_name: str) -> None:
    try:
        xgr().Grammar.from_json_schema(text, strict_mode=True)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with its reason
        raise GrammarError(field_name, f"invalid JSON schema: {reason(e)}") from None


def _tool_text(tool: Any, position: int) -> tuple[str, str]:
    """(name, JSON text of {"name", "parameters"}) from an OpenAI function tool or a bare
    function definition."""
    field_name = f"tools[{position}]"
    if isinstance(tool, str):
        try:
            tool = json.loads(tool)
        except ValueError as e:
            raise GrammarError(field_name, f"not valid JSON ({e})") from None
    if not isinstance(tool, Mapping):
        raise GrammarError(field_name, f"a tool must be an object, got {type(tool).__name__}")
    fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(fn, Mapping):
        raise GrammarError(field_name, f"only function tools are supported, got type "
                                       f"{tool.get('type')!r}")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise GrammarError(field_name, "a function tool needs a non-empty string `name`")
    params = fn.get("parameters")
    if fn.get("strict") is False or params is None:
        params = {"type": "object"}  # unconstrained arguments: still one JSON object
    params_text = _json_text(params, f"{field_name}.parameters")
    _check_schema(params_text, f"{field_name}.parameters")
    return name, json.dumps({"name": name, "parameters": json.loads(params_text)},
                            ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class GuidedSpec:
    json_schema: str | None = None       # JSON text; a dict is accepted and stored as text
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None           # EBNF
    tools: tuple[str, ...] = ()          # JSON text of {"name", "parameters"} per tool
    tool_choice: str | None = None       # "required" or one tool's name
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None    # None: one per tool offered (see tool_call_limit)
    chat: bool = False
    after_reasoning: bool = False
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE   # None: the default
    max_reasoning_chars: int | None = None   # None: free, or the default for a forced tool call

    def __post_init__(self) -> None:
        if self.max_whitespace is None:  # one cache key for "not configured" and the default
            object.__setattr__(self, "max_whitespace", DEFAULT_MAX_WHITESPACE)
        if self.after_reasoning is not True:   # no reasoning to bound (one cache key)
            object.__setattr__(self, "max_reasoning_chars", None)
        elif self.max_reasoning_chars is None and self.tool_choice is not None:
            object.__setattr__(self, "max_reasoning_chars", DEFAULT_TOOL_REASONING_CHARS)
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _json_text(self.json_schema, "json_schema"))
        if isinstance(self.tools, (str, Mapping)):
            raise GrammarError("tools", "must be a list of tools")
        object.__setattr__(self, "tools", tuple(self.tools or ()))
        if self.tools:
            named = [_tool_text(t, i) for i, t in enumerate(self.tools)]
            names = [n for n, _ in named]
            if len(set(names)) != len(names):
                raise GrammarError("tools", f"tool names must be unique, got {names}")
            object.__setattr__(self, "tools", tuple(text for _, text in named))
        if self.tool_choice is not None:
            object.__setattr__(self, "chat", True)  # tool calls exist only inside a K3 turn
        self._check()

    def _modes(self) -> list[str]:
        return [k for k in _MODES if getattr(self, k) is not None and getattr(self, k) is not False]

    @property
    def kind(self) -> str:
        """The constraint's field name (used in error messages and logs)."""
        return self._modes()[0]

    def tool_list(self) -> list[dict[str, Any]]:
        """The tools the grammar may call: all of them ("required") or the named one."""
        tools = [json.loads(t) for t in self.tools]
        if self.tool_choice == "required":
            return tools
        return [t for t in tools if t["name"] == self.tool_choice]

    @property
    def bounds_reasoning(self) -> bool:
        """The grammar covers the reasoning (bounded) as well as what follows it."""
        return self.max_reasoning_chars is not None

    @property
    def tool_call_limit(self) -> int:
        """How many calls the grammar allows: 1 without parallel calls, else `max_tool_calls`, by
        default as many as there are tools to choose from. A forced call must end, so the count
        is bounded: a model that never chooses to stop stops at the limit."""
        if not self.parallel_tool_calls:
            return 1
        return self.max_tool_calls or len(self.tool_list())

    def _check(self) -> None:
        if self.tools and self.tool_choice is None:
            raise GrammarError("tools", "tools constrain the output only with tool_choice "
                                        "'required' or a tool name")
        modes = self._modes()
        if len(modes) != 1:
            raise GrammarError("guided", f"give exactly one of json_schema, json_object, regex, "
                                         f"grammar, tool_choice; got {modes or 'none'}")
        for name in ("json_object", "parallel_tool_calls", "chat", "after_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise GrammarError(name, f"must be a bool, got {getattr(self, name)!r}")
        mc = self.max_tool_calls
        if mc is not None and (not isinstance(mc, int) or isinstance(mc, bool) or mc < 1):
            raise GrammarError("max_tool_calls", f"must be None or an integer >= 1, got {mc!r}")
        mw = self.max_whitespace
        if not isinstance(mw, int) or isinstance(mw, bool) or mw < 0:
            raise GrammarError("max_whitespace", f"must be an integer >= 0 (None: the default "
                                                 f"{DEFAULT_MAX_WHITESPACE}), got {mw!r}")
        mr = self.max_reasoning_chars
        if mr is not None and (not isinstance(mr, int) or isinstance(mr, bool) or mr < 0):
            raise GrammarError("max_reasoning_chars", f"must be None or an integer >= 0, got {mr!r}")
        x = xgr()
        if self.json_schema is not None:
            _check_schema(self.json_schema, "json_schema")
        elif self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise GrammarError("regex", "must be a non-empty string")
            try:
                x.Grammar.from_regex(self.regex)
            except Exception as e:
                raise GrammarError("regex", f"invalid regex: {reason(e)}") from None
        elif self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise GrammarError("grammar", "must be a non-empty EBNF string")
            try:
                x.Grammar.from_ebnf(self.grammar)
            except Exception as e:
                raise GrammarError("grammar", f"invalid EBNF grammar: {reason(e)}") from None
        elif self.tool_choice is not None:
            names = [json.loads(t)["name"] for t in self.tools]
            if not names:
                raise GrammarError("tools", "tool_choice needs at least one tool")
            if self.tool_choice != "required" and self.tool_choice not in names:
                raise GrammarError("tool_choice", f"must be 'required' or one of the tools' names "
                                                  f"{names}, got {self.tool_choice!r}")

    # ---- from request formats -------------------------------------------------------------------
    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None,
                             **kw: Any) -> "GuidedSpec | None":
        """OpenAI `response_format`: {"type": "text"} -> None; {"type": "json_object"};
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}. `kw`: chat,
        after_reasoning, max_whitespace, max_reasoning_chars."""
        if not response_format:
            return None
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True, **kw)
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            schema = inner.get("schema", {"type": "object"}) if isinstance(inner, Mapping) else None
            if schema is None:
                raise GrammarError("response_format.json_schema", "needs an object with `schema`")
            return cls(json_schema=schema, **kw)
        raise GrammarError("response_format.type", f"must be text, json_object or json_schema, "
                                                   f"got {kind!r}")

    @classmethod
    def for_tools(cls, tools: Iterable[Any] | None, tool_choice: Any,
                  **kw: Any) -> "GuidedSpec | None":
        """OpenAI `tools` + `tool_choice`. None for "auto", "none" or no choice (no grammar: the
        model decides); "required"; {"type": "function", "function": {"name": ...}} or a name."""
        if tool_choice in (None, "auto", "none"):
            return None
        if isinstance(tool_choice, Mapping):
            fn = tool_choice.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if not isinstance(name, str):
                raise GrammarError("tool_choice", "a named tool choice needs function.name")
            tool_choice = name
        if not isinstance(tool_choice, str):
            raise GrammarError("tool_choice", f"must be 'required', a tool name or a named "
                                              f"choice, got {tool_choice!r}")
        return cls(tools=tuple(tools or ()), tool_choice=tool_choice, **kw)
