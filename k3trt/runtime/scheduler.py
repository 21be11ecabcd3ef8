"""Which requests run in the next step, how many tokens each, and at which capacity.

Policy (FCFS throughout; older requests never wait for newer ones):
  1. decodes: every running request whose prompt is done brings 1 + len(drafts) verify rows. If its
     blocks cannot grow, its drafts go first (they are optional: speculation never preempts), then
     the newest running request is preempted (caches dropped, recomputed later), down to the
     request itself.
  2. prefill chunks for running requests that are still in their prompt (a chunk that gets no
     block at all preempts newer requests not yet in the step), then admission of waiting
     requests (a KDA slot, prefix-cache hit, blocks for the first chunk), under the step's token
     budget (``max_num_tokens``, decode rows count first) and the largest prefill capacity. A chunk
     that reaches an image not yet encoded takes its image tokens from the step's encoder budget
     (``max_encoder_tokens``; the plan's ``encodes``) or ends before the image. The
     first ready request of the queue blocks the ones behind it (a request whose grammar is still
     compiling is not ready and is passed over); admission never preempts.
Chunk ends fall on block boundaries when the prompt goes on (and, for the hybrid model with prefix
caching, the last full block boundary gets its own chunk end) so that KDA state checkpoints exist
where prefix hits can use them.

Capacities: the verify step runs at the smallest verify capacity (a batch size) covering its
requests, the prefill step at the smallest token capacity covering its tokens. Work past the
largest capacity waits for the next step; nothing is truncated.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from k3trt.engine.capacities import Capacities, pick
from k3trt.runtime.kv_cache import CacheManager
from k3trt.runtime.request import Request, Status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_tokens: int                    # tokens per step: prefill chunks + verify rows
    capacities: Capacities                 # validated; the largest verify capacity is the live-request limit
    max_model_len: int
    prefix_caching: bool = True
    hybrid: bool = True                    # the model has KDA layers (checkpoint chunk ends)
    max_encoder_tokens: int = 0            # image tokens the vision encoder makes per step

    def __post_init__(self) -> None:
        self.capacities.check_budget(self.max_num_tokens)

    @property
    def max_batch(self) -> int:
        return self.capacities.verify[-1]

    @property
    def spec_tokens(self) -> int:
        """Most drafts per request; 0: plain decode."""
        return self.capacities.spec_tokens


@dataclass
class Chunk:
    req: Request
    start: int             # first token (= tokens already cached)
    num_tokens: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the request's last token, so its logits give the next token."""
        return self.start + self.num_tokens == len(self.req.token_ids)


