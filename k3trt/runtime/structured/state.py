"""`GuidedState`: one request's grammar matcher and reasoning gate, driven by the step loop.

Per step (see the package doc for the full sequence):
- `admit(drafts)` (before the forward) returns n = how many leading drafts the grammar admits,
  walking the matcher through them (accept_token, no mask) and rolling it back;
- `fill_masks(drafts, bitmask, row0)` (after the forward is launched) fills rows row0 .. row0 + n
  for the last committed position and each draft, walking the matcher through the drafts and
  rolling it back before returning (the matcher is never left advanced), and returns the same n;
  `fill_masks_batch` does that for many requests at once (xgrammar's BatchGrammarMatcher);
- `draft_walk()` (while a drafter draws a guided request's drafts) walks the matcher over each
  drawn token and fills the mask of the next one, so drafts are drawn under the grammar; closing
  it rolls the matcher back;
- `commit(tokens)` advances by the tokens actually accepted and returns how many it consumed: all
  of them, or fewer when the grammar ended (eos accepted) inside the block.

The reasoning gate (`after_reasoning` with unbounded reasoning; a bounded one is part of the
grammar, grammars.py): until the output has closed its think channel, tokens are free (anything but eos) and do not reach the matcher. The gate opens after the `<|sep|>` token of
a `<|close|>` `think` `<|sep|>` marker (whitespace around the name allowed, as the XTML parser
allows); the marker may fall anywhere inside a draft or an accepted block. The gate is a small
immutable value, so a mask fill walks copies of it and never has to undo anything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

import torch

from k3trt.runtime.structured.spec import GrammarError
from k3trt.runtime.structured.vocab import is_allowed, xgr

if TYPE_CHECKING:
    from k3trt.runtime.structured.cache import CompiledGuide

log = logging.getLogger(__name__)

_MAX_NAME = 64                       # bytes between <|close|> and <|sep|> we look at
Gate = tuple[bool, bytes] | None     # (just saw <|close|>, name bytes since) or None: open
_CLOSED: Gate = (False, b"")


class GuidedState:
    """Owned by one request; `release()` once when the request ends (however it ends)."""

    def __init__(self, guide: "CompiledGuide") -> None:
        self.guide = guide
        self.vocab = guide.vocab
        self._matcher = xgr().GrammarMatcher(guide.grammar)
        spec = guide.spec
        self._gate0: Gate = _CLOSED if spec.after_reasoning and not spec.bounds_reasoning else None
        self._gate: Gate = self._gate0
        self._terminated = False
        self.num_committed = 0       # tokens committed (reasoning included)

    # ---- queries ------------------------------------------------------------------------------
    @property
    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted eos): nothing but eos may follow."""
        return self._terminated

    @property
    def in_reasoning(self) -> bool:
        return self._gate is not None

    # ---- the step ------------------------------------------------------------------------------
    def admit(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar admits: the n fill_masks would return, without
        filling any mask row (the cheap check that cuts drafts before verification). The matcher
        is left where it was."""
        walk, n = self.draft_walk(), 0
        try:
            for token in drafts:
                if not walk.advance(token):
                    break
                n += 1
        finally:
            walk.close()
        return n

    def draft_walk(self) -> "DraftWalk":
        """A walk from the committed state over drafts as they are drawn (DraftWalk); close() it."""
        return DraftWalk(self)

    def fill_masks(self, drafts: Sequence[int], bitmask: torch.Tensor, row0: int = 0) -> int:
        """Fill bitmask rows row0 + i (i = 0 .. n) for the position after the last committed token
        and after each of the first n drafts; return n, the number of leading drafts the grammar
        admits (cut the drafts to n before verification). Rows past row0 + n are not touched.
        bitmask: int32 [rows, vocab.num_words] on the CPU (GrammarVocab.allocate_bitmask)."""
        self._check_live()
        gate, steps, n = self._gate, 0, 0
        try:
            self._fill_row(gate, bitmask, row0)
            for token in drafts:
                token = int(token)
                in_vocab = 0 <= token < self.vocab.vocab_size  # a drafter may propose garbage
                if not (in_vocab and is_allowed(bitmask, row0 + n, token)):
                    break
                if gate is not None:
                    gate = self._advance_gate(gate, token)
                elif self._matcher.is_terminated() or not self._matcher.accept_token(token):
                    break  # past eos nothing is admitted (the eos-only row still lets eos through)
                else:
                    steps += 1
                n += 1
                self._fill_row(gate, bitmask, row0 + n)
        finally:
            if steps:
                self._matcher.rollback(steps)
        return n

    def commit(self, tokens: Sequence[int]) -> int:
        """Advance by the accepted tokens (accepted drafts + the sampled token). Returns how many
        were consumed: fewer than len(tokens) only when the grammar ended (accepted eos) first;
        the caller drops the rest. Raises GrammarError for a token the grammar does not admit
        (its mask was not applied): that fails the request, not the step."""
        self._check_live()
        n = 0
        for token in tokens:
            if self._terminated:
                break
            token = int(token)
            if self._gate is not None:
                self._gate = self._advance_gate(self._gate, token)
            elif not self._matcher.accept_token(token):
                raise GrammarError(self.guide.spec.kind, f"token {token} "
                                   f"({self.vocab.token_bytes(token)!r}) breaks the grammar after "
                                   f"{self.num_committed} output tokens; was its mask applied?")
            elif self._matcher.is_terminated():
                self._terminated = True
            n += 1
            self.num_committed += 1
        return n

    def reset(self) -> None:
        """Back to the state before any output (a request restarted from its prompt)."""
        self._check_live()
        self._matcher.reset()
        self._gate, self._terminated, self.num_committed = self._gate0, False, 0

    def release(self) -> None:
        """Drop the matcher; idempotent. Any later call but release() raises."""
        self._matcher = None

    @property
    def released(self) -> bool:
        return self._matcher is None

    # ---- internals ------------------------------------------------------------------------------
    def _check_live(self) -> None:
        if self._matcher is None:
            raise RuntimeError("GuidedState used after release()")

    def _fill_row(self, gate: Gate, bitmask: torch.Tensor, row: int) -> None:
        if gate is not None:
            bitmask[row].copy_(self.vocab.free_row)
        elif self._matcher.is_terminated():
            bitmask[row].copy_(self.vocab.eos_row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def _advance_gate(self, gate: Gate, token: int) -> Gate:
        v = self.vocab
        after_close, name = gate
        if token == v.close_id:
            return (True, b"")
        if token == v.sep_id:
            return None if after_close and name.strip() == b"think" else _CLOSED
        if after_close and token not in v.special_ids and len(name) <= _MAX_NAME:
            return (True, name + v.token_bytes(token))
        return _CLOSED


class DraftWalk:
    """A guided request's grammar walked over its drafts while a drafter draws them: ``fill`` writes
    the mask of the next draft, ``advance`` walks on by the drawn token (False: the grammar refuses
    it, and the walk stops there); ``close`` rolls the matcher back to the committed state. The
    same rules as ``admit`` (which is such a walk): out-of-vocabulary ids and special tokens no
    grammar can ask for are refused without asking xgrammar."""

    def __init__(self, state: GuidedState) -> None:
        state._check_live()
        self.state, self.gate, self.steps, self.stopped = state, state._gate, 0, False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.state._fill_row(self.gate, bitmask, row)

    def advance(self, token: int) -> bool:
        s, v, token = self.state, self.state.vocab, int(token)
        m = s._matcher
        if self.stopped or not 0 <= token < v.vocab_size:
            ok = False
        elif self.gate is not None:
            ok = bool((int(v.free_row[token >> 5]) >> (token & 31)) & 1)     # the free row's bit
            if ok:
                self.gate = s._advance_gate(self.gate, token)
        else:    # a special token no grammar can ask for: refused without asking xgrammar (it logs)
            ok = (not m.is_terminated() and (token == v.eos_id or bool(v.token_bytes(token)))
                  and m.accept_token(token))
            self.steps += ok
        self.stopped = not ok
        return ok

    def close(self) -> None:
        if self.steps and not self.state.released:
            self.state._matcher.rollback(self.steps)
        self.steps = 0


def fill_walks(walks: Sequence[DraftWalk], bitmask: torch.Tensor, batcher: Any = None) -> None:
    """DraftWalk.fill of walks[i] into bitmask row i, the rows that ask xgrammar in one batched
    call when `batcher` (a BatchGrammarMatcher) is given."""
    batch = []
    for i, w in enumerate(walks):
        if batcher is not None and w.gate is None and not w.state._matcher.is_terminated():
            batch.append(i)
        else:
            w.fill(bitmask, i)
    if batch:
        batcher.batch_fill_next_token_bitmask([walks[i].state._matcher for i in batch], bitmask, batch)


def fill_masks_batch(items: Sequence[tuple[GuidedState, Sequence[int], int]], bitmask: torch.Tensor,
                     batcher: Any) -> list[Exception | None]:
    """fill_masks for many requests at once: items are (state, drafts, row0), drafts already cut by
    admit. Per draft depth j, one xgrammar batched fill (`batcher`: a BatchGrammarMatcher, its
    threads) of every matcher still inside the grammar at row0 + j, then each walks by its j-th
    draft; every matcher is rolled back at the end. Returns, per item, None or the exception that
    failed it (a draft the grammar refuses here: GrammarError); a failed item's rows are undefined,
    the others' are exactly what fill_masks fills."""
    errors: list[Exception | None] = [None] * len(items)
    gates = [s._gate for s, _, _ in items]
    steps = [0] * len(items)
    live = [i for i, (s, _, _) in enumerate(items) if not _failed(errors, i, s._check_live)]
    try:
        for j in range(1 + max((len(items[i][1]) for i in live), default=0)):
            todo = [i for i in live if errors[i] is None and j <= len(items[i][1])]
            batch = []
            for i in todo:
                s, _, row0 = items[i]
                if gates[i] is not None or s._matcher.is_terminated():
                    s._fill_row(gates[i], bitmask, row0 + j)
                else:
                    batch.append(i)
            if len(batch) > 1:
                try:
                    batcher.batch_fill_next_token_bitmask([items[i][0]._matcher for i in batch], bitmask,
                                                          [items[i][2] + j for i in batch])
                    batch = []
                except Exception:        # find the culprit: one at a time
                    pass
            for i in batch:
                s, _, row0 = items[i]
                _failed(errors, i, lambda: s._matcher.fill_next_token_bitmask(bitmask, row0 + j))
            for i in todo:
                s, drafts, _ = items[i]
                if errors[i] is not None or j == len(drafts):
                    continue
                token = int(drafts[j])
                if gates[i] is not None:
                    gates[i] = s._advance_gate(gates[i], token)
                elif s._matcher.is_terminated() or not s._matcher.accept_token(token):
                    errors[i] = GrammarError(s.guide.spec.kind, f"draft {token} was admitted before the "
                                                                f"step and refused after it")
                else:
                    steps[i] += 1
    finally:
        for i, (s, _, _) in enumerate(items):
            if steps[i] and not s.released:
                _failed(errors, i, lambda: s._matcher.rollback(steps[i]))
    return errors


def _failed(errors: list[Exception | None], i: int, fn: Any) -> bool:
    try:
        fn()
        return False
    except Exception as e:
        errors[i] = errors[i] or e
        return True
