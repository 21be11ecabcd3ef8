"""K3 output parsing ("XTML", spec/XTML.md): reasoning, content and tool calls, whole or streamed.

One state machine serves both uses: `parse(text)` is `StreamingParser` fed the whole text, so the
two cannot disagree, and any split of the text into chunks gives the same deltas concatenated.

Delta contract (what the server relies on):
- `REASONING` / `CONTENT` deltas concatenate to `ParsedOutput.reasoning` / `.content`.
- A tool call sends one `TOOL_NAME` delta when its `<|open|>call tool="…"…<|sep|>` is complete, then
  `TOOL_ARGS` deltas that concatenate to exactly `arguments_json(call.arguments)`: a string value
  streams as its text arrives, any other value goes out when its block closes.
- Truncation: a call still open when the stream ends is not a tool call (parse drops it); its name
  and partial arguments may already have been streamed (nothing can be taken back).
- No special-token string (`<|open|>` `<|sep|>` `<|close|>` `<|end_of_msg|>`) ever appears in any
  output text, not even one assembled from text on both sides of dropped markup.

Structure rules beyond the spec (recovery from malformed output, chosen to be chunk-independent):
- thinking on: output starts inside `think` (the prompt opened it); off: inside `response`, and a
  `think` block's text counts as content.
- Opening `think`/`response`/`tools` closes whatever channel is open; a `call` outside `tools`
  behaves as if wrapped in one; a close marker closes everything opened after its element; unknown
  elements and text in `tools`/`call` outside an argument are dropped.
- Text outside every channel (between blocks) is content with surrounding whitespace stripped.
- `<|close|>message<|sep|>` or `<|end_of_msg|>` ends the message; later text is ignored.
- A duplicated argument key keeps its first value (the first was already streamed).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from k3trt.runtime.xtml_values import (
    Delta,
    DeltaKind,
    ParsedOutput,
    ToolCall,
    dumps_value,
    typed_value,
    unescape_attr,
)

log = logging.getLogger(__name__)

OPEN, SEP, CLOSE, END_OF_MSG = "<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"
SPECIALS = (OPEN, SEP, CLOSE, END_OF_MSG)
_SPECIAL_RE = re.compile("|".join(map(re.escape, SPECIALS)))
_SPECIAL_PREFIXES = frozenset(s[:i] for s in SPECIALS for i in range(1, len(s)))
_MAX_SPECIAL = max(map(len, SPECIALS))
_OPEN_HEADER = re.compile(r"\s*(\w+)(\s.*)?", re.S)
_CLOSE_HEADER = re.compile(r"\s*(\w+)\s*")
_ATTR = re.compile(r'(\w+)="([^"]*)"')
_CHANNELS = frozenset({"think", "response", "tools"})


class _MarkerFilter:
    """Passes text through but drops any character that would complete a special-token string
    at the end of what it has passed so far. Decides per character from its own output, so the
    result depends only on the concatenated input, never on how it was chunked."""

    def __init__(self) -> None:
        self._tail = ""

    def __call__(self, text: str) -> str:
        if ">" not in text:  # every special string ends in '>'
            out = text
        else:
            kept, tail = [], self._tail
            for ch in text:
                probe = tail + ch
                if ch == ">" and any(probe.endswith(s) for s in SPECIALS):
                    continue
                kept.append(ch)
                tail = probe[-(_MAX_SPECIAL - 1):]
            out = "".join(kept)
        self._tail = (self._tail + out)[-(_MAX_SPECIAL - 1):]
        return out


@dataclass
class _Frame:
    name: str
    call: int = -1                     # index of the call (call / argument / json frames)
    key: str = ""                      # argument key
    type: str = "string"               # argument type
    raw: list[str] = field(default_factory=list)
    filter: _MarkerFilter | None = None
    implicit: bool = False             # a tools frame opened by a call without one


@dataclass
class _Call:
    name: str
    index: int
    arguments: dict[str, Any] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)  # keys opened so far (duplicates are dropped)
    started: bool = False                         # "{" has gone out


class _Lexer:
    """Splits a character stream into text and complete markers. A possible start of a special
    string at the end of the buffer is held back; a marker's header is held until its <|sep|>."""

    def __init__(self) -> None:
        self._buf = ""
        self._header: str | None = None  # OPEN or CLOSE while inside a marker header

    def feed(self, text: str) -> list[tuple]:
        self._buf += text
        events: list[tuple] = []
        while True:
            m = _SPECIAL_RE.search(self._buf)
            if self._header is not None:
                if m is None:
                    return events  # header incomplete: hold it all
                header, kind = self._buf[:m.start()], self._header
                self._header = None
                if m.group() == SEP:
                    events.extend(self._marker(kind, header))
                    self._buf = self._buf[m.end():]
                    continue
                log.debug("xtml: dropping malformed marker %r", kind + header)
                self._buf = self._buf[m.start():]
                continue
            if m is None:
                keep = next((k for k in range(min(len(self._buf), _MAX_SPECIAL - 1), 0, -1)
                             if self._buf[-k:] in _SPECIAL_PREFIXES), 0)
                cut = len(self._buf) - keep
                if cut:
                    events.append(("text", self._buf[:cut]))
                self._buf = self._buf[cut:]
                return events
            if m.start():
                events.append(("text", self._buf[:m.start()]))
            self._buf = self._buf[m.end():]
            if m.group() in (OPEN, CLOSE):
                self._header = m.group()
            elif m.group() == END_OF_MSG:
                events.append(("end",))
            # a stray <|sep|> outside a marker is dropped

    def finish(self) -> list[tuple]:
        # held text that proved not to be a marker is text; a marker cut off is dropped
        events = [("text", self._buf)] if self._header is None and self._buf else []
        self._buf, self._header = "", None
        return events

    @staticmethod
    def _marker(kind: str, header: str) -> list[tuple]:
        if kind == CLOSE:
            m = _CLOSE_HEADER.fullmatch(header)
            return [("close", m.group(1))] if m else []
        m = _OPEN_HEADER.fullmatch(header)
        if not m:
            return []
        attrs: dict[str, str] = {}
        for key, value in _ATTR.findall(m.group(2) or ""):
            attrs.setdefault(key, unescape_attr(value))
        return [("open", m.group(1), attrs)]