@dataclass
class StepPlan:
    decodes: list[Request] = field(default_factory=list)     # each with 1 + len(drafts) rows
    prefills: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    encodes: list[tuple[Request, int]] = field(default_factory=list)   # (request, image) to encode first
    encoder_tokens: int = 0
    verify_capacity: int | None = None
    prefill_capacity: int | None = None

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager):
        self.config, self.cache = config, cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []       # arrival order: oldest first

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a request (finished or cancelled); the caller releases its resources."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def compiling(self) -> list[Request]:
        """Waiting requests that cannot run yet (their grammar is compiling)."""
        return [r for r in self.waiting if not r.ready]

    # ---------------------------------------------------------------------------- one step
    def schedule(self) -> StepPlan:
        plan, cfg = StepPlan(), self.config
        budget = cfg.max_num_tokens
        for req in list(self.running):
            if req.status is not Status.RUNNING or not req.decoding:
                continue
            rows = 1 + len(req.drafts)
            while not self.cache.allocate(req, req.num_computed + rows):
                if req.drafts:
                    req.set_drafts([])
                    rows = 1
                    continue
                victim = self.running[-1]
                self.preempt(victim, plan)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                plan.decodes.append(req)
                budget -= rows
        prefill_budget = min(budget, cfg.capacities.prefill[-1])
        for req in list(self.running):
            if prefill_budget <= 0:
                break
            if req.decoding or req.status is not Status.RUNNING:
                continue
            took = self._chunk(req, prefill_budget, plan)
            # no block for even part of the chunk: newer requests not in this step make room
            # (otherwise prefills that each hold part of the pool could wait on each other forever)
            while not took and not self._waits_for_encoder(req, plan) and \
                    (victim := self._unscheduled_newer(req, plan)) is not None:
                self.preempt(victim, plan)
                took = self._chunk(req, prefill_budget, plan)
            prefill_budget -= took
        while self.waiting and prefill_budget > 0 and self.cache.free_slots:
            req = next((r for r in self.waiting if r.ready), None)
            if req is None:
                break
            self.cache.admit(req)
            took = self._chunk(req, prefill_budget, plan)
            if not took:
                self.cache.free(req)     # not enough blocks yet: it stays at the head of the queue
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            # by arrival, so that a resumed (preempted) request keeps its seniority
            bisect.insort(self.running, req, key=lambda r: r.stats.arrival)
            prefill_budget -= took
        if plan.decodes:
            plan.verify_capacity = pick(cfg.capacities.verify, len(plan.decodes), "verify")
        if plan.prefills:
            plan.prefill_capacity = pick(cfg.capacities.prefill, sum(c.num_tokens for c in plan.prefills), "prefill")
        return plan

    def refit(self, plan: StepPlan) -> None:
        """Drop requests that ended after the schedule (e.g. a grammar fault) and re-pick capacities."""
        plan.decodes = [r for r in plan.decodes if not r.finished]
        plan.prefills = [c for c in plan.prefills if not c.req.finished]
        plan.encodes = [(r, i) for r, i in plan.encodes if not r.finished]
        cfg = self.config
        plan.verify_capacity = pick(cfg.capacities.verify, len(plan.decodes), "verify") if plan.decodes else None
        plan.prefill_capacity = pick(cfg.capacities.prefill, sum(c.num_tokens for c in plan.prefills),
                                     "prefill") if plan.prefills else None

    def _chunk(self, req: Request, budget: int, plan: StepPlan) -> int:
        """Schedule the next prompt chunk of `req` within `budget` tokens; returns its size (0: none fit)."""
        bs, start, total = self.cache.block_size, req.num_computed, len(req.token_ids)
        end = min(total, start + budget)
        if req.images:
            end = self._encoder_end(req, start, end, plan)
        if self.config.prefix_caching:
            if end < total and end - end % bs > start:
                end -= end % bs                          # checkpoints only exist at block boundaries
            elif end == total and self.config.hybrid and total % bs and total - total % bs > start:
                end = total - total % bs                 # the prompt's last boundary gets a checkpoint
        # fewer tokens if the pool cannot take them all (whole blocks; progress over waiting)
        while end > start and not self.cache.allocate(req, end):
            end = max(start, (self.cache.blocks_for(end) - 1) * bs)
        if end == start:
            return 0
        for i, im in enumerate(req.images):
            if im.offset < end and im.end > start and i not in req.image_embeds:
                plan.encodes.append((req, i))
                plan.encoder_tokens += im.num_tokens
        plan.prefills.append(Chunk(req, start, end - start))
        if req.stats.first_scheduled is None:
            req.stats.first_scheduled = time.perf_counter()
        return end - start

    def _encoder_end(self, req: Request, start: int, end: int, plan: StepPlan) -> int:
        """`end`, cut before the first image in [start, end) that still needs the encoder and does
        not fit what is left of the step's encoder budget."""
        left = self.config.max_encoder_tokens - plan.encoder_tokens
        for i, im in enumerate(req.images):
            if im.end <= start or im.offset >= end or i in req.image_embeds:
                continue
            if im.num_tokens > left:
                return max(start, im.offset)
            left -= im.num_tokens
        return end

    def _waits_for_encoder(self, req: Request, plan: StepPlan) -> bool:
        """Its next token is an image placeholder the encoder has no budget for in this step (not a
        reason to preempt anyone: the next step has the budget)."""
        return bool(req.images) and self._encoder_end(req, req.num_computed, req.num_computed + 1, plan) == req.num_computed

    def _unscheduled_newer(self, req: Request, plan: StepPlan) -> Request | None:
        busy = {id(r) for r in plan.decodes} | {id(c.req) for c in plan.prefills}
        for r in reversed(self.running):
            if r is req:
                return None
            if id(r) not in busy:
                return r
        return None

    def preempt(self, req: Request, plan: StepPlan) -> None:
        """Drop the request's caches and queue it first: it recomputes prompt + output on resume."""
        log.info("preempting request %s (%d tokens cached): out of cache blocks", req.request_id, req.num_computed)
        self.running.remove(req)
        self.cache.free(req)
        req.set_drafts([])
        req.image_embeds.clear()
        req.status = Status.WAITING
        req.stats.preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)
