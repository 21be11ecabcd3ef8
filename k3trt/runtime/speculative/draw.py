"""How a model drafter turns a draft step's logits into drafts: over its head's columns (the full
vocabulary or a reduced draft vocabulary, draft_vocab.py), under a guided request's grammar, by
argmax or by a draw from the request's processed distribution.

Drafts under the grammar: for every guided input (``DraftInput.guide``, the request's GuidedState)
``Drawer.masks`` opens a walk of its grammar (GuidedState.draft_walk); each draft step fills the
mask of the next draft (from ``batch_min`` guided inputs on, in one xgrammar BatchGrammarMatcher
call), masks that row's logits (ids the grammar refuses get -inf) and walks on by the drawn token.
A greedy draft is thus the masked argmax, a sampled one is drawn from the masked distribution (and
that is its q). A row with no allowed column (a reduced vocabulary can exclude
every id the grammar allows) ends that request's drafts. The walks roll back when the propose ends
(``DraftMasks.close``). The target still masks its verify rows, so this changes only which drafts
are proposed: outputs stay exactly those of plain decoding.

Counters (``Drawer.counts``, reported per drafter): ``masked_drafts`` drafts drawn under a grammar
mask, ``redirected_drafts`` those whose unmasked choice the grammar refused (unmasked, that draft
and every one after it would be cut before verification), ``dead_ends`` rows with no allowed
column.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch

from k3trt.runtime import sampling
from k3trt.runtime.speculative.draft_vocab import DraftHead
from k3trt.runtime.speculative.drafter import DraftInput
from k3trt.runtime.structured.state import fill_walks
from k3trt.runtime.structured.vocab import num_words, unpack, xgr


class DraftMasks:
    """The grammar walks of one propose's guided inputs (module doc); close() when it ends."""

    def __init__(self, inputs: Sequence[DraftInput], vocab_size: int, counts: Counter, batcher: Any = None):
        self.walks = {inp.request_id: inp.guide.draft_walk() for inp in inputs if inp.guide is not None}
        self.vocab_size, self.counts, self.batcher = vocab_size, counts, batcher
        self._bm: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, inputs: Sequence[DraftInput], head: DraftHead) -> list[bool]:
        """Mask the guided rows of logits [R, head.size] in place (row r: inputs[r]); returns per row
        whether any column is left."""
        live = [True] * len(inputs)
        rows = [r for r, inp in enumerate(inputs) if inp.request_id in self.walks]
        if not rows:
            return live
        if self._bm is None or len(self._bm) < len(rows):
            self._bm = torch.zeros(len(inputs), num_words(self.vocab_size), dtype=torch.int32)
        walks = [self.walks[inputs[r].request_id] for r in rows]
        fill_walks(walks, self._bm, self.batcher)
        for k, w in enumerate(walks):
            if w.stopped:
                self._bm[k] = 0
        allowed = head.columns(unpack(self._bm[:len(rows)].to(logits.device), self.vocab_size))
        idx = torch.tensor(rows, device=logits.device)
        sub = logits[idx]
        before = sub.argmax(-1)
        sub.masked_fill_(~allowed, float("-inf"))
        logits[idx] = sub
        ok = allowed.any(-1)
        changed = ok & ~allowed.gather(1, before[:, None])[:, 0]
        oks, changed = ok.tolist(), int(changed.sum())
        for k, r in enumerate(rows):
            live[r] = oks[k]
        self.counts["masked_drafts"] += sum(oks)
        self.counts["redirected_drafts"] += changed
        self.counts["dead_ends"] += len(rows) - sum(oks)
        return live

    def advance(self, inputs: Sequence[DraftInput], tokens: Sequence[int | None]) -> list[int | None]:
        """Walk each guided input's grammar by its drawn token; a token the walk refuses becomes None
        (that request drafts no further)."""
        out = list(tokens)
        for r, (inp, t) in enumerate(zip(inputs, tokens)):
            w = self.walks.get(inp.request_id)
            if w is not None and t is not None and not w.advance(t):
                out[r] = None
        return out

    def close(self) -> None:
        for w in self.walks.values():
            w.close()


class Drawer:
    """A model drafter's head and draw rule (module doc); ``counts`` accumulate over its life."""

    def __init__(self, head: DraftHead, vocab_size: int, sample_drafts: bool, batch_min: int = 8):
        self.head, self.vocab_size, self.sample_drafts = head, vocab_size, sample_drafts
        self.batch_min = batch_min           # guided inputs from which masks are filled in one xgrammar call
        self.counts: Counter = Counter()
        self._batcher = None

    def stats(self) -> dict[str, int]:
        return {**self.counts, **({"draft_vocab_size": self.head.size} if self.head.reduced else {})}

    def masks(self, inputs: Sequence[DraftInput]) -> DraftMasks | None:
        """The grammar walks of this propose's guided inputs (None: none is guided); close() it."""
        guided = sum(i.guide is not None for i in inputs)
        if not guided:
            return None
        if guided >= self.batch_min and self._batcher is None:
            self._batcher = xgr().BatchGrammarMatcher("auto")
        return DraftMasks(inputs, self.vocab_size, self.counts, self._batcher if guided >= self.batch_min else None)

    def pick(self, logits: torch.Tensor, inputs: Sequence[DraftInput], generators: Sequence[torch.Generator | None],
             masks: DraftMasks | None) -> tuple[list[int | None], list[torch.Tensor | None]]:
        """One draft per row of logits [R, head.size] fp32 (masked here in place): a full id or None
        (no draft for that request from here on), and its q [V] (None: one-hot, drawn by argmax)."""
        live = masks.apply(logits, inputs, self.head) if masks is not None else [True] * len(inputs)
        cols = logits.argmax(-1).tolist()
        tokens: list[int | None] = []
        qs: list[torch.Tensor | None] = []
        for r, (inp, g) in enumerate(zip(inputs, generators)):
            if not live[r]:
                tokens.append(None)
                qs.append(None)
            elif self.sample_drafts and inp.params is not None and not inp.params.greedy:
                q = sampling.probs(logits[r:r + 1], inp.params)
                tokens.append(self.head.full_id(int(sampling.draw(q, g)[0])))
                qs.append(self.head.to_full(q[0], self.vocab_size))
            else:
                tokens.append(self.head.full_id(cols[r]))
                qs.append(None)
        if masks is not None:
            tokens = masks.advance(inputs, tokens)
        return tokens, qs
