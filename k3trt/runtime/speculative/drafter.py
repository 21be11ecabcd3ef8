"""The one drafter interface: what the runtime asks of n-gram, draft-model, MTP and parallel drafters.

Per step (see ARCHITECTURE.md, "One step of the runtime"), for the decoding requests that speculate:

    prop = drafter.propose([DraftInput(r.request_id, r.token_ids, max_drafts=…), …], k)
    …verify rows [last committed token, *prop.tokens[i]] through the target, accept (acceptance.py)…
    drafter.on_hidden(r.request_id, start, hidden)     # only when drafter.needs_hidden (MTP)
    drafter.on_image_embeds(r.request_id, positions, rows)   # needs_hidden, a prefill chunk with images
    drafter.on_commit(r.request_id, committed_tokens)  # the n accepted drafts + the target's token
    drafter.release(r.request_id)                      # when the request ends or is preempted

Contract
- ``token_ids`` is the request's prompt + committed output (append-only between calls); its last
  token is the one the target has not cached yet (it is the first verify row). Drafters never copy
  it whole per step: the runtime passes its own list.
- A guided request's input carries its grammar (``guide``): a drafter may draw under it
  (speculative/draw.py) or ignore it; drafts the grammar refuses are cut before verification.
- ``propose`` may return fewer than k tokens, or none, for any request (no match, no cache room,
  no state yet): verify then runs with fewer rows. It never returns more than ``max_drafts``.
- ``Proposal.probs[i]`` is q: the distribution each draft token was actually drawn from, row j
  conditioned on drafts < j ([len(tokens[i]), V] fp32, on the drafter's device). None means
  one-hot (the draft was chosen deterministically; q = 1 on its token) — always valid for both
  greedy and stochastic acceptance.
- A stateful drafter (own caches) advances them while drafting and, on ``on_commit``, keeps what
  matches the committed tokens and rolls the rest back. It reconciles lazily in ``propose`` too,
  against ``token_ids``, so a step whose drafts were dropped (grammar cut, preemption before
  verify) cannot leave it out of sync. ``release`` frees everything it holds for the request;
  a later ``propose`` for the same id starts from scratch (catches up on the whole history).

A parallel drafter (DFlash / DSpark style: one forward proposes all K positions at once, usually
conditioned on target hidden features) plugs in unchanged: ``needs_hidden = True`` to receive the
target's hidden states through ``on_hidden``; ``propose`` runs its single forward over the K mask
positions and returns the K tokens. If it samples position j from its own per-position marginal
q_j, independently of the other positions, then q_j *is* the conditional distribution of draft j
given drafts < j, so returning those rows as ``probs`` keeps stochastic acceptance exact. A
drafter whose per-position outputs are chosen jointly (tree / beam search over the parallel
logits) must return one-hot q (probs None) instead.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from k3trt.runtime.params import SamplingParams


@dataclass(frozen=True)
class DraftInput:
    request_id: str
    token_ids: Sequence[int]                 # prompt + committed output (not copied)
    max_drafts: int | None = None            # per-request cap (e.g. max_tokens left - 1); None: k
    params: SamplingParams | None = None     # for drafters that sample drafts; None or greedy: argmax
    seed: int = 0                            # seeds a sampling drafter's per-request generator
    guide: Any = None                        # the request's GuidedState: model drafters draw under its mask

    def limit(self, k: int) -> int:
        return max(0, min(k, k if self.max_drafts is None else self.max_drafts))


@dataclass(frozen=True)
class Proposal:
    tokens: list[list[int]]                                   # per input, 0..k draft ids
    probs: list[torch.Tensor | None] = field(default_factory=list)   # per input q [n_i, V] or None

    def q(self, i: int) -> torch.Tensor | None:
        return self.probs[i] if self.probs else None

    @classmethod
    def empty(cls, n: int) -> "Proposal":
        return cls([[] for _ in range(n)], [None] * n)


class Drafter(abc.ABC):
    """Proposes draft tokens for a batch of requests; owns whatever per-request state it needs."""

    name: str = "drafter"
    needs_hidden: bool = False   # wants the target's hidden states through on_hidden (MTP, DFlash)

    @abc.abstractmethod
    def propose(self, inputs: Sequence[DraftInput], k: int) -> Proposal:
        """Up to min(k, input.max_drafts) draft tokens per input, in input order."""

    def on_commit(self, request_id: str, tokens: Sequence[int]) -> None:
        """`tokens` were appended to the request's history after the last propose (the accepted
        drafts and the target's token, cut at a stop token). Stateful drafters roll back here."""

    def on_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states [n, hidden] (what ``K3ForCausalLM.forward`` returns, before
        the final norm) for history positions start..start+n-1. Only called when needs_hidden."""

    def on_image_embeds(self, request_id: str, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """The image embeddings the target read in place of the token embeddings at these prompt
        positions (int64 [n], rows [n, hidden]), after the on_hidden of the prefill chunk holding
        them. Only called when needs_hidden; drafters that embed prompt tokens themselves use them."""

    def release(self, request_id: str) -> None:
        """Drop all state held for the request (finished, aborted, failed or preempted)."""

    def stats(self) -> dict[str, int]:
        """The drafter's own counters (e.g. drafts drawn under a grammar mask); none by default."""
        return {}


class NoDrafter(Drafter):
    """Speculation off: never proposes (the runtime then runs plain decode rows)."""

    name = "none"

    def propose(self, inputs: Sequence[DraftInput], k: int) -> Proposal:
        return Proposal.empty(len(inputs))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (how many fed drafts the committed tokens confirm)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