class StreamingParser:
    """Feed decoded text deltas, get reasoning / content / tool-call deltas (see module doc)."""

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking
        self.tool_calls: list[ToolCall] = []  # completed calls, in order
        self._lexer = _Lexer()
        self._stack: list[_Frame] = [_Frame("think" if thinking else "response")]
        self._calls: dict[int, _Call] = {}
        self._next_call = 0
        self._ended = False
        self._content, self._reasoning = _MarkerFilter(), _MarkerFilter()
        self._top_started = False   # outside channels: leading whitespace of a run is dropped,
        self._top_pending = ""      # trailing whitespace waits for more text or a marker
        self._out: list[Delta] = []

    def feed(self, delta: str) -> list[Delta]:
        for event in self._lexer.feed(delta):
            self._handle(event)
        return self._take()

    def finish(self) -> list[Delta]:
        for event in self._lexer.finish():
            self._handle(event)
        self._stack.clear()  # a call still open is truncated: not a tool call
        self._ended = True
        return self._take()

    # ---- events -------------------------------------------------------------------------------
    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if self._ended:
            return
        if kind == "text":
            return self._text(event[1])
        self._top_started, self._top_pending = False, ""
        if kind == "end":
            self._pop_to(0)
            self._ended = True
        elif kind == "open":
            self._open(event[1], event[2])
        else:
            self._close(event[1])

    def _open(self, name: str, attrs: dict[str, str]) -> None:
        names = [f.name for f in self._stack]
        if name in _CHANNELS or name == "message":
            self._pop_to(0)
            if name != "message":  # a message element is transparent
                self._stack.append(_Frame(name))
        elif name == "call":
            if "tools" in names:
                self._pop_to(len(names) - names[::-1].index("tools"))
            else:
                self._pop_to(0)
                self._stack.append(_Frame("tools", implicit=True))
            self._open_call(attrs)
        elif name in ("argument", "json") and "call" in names:
            self._pop_to(len(names) - names[::-1].index("call"))
            self._open_value(name, attrs)
        else:
            self._stack.append(_Frame("?"))  # unknown or misplaced: its body is dropped

    def _close(self, name: str) -> None:
        names = [f.name for f in self._stack]
        if name in names:
            self._pop_to(len(names) - 1 - names[::-1].index(name))
            if self._stack and self._stack[-1].implicit:  # a call with no tools around it
                self._pop_to(len(self._stack) - 1)
        elif name == "message":
            self._pop_to(0)
            self._ended = True
        elif name in _CHANNELS:
            self._pop_to(0)

    def _pop_to(self, depth: int) -> None:
        while len(self._stack) > depth:
            self._finalize(self._stack.pop())

    # ---- tool calls ---------------------------------------------------------------------------
    def _open_call(self, attrs: dict[str, str]) -> None:
        if not attrs.get("tool"):
            return self._stack.append(_Frame("?"))
        call = _Call(attrs["tool"], self._next_call)
        self._next_call += 1
        self._calls[call.index] = call
        self._stack.append(_Frame("call", call=call.index))
        self._emit(DeltaKind.TOOL_NAME, call.name, call.index)

    def _open_value(self, name: str, attrs: dict[str, str]) -> None:
        call = self._calls[self._stack[-1].call]
        if name == "json":
            return self._stack.append(_Frame("json", call=call.index, filter=_MarkerFilter()))
        key, type_ = attrs.get("key"), attrs.get("type", "string")
        if key is None or key in call.keys:
            log.debug("xtml: dropping argument without a key or with a repeated key %r", key)
            return self._stack.append(_Frame("?"))
        call.keys.add(key)
        self._stack.append(_Frame("argument", call=call.index, key=key, type=type_,
                                  filter=_MarkerFilter()))
        if type_ == "string":  # streams as it arrives: the key and opening quote go out now
            call.arguments[key] = ""
            self._emit(DeltaKind.TOOL_ARGS, self._arg_sep(call) + dumps_value(key) + ': "', call.index)

    @staticmethod
    def _arg_sep(call: _Call) -> str:
        sep, call.started = (", " if call.started else "{"), True
        return sep

    def _finalize(self, frame: _Frame) -> None:
        if frame.name == "call":
            call = self._calls.pop(frame.call)
            self._emit(DeltaKind.TOOL_ARGS, "}" if call.started else "{}", call.index)
            self.tool_calls.append(ToolCall(call.name, call.arguments, call.index))
        elif frame.name == "argument":
            call, raw = self._calls[frame.call], "".join(frame.raw)
            if frame.type == "string":
                call.arguments[frame.key] = raw
                self._emit(DeltaKind.TOOL_ARGS, '"', call.index)
            else:
                self._add_argument(call, frame.key, typed_value(raw, frame.type))
        elif frame.name == "json":
            call, raw = self._calls[frame.call], "".join(frame.raw)
            value = typed_value(raw, "object")
            if not isinstance(value, dict):
                log.debug("xtml: dropping a json block that is not an object: %r", raw[:80])
                return
            for key, item in value.items():
                if key not in call.keys:
                    call.keys.add(key)
                    self._add_argument(call, key, item)

    def _add_argument(self, call: _Call, key: str, value: Any) -> None:
        call.arguments[key] = value
        self._emit(DeltaKind.TOOL_ARGS, self._arg_sep(call) + dumps_value(key) + ": " + dumps_value(value),
                   call.index)

    # ---- text ---------------------------------------------------------------------------------
    def _text(self, text: str) -> None:
        if not self._stack:
            self._top_text(text)
            return
        frame = self._stack[-1]
        if frame.name == "think":
            sink = DeltaKind.REASONING if self.thinking else DeltaKind.CONTENT
            filt = self._reasoning if self.thinking else self._content
            self._emit(sink, filt(text))
        elif frame.name == "response":
            self._emit(DeltaKind.CONTENT, self._content(text))
        elif frame.name in ("argument", "json"):
            piece = frame.filter(text)
            frame.raw.append(piece)
            if frame.name == "argument" and frame.type == "string":
                self._emit(DeltaKind.TOOL_ARGS, dumps_value(piece)[1:-1], frame.call)
        # text in tools / call / unknown elements is dropped

    def _top_text(self, text: str) -> None:
        if not self._top_started:
            text = text.lstrip()
            self._top_started = bool(text)
        body = text.rstrip()
        if body:
            self._emit(DeltaKind.CONTENT, self._content(self._top_pending + body))
            self._top_pending = text[len(body):]
        else:
            self._top_pending += text

    def _emit(self, kind: DeltaKind, text: str, index: int = -1) -> None:
        if text and self._out and self._out[-1].kind is kind and self._out[-1].index == index:
            text = self._out.pop().text + text  # one delta per run of the same kind
        if text:
            self._out.append(Delta(kind, text, index))

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out


def parse(text: str, *, thinking: bool = True) -> ParsedOutput:
    """Parse a whole K3 output (the text after the prompt's generation prefix)."""
    parser = StreamingParser(thinking=thinking)
    deltas = parser.feed(text) + parser.finish()
    reasoning = "".join(d.text for d in deltas if d.kind is DeltaKind.REASONING)
    content = "".join(d.text for d in deltas if d.kind is DeltaKind.CONTENT)
    return ParsedOutput(reasoning or None, content or None, tuple(parser.tool_calls))


def reasoning_open(text: str) -> bool:
    """True when `text` (a prompt) leaves a think block open: its last `<|open|>think<|sep|>` has
    no `<|close|>think<|sep|>` after it. Older closed think blocks of earlier turns do not count.
    The runtime passes this as `thinking` when it did not render the prompt itself."""
    lexer, state = _Lexer(), False
    for event in lexer.feed(text):
        if event[0] in ("open", "close") and event[1] == "think":
            state = event[0] == "open"
    return state
