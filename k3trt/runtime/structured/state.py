"""`GuidedState`: one request's grammar matcher and reasoning gate, driven by the step loop.

Per step (see the package doc for the full sequence):
- `fill_masks(drafts, bitmask, row0)` fills rows row0 .. row0 + n for the last committed position
  and each draft, walking the matcher through the drafts and rolling it back before returning (the
  matcher is never left advanced), and returns n = how many drafts the grammar admits;
- `commit(tokens)` advances by the tokens actually accepted and returns how many it consumed: all
  of them, or fewer when the grammar ended (eos accepted) inside the block.

The reasoning gate (`after_reasoning`): until the output has closed its think channel, tokens are
free (anything but eos) and do not reach the matcher. The gate opens after the `<|sep|>` token of
a `<|close|>` `think` `<|sep|>` marker (whitespace around the name allowed, as the XTML parser
allows); the marker may fall anywhere inside a draft or an accepted block. The gate is a small
immutable value, so a mask fill walks copies of it and never has to undo anything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

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
        self._gate0: Gate = _CLOSED if guide.spec.after_reasoning else None
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
