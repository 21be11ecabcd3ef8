"""N-gram (prompt-lookup) drafting: no model; the request's own prompt + output is the draft source.

For n = max_n down to min_n: find the most recent earlier occurrence of the history's last n
tokens and propose what followed it, up to k tokens. The first n that matches wins (a longer
context is a better predictor); ties between occurrences go to the most recent one.

Per request the drafter keeps, for each n, a dict from n-gram to the end of its latest occurrence
that still has a continuation (end < len(history)). It is extended incrementally with the tokens
appended since the last call, so a step costs O(new tokens · (max_n - min_n + 1)) plus O(k),
never a rescan of the history. The index is derived from the history alone, so it needs no
rollback: rejected drafts never entered it.

When the continuation runs into the end of the history (a periodic tail such as "a b a b"), the
proposal continues with its own tokens: the match implies period len(history) - end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from k3trt.runtime.speculative.drafter import DraftInput, Drafter, Proposal


@dataclass(frozen=True)
class NgramConfig:
    max_n: int = 4       # longest suffix to match
    min_n: int = 2       # shortest; 1 drafts more often but guesses worse

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram drafter needs 1 <= min_n <= max_n, got min_n={self.min_n} max_n={self.max_n}")


@dataclass
class _Index:
    """Per request: for each n, n-gram -> end (exclusive) of its latest occurrence with end < indexed."""
    tables: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0     # n-grams ending at 1..indexed-1 are in (ends are exclusive)
    length: int = 0      # history length when last seen (to detect a reset)


def extend_index(idx: _Index, history: Sequence[int], cfg: NgramConfig) -> None:
    """Add every n-gram whose end e satisfies idx.indexed <= e < len(history): those that now have
    at least one following token. Later occurrences overwrite earlier ones (most recent wins)."""
    L = len(history)
    if L < idx.length:              # not append-only (a reset by the caller): rebuild
        idx.tables, idx.indexed = {}, 0
    idx.length = L
    for e in range(max(idx.indexed, 1), L):
        for n in range(cfg.min_n, min(cfg.max_n, e) + 1):
            idx.tables.setdefault(n, {})[tuple(history[e - n:e])] = e
    idx.indexed = max(idx.indexed, L)


def lookup(idx: _Index, history: Sequence[int], k: int, cfg: NgramConfig) -> list[int]:
    """The continuation of the longest matching suffix (see module doc); [] when nothing matches."""
    L = len(history)
    for n in range(min(cfg.max_n, L), cfg.min_n - 1, -1):
        end = idx.tables.get(n, {}).get(tuple(history[L - n:]))
        if end is None:
            continue
        out: list[int] = []
        for j in range(k):
            i = end + j
            out.append(history[i] if i < L else out[i - L])
        return out
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, config: NgramConfig = NgramConfig()):
        self.config = config
        self._index: dict[str, _Index] = {}

    def propose(self, inputs: Sequence[DraftInput], k: int) -> Proposal:
        out = []
        for inp in inputs:
            idx = self._index.setdefault(inp.request_id, _Index())
            extend_index(idx, inp.token_ids, self.config)
            out.append(lookup(idx, inp.token_ids, inp.limit(k), self.config))
        return Proposal(out, [None] * len(out))

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
