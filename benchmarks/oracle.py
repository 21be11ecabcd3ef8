"""An oracle drafter for measuring speculation at a set acceptance rate: it proposes the target's own
greedy continuation (from a plain greedy run of the same prompts) with each output position's draft
replaced, with probability 1 - α, by another token (drawn once per position and run, so every
draft of that position is the same). Greedy verification then accepts each draft with probability
α given the ones before it, whatever the model's weights.

    oracle = OracleDrafter(vocab_size)
    oracle.set_references(prompts, plain_outputs)         # token ids: prompt -> greedy continuation
    oracle.configure(alpha=0.8, seed=0, cost=None)        # between runs, no request live
    llm = LLM.from_model(model, ..., drafter=oracle, spec_tokens=K)
    oracle.alpha_measured                                 # accepted / judged draft positions

It drafts on the host (``propose``) and on the device (``propose_on_device``: a lookup in a device
copy of the same drafts), so the runtime overlaps its verify steps with the host
(runtime/spec_ahead.py) as it does for the MTP drafter. ``cost``: a real drafter (the target's
MTPDrafter wrapped in mtp_ahead.MTPAhead) run on every propose, host or device, for its time alone,
its tokens discarded; it gets the hidden-state hand-over it needs, so the step costs what drafting
with it costs. Draft time: host wall of ``propose`` (device work synchronised) plus, for device
drafts, CUDA-event time around the cost drafter and the lookup (no synchronisation: that would
undo the overlap).

Acceptance is counted at commit: the committed tokens against the reference and the step's drafts.
A request whose history leaves its reference (verify numerics at another row count taking another
argmax within bf16 rounding) is in ``diverged`` and gets no host drafts from then on, so a run with
one is not at α; the token that left is a flip, not a rejection (``alpha_measured`` leaves it out).
A benchmark can run it again with that run's output as its reference: a case is at α only when a
run ends with ``diverged`` empty.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from k3trt.runtime.spec_ahead import to_device
from k3trt.runtime.speculative.drafter import Drafter, DraftInput, Proposal

PAD = 8                 # draft entries past the reference: room for a window that runs past its end


@dataclass
class _Track:
    key: tuple[int, ...]       # the prompt
    ref: list[int]             # the greedy continuation after the prompt
    drafts: list[int]          # the draft of each output position: ref[p], or another token
    row: int                   # its row in the device table
    out: int = 0               # output tokens committed
    pending: deque = field(default_factory=deque)    # drafts per step proposed and not yet committed
    diverged: bool = False


class OracleDrafter(Drafter):
    name = "oracle"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.refs: dict[tuple[int, ...], list[int]] = {}
        self.prompt_lens: set[int] = set()
        self.alpha, self.seed, self.cost = 1.0, 0, None
        self.tracks: dict[str, _Track] = {}
        self.rows: list[list[int]] = []              # every track's drafts since configure
        self.table: torch.Tensor | None = None       # rows on the device (rebuilt when rows grow)
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
        self.rows, self.table = [], None
        self.reset_counters()

    def reset_counters(self) -> None:
        self.host_s = 0.0              # host wall time inside propose (the cost drafter's included)
        self.events: list = []         # (start, end) CUDA events around device drafting
        self.device_s = 0.0            # device drafting timed on the host (no CUDA events: the CPU)
        self.proposals = 0             # propose calls that drafted for at least one request
        self.drafted = 0
        self.accepted = 0
        self.evaluated = 0             # accepted drafts + rejected ones (positions the target judged)
        self.diverged: set[tuple[int, ...]] = set()    # prompts whose history left their reference

    @property
    def alpha_measured(self) -> float | None:
        return self.accepted / self.evaluated if self.evaluated else None

    @property
    def draft_s(self) -> float:
        """Drafting time so far: host proposals, and device proposals (waits for their events)."""
        dev = 0.0
        for a, b in self.events:
            b.synchronize()
            dev += a.elapsed_time(b) / 1e3
        return self.host_s + self.device_s + dev

    # ------------------------------------------------------------------------ drafter API
    def propose(self, inputs: Sequence[DraftInput], k: int) -> Proposal:
        t0 = time.perf_counter()
        if self.cost is not None:
            self.cost.propose(inputs, k)          # for its time: its tokens are not used
        out = Proposal.empty(len(inputs))
        for i, inp in enumerate(inputs):
            tr = self._track(inp.request_id, inp.token_ids)
            n = len(inp.token_ids) - (len(tr.key))           # output tokens committed so far
            tr.out = n
            tr.pending.clear()        # a host proposal follows every commit: nothing is in flight
            if n < 1 or n > len(tr.ref) or inp.token_ids[-1] != tr.ref[n - 1]:
                self._diverge(tr)
            if tr.diverged:
                continue
            drafts = tr.drafts[n:n + inp.limit(k)]
            tr.pending.append(len(drafts))
            out.tokens[i] = drafts
            self.drafted += len(drafts)
        if any(out.tokens):
            self.proposals += 1
        if self.cost is not None:
            _sync()
        self.host_s += time.perf_counter() - t0
        return out

    def propose_on_device(self, reqs, bonus: torch.Tensor, hidden: torch.Tensor | None,
                          num_accepted: torch.Tensor, k: Sequence[int]) -> torch.Tensor:
        """spec_ahead.DeviceDrafter: the drafts after step N's device verdict, from the device table."""
        dev, K = bonus.device, max(k)
        timed = dev.type == "cuda"
        t0 = time.perf_counter()
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if self.cost is not None:
            self.cost.propose_on_device(reqs, bonus, hidden, num_accepted, k)    # for its time
        tracks = [self._track(r.request_id, r.token_ids) for r in reqs]
        if self.table is None or self.table.shape[0] < len(self.rows):
            width = max(len(d) for d in self.rows)
            self.table = to_device([x for d in self.rows for x in d + [0] * (width - len(d))], dev).view(-1, width)
        meta = to_device([tr.row for tr in tracks] + [r.num_output for r in reqs], dev)
        rows, base = meta[:len(reqs)], meta[len(reqs):]
        at = (base + num_accepted + 1)[:, None] + torch.arange(K, device=dev)
        drafts = self.table[rows[:, None], at.clamp(max=self.table.shape[1] - 1)]
        for tr, kr in zip(tracks, k):
            tr.pending.append(kr)
        self.drafted += sum(k)
        self.proposals += 1
        if timed:
            end.record()
            self.events.append((start, end))
        else:
            self.device_s += time.perf_counter() - t0
        return drafts

    def on_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        if self.cost is not None:
            self.cost.on_hidden(request_id, start, hidden)

    def on_commit(self, request_id: str, tokens: Sequence[int]) -> None:
        if self.cost is not None:
            self.cost.on_commit(request_id, tokens)
        tr = self.tracks.get(request_id)
        if tr is None:                # the prefill's token: the first proposal makes the track
            return
        k = tr.pending.popleft() if tr.pending else 0
        n0, tr.out = tr.out, tr.out + len(tokens)
        if tr.diverged:
            return
        if tr.ref[n0:n0 + len(tokens)] != list(tokens):
            self._diverge(tr)         # a flip off the reference: not judged
            return
        if k:
            a = len(tokens) - 1                      # the drafts accepted (the last token is the target's)
            self.accepted += a
            self.evaluated += a + (a < k and tr.drafts[n0 + a] != tr.ref[n0 + a])

    def release(self, request_id: str) -> None:
        self.tracks.pop(request_id, None)
        if self.cost is not None:
            self.cost.release(request_id)

    # ------------------------------------------------------------------------ internals
    def _diverge(self, tr: _Track) -> None:
        tr.diverged = True
        self.diverged.add(tr.key)

    def _track(self, request_id: str, token_ids: Sequence[int]) -> _Track:
        tr = self.tracks.get(request_id)
        if tr is not None:
            return tr
        for n in sorted(self.prompt_lens, reverse=True):
            key = tuple(token_ids[:n])
            ref = self.refs.get(key)
            if ref is not None:
                break
        else:
            raise KeyError(f"oracle drafter: no reference continuation for request {request_id} "
                           "(set_references with its prompt first)")
        # one stream per prompt (int tuples hash the same in every process): the same prompt draws
        # the same drafts each run
        rng, V = random.Random(hash((self.seed, key))), self.vocab_size
        drafts = [t if rng.random() < self.alpha else (t + 1 + rng.randrange(V - 1)) % V for t in ref]
        tr = self.tracks[request_id] = _Track(key, ref, drafts + [0] * PAD, len(self.rows))
        self.rows.append(tr.drafts)
        return tr


def _sync() -> None:
    """The cost drafter's device work belongs to the draft time."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
