"""An oracle drafter for measuring speculation at a set acceptance rate: it proposes the target's own
greedy continuation (from a plain greedy run of the same prompts) with each draft position
replaced, with probability 1 - α, by another token. Greedy verification then accepts each draft
with probability α given the ones before it, whatever the model's weights.

    oracle = OracleDrafter(vocab_size)
    oracle.set_references(prompts, plain_outputs)         # token ids: prompt -> greedy continuation
    oracle.configure(alpha=0.8, seed=0, cost=None)        # between runs, no request live
    llm = LLM.from_model(model, ..., drafter=oracle, spec_tokens=K)
    oracle.alpha_measured                                 # accepted / evaluated draft positions

``cost``: a real drafter (e.g. the target's MTPDrafter) run on every propose for its time alone,
its tokens discarded; it gets the hidden-state hand-over it needs, so the step costs what drafting
with it costs. A request whose history leaves its reference (verify numerics at another row count
taking another argmax within bf16 rounding) gets no drafts from then on, so a run with one is not
at α: its prompt is in ``diverged``, and the refused reference draft there is a flip, not a
rejection (``alpha_measured`` leaves it out). A benchmark can run it again with that run's output
as its reference; the tokens after the flip were decoded without drafts, so drafting them may flip
another one: a case is at α only when a run ends with ``diverged`` empty.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from k3trt.runtime.speculative.drafter import Drafter, DraftInput, Proposal, common_prefix


@dataclass
class _Track:
    key: tuple[int, ...]       # the prompt
    ref: list[int]             # the greedy continuation after the prompt
    prompt_len: int
    rng: random.Random
    proposed: list[int]
    start: int = 0             # output position of proposed[0]
    diverged: bool = False


class OracleDrafter(Drafter):
    name = "oracle"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.refs: dict[tuple[int, ...], list[int]] = {}
        self.prompt_lens: set[int] = set()
        self.alpha, self.seed, self.cost = 1.0, 0, None
        self.tracks: dict[str, _Track] = {}
        self.reset_counters()

    @property
    def needs_hidden(self) -> bool:      # read by the runtime every step: follows the cost drafter
        return self.cost is not None and self.cost.needs_hidden

    def set_references(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        for p, o in zip(prompts, outputs, strict=True):
            self.refs[tuple(p)] = list(o)
            self.prompt_lens.add(len(p))

    def configure(self, *, alpha: float, seed: int = 0, cost: Drafter | None = None) -> None:
        """α and the cost drafter of the next run; requests still tracked are dropped."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        for rid in list(self.tracks):
            self.release(rid)
        self.alpha, self.seed, self.cost = alpha, seed, cost
        self.reset_counters()

    def reset_counters(self) -> None:
        self.draft_s = 0.0             # host wall time inside propose (the cost drafter's included)
        self.proposals = 0             # propose calls that drafted for at least one request
        self.drafted = 0
        self.accepted = 0
        self.evaluated = 0             # accepted drafts + rejected ones (positions the target judged)
        self.diverged: set[tuple[int, ...]] = set()    # prompts whose history left their reference

    @property
    def alpha_measured(self) -> float | None:
        return self.accepted / self.evaluated if self.evaluated else None

    # ------------------------------------------------------------------------ drafter API
    def propose(self, inputs: Sequence[DraftInput], k: int) -> Proposal:
        t0 = time.perf_counter()
        if self.cost is not None:
            self.cost.propose(inputs, k)          # for its time: its tokens are not used
        out = Proposal.empty(len(inputs))
        for i, inp in enumerate(inputs):
            tr = self._track(inp)
            if tr is None:
                continue
            n = len(inp.token_ids) - tr.prompt_len          # output tokens committed so far
            if n < 1 or n > len(tr.ref) or inp.token_ids[-1] != tr.ref[n - 1]:
                tr.diverged = True
                self.diverged.add(tr.key)
                continue
            drafts = tr.ref[n:n + inp.limit(k)]
            for j, t in enumerate(drafts):
                if tr.rng.random() >= self.alpha:        # another token: never the target's
                    drafts[j] = (t + 1 + tr.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            tr.proposed, tr.start = drafts, n
            out.tokens[i] = drafts
            self.drafted += len(drafts)
        if any(out.tokens):
            self.proposals += 1
        if self.cost is not None:
            _sync()
        self.draft_s += time.perf_counter() - t0
        return out

    def on_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        if self.cost is not None:
            self.cost.on_hidden(request_id, start, hidden)

    def on_commit(self, request_id: str, tokens: Sequence[int]) -> None:
        tr = self.tracks.get(request_id)
        if tr is not None and tr.proposed:
            a = min(common_prefix(tr.proposed, tokens), len(tokens) - 1)
            self.accepted += a
            # a refused draft the oracle left as the reference is a numerics flip (the request
            # leaves its reference here), not a rejection at the set α: it is not judged
            self.evaluated += a + (a < len(tr.proposed) and tr.proposed[a] != tr.ref[tr.start + a])
            tr.proposed = []
        if self.cost is not None:
            self.cost.on_commit(request_id, tokens)

    def release(self, request_id: str) -> None:
        self.tracks.pop(request_id, None)
        if self.cost is not None:
            self.cost.release(request_id)

    # ------------------------------------------------------------------------ internals
    def _track(self, inp: DraftInput) -> _Track | None:
        tr = self.tracks.get(inp.request_id)
        if tr is None:
            for n in sorted(self.prompt_lens, reverse=True):
                key = tuple(inp.token_ids[:n])
                ref = self.refs.get(key)
                if ref is not None:
                    # one stream per prompt (int tuples hash the same in every process): the same
                    # prompt draws the same corruptions each run
                    tr = _Track(key, ref, n, random.Random(hash((self.seed, key))), [])
                    break
            else:
                raise KeyError(f"oracle drafter: no reference continuation for request {inp.request_id} "
                               "(set_references with its prompt first)")
            self.tracks[inp.request_id] = tr
        return None if tr.diverged else tr


def _sync() -> None:
    """The cost drafter's device work belongs to the draft time."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
