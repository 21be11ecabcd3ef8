"""One choice's output as the client sees it: token ids in, reasoning / content / tool-call deltas out.

The runtime's own text drops special tokens, but K3's output structure *is* special tokens (XTML
markers), so chat output is decoded here with them kept and run through xtml.StreamingParser, whose
deltas concatenate to what xtml.parse gives for the whole text (the non-streaming answer is the same
deltas joined, so the two cannot disagree). Stop strings are matched on that text; the last
len(longest stop) - 1 characters are held back until they cannot start a stop string.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from k3trt.runtime.request import RequestOutput, find_stop
from k3trt.runtime.tokenizer import IncrementalDetokenizer
from k3trt.runtime.xtml import SPECIALS, Delta, DeltaKind, StreamingParser
from k3trt.runtime.xtml_values import arguments_json


@dataclass
class Update:
    deltas: list[Delta]
    logprobs: list[tuple[int, dict[int, float]]]     # (token id, {token id: logprob}) per new token
    finished: bool = False


@dataclass
class ChoiceStream:
    index: int
    tokenizer: Any
    stops: tuple[str, ...] = ()
    thinking: bool | None = None          # None: plain text (completions), no XTML parsing
    drop_tool_calls: bool = False
    text: str = ""                        # decoded output (special tokens kept in chat), cut at a stop
    released: int = 0                     # characters of text handed to the parser
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)   # the runtime's stats of the latest output

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, skip_special=self.thinking is None)
        # chat keeps the XTML markers (the parser needs them) but no other special token (placeholders, bos)
        self._markers = frozenset(self.tokenizer.special_ids.get(s) for s in SPECIALS) - {None}
        self._parser = StreamingParser(thinking=self.thinking) if self.thinking is not None else None
        self._hold = max(map(len, self.stops), default=1) - 1

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tool_calls(self) -> list:
        return [] if self._parser is None or self.drop_tool_calls else list(self._parser.tool_calls)

    def update(self, out: RequestOutput) -> Update:
        if self.done:
            return Update([], [])
        new = out.token_ids[len(self.token_ids):]
        lps = out.logprobs[len(self.token_ids):] if out.logprobs is not None else []
        self.stats = out.stats or self.stats
        start, used, hit = len(self.text), 0, None
        # with stop strings, a token at a time: the choice ends at the token that completes one, so
        # the tokens a speculative step commits past it count nowhere (usage, logprobs), as without drafts
        for chunk in ([[t] for t in new] if self.stops else [new]):
            used += len(chunk)
            self.text += self._detok.feed([t for t in chunk if t in self._markers or not self.tokenizer.is_special(t)])
            if self.stops and (hit := find_stop(self.text, start, self.stops)) is not None:
                break
        if hit is None and out.finished:
            self.text += self._detok.finish()
            hit = find_stop(self.text, start, self.stops) if self.stops else None
        new, lps = new[:used], lps[:used]
        self.token_ids += new
        if hit is not None:
            self.text = self.text[:hit[0]]
            self.finish_reason = "stop"          # the caller aborts the engine request
        elif out.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.error = out.error
        end = len(self.text) if self.done else max(self.released, len(self.text) - self._hold)
        piece, self.released = self.text[self.released:end], end
        deltas = self._parse(piece)
        return Update(deltas, list(zip(new, lps)), self.done)

    def _parse(self, piece: str) -> list[Delta]:
        if self._parser is None:
            deltas = [Delta(DeltaKind.CONTENT, piece)] if piece else []
        else:
            deltas = self._parser.feed(piece) + (self._parser.finish() if self.done else [])
            if self.drop_tool_calls:
                deltas = [d for d in deltas if d.kind in (DeltaKind.REASONING, DeltaKind.CONTENT)]
        for d in deltas:
            if d.kind is DeltaKind.REASONING:
                self.reasoning.append(d.text)
            elif d.kind is DeltaKind.CONTENT:
                self.content.append(d.text)
        return deltas

    def final_reason(self) -> str:
        """OpenAI's finish_reason: a turn that ended normally with tool calls says "tool_calls"."""
        if self.finish_reason == "stop" and self.tool_calls:
            return "tool_calls"
        return "error" if self.finish_reason == "error" else self.finish_reason or "stop"

    def message(self, call_ids: dict[int, str]) -> dict[str, Any]:
        """The non-streaming chat message."""
        calls = [{"id": call_ids.setdefault(c.index, new_call_id()), "type": "function",
                  "function": {"name": c.name, "arguments": arguments_json(c.arguments)}} for c in self.tool_calls]
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or (None if calls else "")}
        if self.thinking:
            msg["reasoning_content"] = "".join(self.reasoning) or None
        if calls:
            msg["tool_calls"] = calls
        return msg


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
