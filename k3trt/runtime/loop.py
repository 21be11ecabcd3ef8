"""``StepLoop``: one owner for the runtime's step, end to end (ARCHITECTURE.md, "One step of the
runtime"):

  schedule  attach compiled grammars; Speculator.draft (drafts before the schedule); Scheduler.schedule
  mask      GrammarRuntime.cut_drafts: drafts cut at the first token a grammar refuses (then refit)
  forward   media.encode runs the vision encoder on the plan's images; step.run_plan launches the step
            (image embeddings in their placeholders' rows); prefill chunks that do not complete are committed;
            meanwhile on the host GrammarRuntime.fill / apply mask the guided rows
  ahead     decoding whose next tokens are chosen on the device (greedy or seeded sampling, no
            grammar, processors or penalties) launches the next step before this one's tokens reach
            the host (lookahead.py), and so does greedy speculation with a drafter that drafts on
            the device (spec_ahead.py); the loop holds the launched step through ``Lookahead``
  accept    spec_step.decide: processors, penalties, greedy or stochastic acceptance -> Verdicts
  commit    Request.block_end (EOS, stop ids, max_tokens, max_model_len: request.py is the one place
            that decides), the grammar's commit, Request.append_token (stop strings); KDA rollback
            to the last kept row; cache.commit; the drafter is handed what was kept
  emit      a snapshot (with deltas) of every request that changed

Everything a request owns is released in ``finish``, however it ends; a fault confined to one
request (its drafter, grammar or processors) ends only it (``fault``). The loop is not thread-safe:
one thread drives it (``LLM`` or the server's engine thread); only ``GrammarRuntime.submit`` may be
called from another thread.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import random
import time
from collections import Counter
from typing import Any

import torch

from k3trt.runtime import sampling, spec_ahead
from k3trt.runtime.engine import EngineSession
from k3trt.runtime.kv_cache import CacheManager
from k3trt.runtime.lookahead import Lookahead, NextTokens
from k3trt.runtime.media import ImageIntake, encode, release_passed, split_prompt
from k3trt.runtime.params import RequestError, SamplingParams
from k3trt.runtime.request import FinishReason, Request, RequestOutput, Status, new_request
from k3trt.runtime.scheduler import Scheduler, StepPlan
from k3trt.runtime.spec_ahead import SpecLaunch
from k3trt.runtime.spec_step import Speculator, Verdict, decide
from k3trt.runtime.step import Rows, StepOutput, run_plan
from k3trt.runtime.structured.runtime import GrammarRuntime
from k3trt.runtime.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


class StepLoop:
    """The live requests of one engine and the step that moves them (module doc)."""

    def __init__(self, session: EngineSession, cache: CacheManager, scheduler: Scheduler, spec: Speculator, *,
                 tokenizer: Any, eos_ids: frozenset[int], vocab_size: int, max_model_len: int, seed: int,
                 images: ImageIntake):
        self.session, self.cache, self.scheduler, self.spec, self.images = session, cache, scheduler, spec, images
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        cfg = scheduler.config
        # cheap until the first guided request: the vocabulary is built then, off the loop
        self.grammars = GrammarRuntime(tokenizer, vocab_size, rows=cfg.max_batch * (1 + spec.k))
        self.lookahead = Lookahead(session, cache, speculating=spec.enabled,
                                   checkpoints=cfg.prefix_caching and cfg.hybrid)
        self.requests: dict[str, Request] = {}
        self._touched: dict[str, Request] = {}     # changed since the last emit
        self._num_guided = 0                       # live guided requests: the grammar stages run only then
        self._spec_ahead = True                    # off once launching a verify step ahead has failed
        self._ids = itertools.count()
        self._seeds = random.Random(seed)
        self.counters: dict[str, Any] = {"steps": 0, "preemptions": 0, "generated_tokens": 0, "launched_ahead": 0,
                                         "capacity_hits": {"verify": Counter(), "prefill": Counter()}}

    # ---------------------------------------------------------------------------- requests
    def new_request(self, prompt: Any, params: SamplingParams | dict | None, index: int,
                    request_id: str | None) -> Request:
        """A checked request (RequestError names the field) with its RNG, detokenizer, images
        (media.split_prompt) and, for a guided one, its grammar compiling off the loop (the request
        waits for it)."""
        prompt, images = split_prompt(prompt, self.images, self.tokenizer)
        req = new_request(prompt, params, index=index, request_id=request_id or f"req-{next(self._ids)}",
                          tokenizer=self.tokenizer, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        req.images = images
        if not req.params.greedy:
            req.seed = req.params.seed if req.params.seed is not None else self._seeds.getrandbits(63)
            req.generator = sampling.make_generator(req.seed, self.session.device)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special=True)
        if req.params.guided is not None:
            req.guide_future = self.grammars.submit(req.params.guided)
        return req

    def submit(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise RequestError("request_id", f"{req.request_id!r} is already in flight")
        self.requests[req.request_id] = req
        self._num_guided += req.params.guided is not None
        self.scheduler.add(req)

    def abort(self, request_id: str, *, report: bool = True) -> None:
        """End a live request ("abort"); `report` False: the next emit leaves it out."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
        if not report:
            self._touched.pop(request_id, None)

    def finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None,
               error: str | None = None) -> None:
        """The one place a request ends: every resource it owns is released here."""
        if req.finished:
            return
        if req.detokenizer is not None and not isinstance(stop_reason, str):
            req.text += req.detokenizer.finish()
        req.status, req.finish_reason, req.stop_reason, req.error = Status.FINISHED, reason, stop_reason, error
        req.stats.finished = time.perf_counter()
        self.scheduler.remove(req)
        self.cache.free(req)
        self.spec.release(req)
        if req.guided is not None:
            req.guided.release()
        req.generator = req.detokenizer = req.guided = req.guide_future = None
        req.set_drafts([])
        req.image_embeds.clear()
        if self.requests.pop(req.request_id, None) is not None:
            self._num_guided -= req.params.guided is not None
        self._touched[req.request_id] = req
        if error:
            log.warning("request %s failed: %s", req.request_id, error)

    def fault(self, req: Request, error: str) -> None:
        """A fault confined to one request (its drafter, grammar or processors): it ends, alone."""
        self.finish(req, FinishReason.ERROR, error=error)

    # ---------------------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns a snapshot (with deltas) of every request that changed."""
        launched = self.lookahead.take()      # launched by the previous call, ahead of its tokens
        if launched is not None:
            plan, out = launched.plan, launched.out
            if isinstance(launched, SpecLaunch):      # its drafts, made on the device, for its acceptance
                launched.set_drafts()
        else:
            scheduled = self._schedule_and_forward()
            if scheduled is None:
                return self.emit()
            plan, out = scheduled
        chosen = None
        if self.lookahead.eligible(plan, waiting=bool(self.scheduler.waiting)):
            # the next step starts from this one's tokens chosen on the device; they are read
            # (and committed) while it runs
            chosen = NextTokens(out.logits, out.rows)
            try:
                nxt = self.lookahead.launch(plan, chosen)
            except Exception as e:   # this step's tokens still commit; the next step is scheduled normally
                log.warning("launching the next step ahead failed (%s: %s); stepping synchronously",
                            type(e).__name__, e)
                nxt = None
            if nxt is not None:
                self.count_step(nxt.plan)
                self.counters["launched_ahead"] += 1
        elif (spec := self._launch_spec(plan, out)) is not None:
            chosen = spec.chosen
        self.commit(out.rows, out.logits, chosen.tolist() if chosen is not None else None,
                    rolled_back=isinstance(self.lookahead.launched, SpecLaunch))
        return self.emit()

    def _launch_spec(self, plan: StepPlan, out: StepOutput) -> SpecLaunch | None:
        """Launch the verify step after `plan` on the device's verdict of it (spec_ahead.py), if it can be."""
        cfg = self.scheduler.config
        if not self._spec_ahead or not self.spec.enabled or not spec_ahead.eligible(
                self.session, self.spec.drafter, plan, out, self.cache, waiting=bool(self.scheduler.waiting),
                checkpoints=cfg.prefix_caching and cfg.hybrid, max_model_len=self.max_model_len, k=self.spec.k):
            return None
        try:
            nxt = self.lookahead.launch_spec(self.spec.drafter, plan, out, [self.spec.limit(r, ahead=1)
                                                                             for r in plan.decodes])
        except Exception as e:   # this step commits synchronously, and so do the ones after it
            log.warning("launching the verify step ahead failed (%s: %s); verify steps run synchronously from "
                        "now on", type(e).__name__, e)
            self._spec_ahead = False
            return None
        if nxt is not None:
            self.count_step(nxt.plan)
            self.counters["launched_ahead"] += 1
        return nxt

    def _schedule_and_forward(self) -> tuple[StepPlan, StepOutput] | None:
        """Schedule a step and launch it; None when nothing could run."""
        guided = self._num_guided > 0
        if guided:
            self.grammars.attach_ready(self.scheduler.compiling, self.fault)
        self.spec.draft([r for r in self.scheduler.running if r.status is Status.RUNNING and r.decoding], self.fault)
        plan = self.scheduler.schedule()
        self.counters["preemptions"] += len(plan.preempted)
        for req in plan.preempted:
            self.spec.release(req)                     # it recomputes from its prompt: so does the drafter
        self.session.copy_kda(self.cache.copies)      # checkpoint saves/restores, before the forward
        self.cache.copies.clear()
        if guided:          # drafts cut at the first refused token; a fault takes its request out
            self.grammars.cut_drafts(plan.decodes, self.fault)
            self.scheduler.refit(plan)
        if plan.empty:
            pending = [r.guide_future for r in self.scheduler.compiling]
            if pending:                      # nothing to run until a grammar is compiled
                concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
            elif self.scheduler.has_work:    # cannot happen while the pool holds one max_model_len request
                raise RuntimeError(f"the scheduler made no progress ({len(self.scheduler.running)} running, "
                                   f"{len(self.scheduler.waiting)} waiting, cache {self.cache.usage()})")
            return None
        try:
            out = self.forward(plan)
        except Exception as e:
            for req in [*plan.decodes, *(c.req for c in plan.prefills)]:
                self.finish(req, FinishReason.ERROR, error=f"engine step failed: {type(e).__name__}: {e}")
            raise
        if guided:          # masks filled while the forward runs (CUDA: launched, not done)
            guided_rows = self.grammars.fill(out.rows, self.fault)
            if guided_rows:
                self.grammars.apply(out.logits, guided_rows)
        return plan, out

    def forward(self, plan: StepPlan) -> StepOutput:
        """Run the step (the vision encoder first, on the plan's images); prefill chunks that do not
        complete their prompt are committed here."""
        encode(self.session, plan.encodes)
        out = run_plan(self.session, plan, block_size=self.cache.block_size, keep_hidden=self.spec.needs_hidden)
        self.count_step(plan)
        for c, hidden in zip(plan.prefills, out.chunk_hidden):
            self.spec.on_prefill(c.req, c.start, hidden, self.fault)
            release_passed(c.req, c.start + c.num_tokens)
            if not c.completes and not c.req.finished:     # a completing chunk moves at its commit
                c.req.num_computed += c.num_tokens
                self.cache.commit(c.req)
        return out

    def count_step(self, plan: StepPlan) -> None:
        """One step run (here or launched ahead), in the counters."""
        self.counters["steps"] += 1
        for kind, cap in (("verify", plan.verify_capacity), ("prefill", plan.prefill_capacity)):
            if cap is not None:
                self.counters["capacity_hits"][kind][cap] += 1

    # ---------------------------------------------------------------------------- accept + commit
    def commit(self, rows: list[Rows], logits: torch.Tensor, chosen: list[int] | None = None, *,
               rolled_back: bool = False) -> None:
        """Acceptance for every request of the step, then each one's commit (`chosen`: every row's
        token, already chosen on the device); the KDA states of requests that kept fewer rows than
        they verified roll back in one call (`rolled_back`: the device did it already)."""
        verdicts = decide([r for r in rows if not r.req.finished], logits, self.fault, chosen)
        slots, positions = [], []
        for r in rows:
            req = r.req
            if req.finished or id(req) not in verdicts:
                continue
            self._touched[req.request_id] = req
            try:
                kept = self._commit_one(req, verdicts[id(req)], r.hidden)
            except Exception as e:
                self.fault(req, f"output processing failed: {type(e).__name__}: {e}")
                continue
            if kept is not None and kept - 1 < len(req.drafts) and not rolled_back:
                slots.append(req.kda_slot)
                positions.append(kept - 1)     # the KDA state after the last kept row
            req.set_drafts([])
        if slots:
            self.session.rollback_kda(slots, positions)

    def _commit_one(self, req: Request, v: Verdict, hidden: torch.Tensor | None) -> int | None:
        """Commit one request's emitted block; returns how many tokens it kept (None: it ended)."""
        base = len(req.token_ids)
        self.spec.record(req, v)
        n, end = req.block_end(v.tokens, self.eos_ids, self.max_model_len)
        block = v.tokens[:n]
        if req.guided is not None:
            kept = req.guided.commit(block)       # GrammarError: a token its mask refused
            if kept < n:                          # the grammar ended (accepted eos) inside the block
                block, end = block[:kept], None
        if not block:
            raise RuntimeError("no token to commit")
        last = len(block) - 1
        for i, t in enumerate(block):
            self.counters["generated_tokens"] += 1
            done = req.append_token(t, v.logprobs[i] if v.logprobs else None, end if i == last else None)
            if done:
                self.finish(req, *done)
                return None
        if req.guided is not None and req.guided.is_terminated:    # ignore_eos: the grammar still ended it
            self.finish(req, FinishReason.STOP, block[-1])
            return None
        # cached now: every row but the last kept token's (the verify rows of the token before the
        # block and of the accepted drafts); rows past them belong to rejected drafts
        req.num_computed = base - 1 + len(block)
        # a step launched ahead writes this request's next rows: their blocks stay
        self.cache.commit(req, reserve=self.lookahead.reserve(req))
        self.spec.committed(req, base - 1, block, hidden, self.fault)
        return None if req.finished else len(block)

    def emit(self) -> list[RequestOutput]:
        outs = []
        for req in self._touched.values():
            hold = max(map(len, req.params.stop), default=1) - 1    # a stop string's possible prefix
            outs.append(req.snapshot(hold))
        self._touched.clear()
        return outs

    # ---------------------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {**{k: v for k, v in c.items() if k != "capacity_hits"},
                "capacity_hits": {k: dict(sorted(v.items())) for k, v in c["capacity_hits"].items()},
                "graphs": dict(getattr(self.session, "graph_stats", {})),
                "cache": self.cache.usage(), "speculative": self.spec.to_dict()}

    def close(self) -> None:
        """Stop the grammar compile threads."""
        self.grammars.close()
