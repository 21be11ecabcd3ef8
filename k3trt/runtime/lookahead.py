"""Decode one step ahead: launch step N+1 before step N's tokens reach the host.

A synchronous decode step leaves the GPU idle while the host reads the sampled tokens, commits
them, schedules the next step and packs its inputs (0.4 ms a step at batch 1 on the H200, 2.5 ms
at batch 128: 12-27% of the step). When every request's next token is a function of its logits row
and its own generator alone, the next step's inputs are known on the device: ``NextTokens`` takes
the argmax of a greedy row and, for a sampled one, its draw from the request's generator
(``sampling.choose``, the synchronous path's own expression). So once step N is launched, the loop
launches N+1 over the same requests with those ids copied into its input buffer on the device, and
only then waits for N's tokens (copied to pinned memory before N+1 was queued, so the wait ends
with N, not N+1) and commits them while N+1 runs. A sampled request draws once per step either way
(here, and then not again at its commit), so its generator's stream, and with it every token, is
the synchronous loop's for the same seed.

A step is launched ahead only when nothing about it can change on the host:
  - a graph session (its static input buffer takes the device ids), speculation off;
  - N is a pure decode step, without drafts, of requests whose next token is chosen on the device
    (``chosen_on_device``: no grammar, logits processor or penalty, which read the committed
    tokens on the host; greedy or sampled, logprobs or not), all still running, no request
    waiting to be admitted (admission needs the normal schedule);
  - every request can take the next position's block now (no preemption);
  - with prefix caching on a hybrid model, no request reaches a block boundary at N (its KDA
    checkpoint is copied at the start of the next scheduled step: N+1 would already have moved it).
A request that N ends (EOS, max_tokens, abort) still has a row in N+1: the row is ignored, and the
blocks and KDA slot it releases are reused only by steps queued after N+1 on the same stream.
Greedy and seeded sampled output are unchanged token for token (tests/runtime/test_lookahead.py).

`Lookahead` is the step loop's (loop.py) handle on this: it holds the launched step and is told
everything it decides on (the session, the cache, the plan, whether requests wait); it counts
nothing and commits nothing, the loop does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3trt.runtime import sampling, spec_ahead
from k3trt.runtime.engine import EngineSession, Seq, make_batch
from k3trt.runtime.graphs import GraphSession
from k3trt.runtime.kv_cache import CacheManager
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.request import Request, Status
from k3trt.runtime.scheduler import StepPlan
from k3trt.runtime.spec_ahead import DeviceDrafter, SpecLaunch
from k3trt.runtime.step import Rows, StepOutput


@dataclass
class Launched:
    """Step N+1, in flight: its plan and outputs, and which requests it writes a row for."""
    plan: StepPlan
    out: StepOutput
    ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = frozenset(id(r) for r in self.plan.decodes)

    def holds(self, req: Request) -> bool:
        return id(req) in self.ids

    def rows(self, req: Request) -> int:
        """Rows this step writes for `req` past its committed tokens (0: none)."""
        return int(self.holds(req))


def chosen_on_device(p: SamplingParams) -> bool:
    """The request's next token is a function of its logits row and its generator alone (no
    processor, penalty or grammar reads its committed tokens on the host)."""
    return (p.guided is None and not p.logits_processors and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty)


class NextTokens:
    """Every row's next token, chosen on the device (the argmax, or a sampled request's draw from
    its own generator: sampling.choose, the synchronous path's expression) and copied to pinned
    memory before the next step is queued: reading it waits for this step only. Each request
    draws exactly once per step, here instead of at its commit, so its generator's stream is the
    synchronous loop's."""

    def __init__(self, logits: torch.Tensor, rows: list[Rows]):
        self.dev = logits.argmax(-1)
        for r in rows:
            if not r.req.params.greedy:
                self.dev[r.row0:r.row0 + 1] = sampling.choose(logits[r.row0:r.row0 + 1].float(), r.req.params,
                                                              r.req.generator)
        self.host = torch.empty(self.dev.shape, dtype=self.dev.dtype, pin_memory=logits.is_cuda)
        self.host.copy_(self.dev, non_blocking=logits.is_cuda)
        self.event = torch.cuda.Event() if logits.is_cuda else None
        if self.event is not None:
            self.event.record()

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Lookahead:
    """At most one step launched ahead of its inputs' commit, and the rules for launching it."""

    def __init__(self, session: EngineSession, cache: CacheManager, *, speculating: bool, checkpoints: bool):
        self.session, self.cache, self.checkpoints = session, cache, checkpoints
        self.possible = isinstance(session, GraphSession) and not speculating
        self.launched: Launched | SpecLaunch | None = None

    def eligible(self, plan: StepPlan, *, waiting: bool) -> bool:
        """The step after `plan` can be launched before `plan`'s tokens are committed (module doc);
        `checkpoints`: prefix caching on a hybrid model."""
        if not self.possible or plan.prefills or not plan.decodes or waiting:
            return False
        bs = self.cache.block_size
        for r in plan.decodes:
            if r.status is not Status.RUNNING or r.drafts or not chosen_on_device(r.params):
                return False
            if self.checkpoints and (r.num_computed + 1) % bs == 0:
                return False
        return True

    def launch(self, plan: StepPlan, nxt: NextTokens) -> Launched | None:
        """Launch the step after `plan` and hold it (None: a next block was not free)."""
        self.launched = launch_ahead(self.session, self.cache, plan, nxt)
        return self.launched

    def launch_spec(self, drafter: DeviceDrafter, plan: StepPlan, out: StepOutput, k: list[int]) -> SpecLaunch | None:
        """Launch the verify step after the verify step `plan` on the device's verdict of it and hold
        it (spec_ahead.py; None: a block was not free)."""
        self.launched = spec_ahead.launch(self.session, drafter, self.cache, plan, out, k)
        return self.launched

    def take(self) -> Launched | SpecLaunch | None:
        """The launched step, handed over to be finished (and no longer held)."""
        out, self.launched = self.launched, None
        return out

    def reserve(self, req: Request) -> int:
        """Rows the launched step writes for `req` past what it commits now (their blocks must stay)."""
        return 0 if self.launched is None else self.launched.rows(req)


def launch_ahead(session: EngineSession, cache: CacheManager, plan: StepPlan,
                 nxt: NextTokens) -> Launched | None:
    """Launch the step after `plan` (whose tokens are not committed yet); None if a request's
    next block is not free (the normal schedule then preempts as it must)."""
    reqs = plan.decodes
    for r in reqs:   # the next position: num_computed + 1 once N is committed
        if not cache.allocate(r, r.num_computed + 2):
            return None
    seqs = [Seq([0], r.num_computed + 1, r.blocks, r.kda_slot, 1) for r in reqs]
    batch = make_batch(seqs, cache.block_size, capacity=plan.verify_capacity)
    logits = session.verify(batch, device_ids=nxt.dev)
    nxt = StepPlan(decodes=list(reqs), verify_capacity=plan.verify_capacity)
    return Launched(nxt, StepOutput(logits, [Rows(r, i, 1) for i, r in enumerate(reqs)], []))
