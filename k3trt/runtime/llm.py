"""``LLM``: the Python API and the runtime loop (schedule → forward → sample → commit → emit).

    llm = LLM("engine_dir", device="cpu")                      # options: EngineOptions
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=16))
    for delta in llm.stream("Hello", SamplingParams(temperature=0.7, seed=1)): print(delta.delta_text)

    llm = LLM("engine_dir", speculative="ngram", spec_tokens=3)   # or "draft:CKPT_DIR", "mtp"
    llm.generate("Reply in JSON:", SamplingParams(guided={"json_schema": schema}, max_tokens=64))

Raw prompt strings are encoded with special-token strings recognised (as Hugging Face does); use
k3trt.runtime.chat.render_ids for chat messages with untrusted text. Speculative decoding and
structured output are wired per step in spec_step.py and structured/runtime.py. ``run`` is what
``k3trt run --json`` prints. Requests submitted with ``add_request`` are driven by ``step()``; do
not mix them with a ``generate``/``stream`` call in flight (those keep only their own outputs).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch

from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.engine.engine_dir import read_engine_dir
from k3trt.runtime import lookahead, sampling
from k3trt.runtime.engine import TorchSession
from k3trt.runtime.graphs import GraphSession, graphs_by_default
from k3trt.runtime.kv_cache import CacheManager, plan_cache
from k3trt.runtime.params import RequestError, SamplingParams
from k3trt.runtime.request import FinishReason, Request, RequestOutput, Status, new_request
from k3trt.runtime.scheduler import Scheduler, SchedulerConfig, StepPlan
from k3trt.runtime.spec_step import Speculator, Verdict, decide
from k3trt.runtime.step import Rows, StepOutput, run_plan
from k3trt.runtime.speculative import NoDrafter, make_drafter, spec_tokens_for, truncate_at_stop

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]
ParamsLike = Union[SamplingParams, dict, None]
CPU_CACHE_BYTES = 1 << 30
GPU_CACHE_FRACTION = 0.8      # of the memory free after loading; the rest is for activations


@dataclass(frozen=True)
class EngineOptions:
    """Run-time choices within what the engine dir was built for (None: the build's value)."""
    max_batch: int | None = None          # live requests; the verify capacities up to it are used
    max_num_tokens: int | None = None     # tokens per step
    max_model_len: int | None = None      # prompt + output per request
    block_size: int | None = None
    num_blocks: int | None = None         # overrides the memory planner
    kv_cache_memory: int | None = None    # bytes; None: 1 GiB on CPU, 80% of free GPU memory
    prefix_caching: bool = True
    kda_checkpoints: int | None = None    # KDA state checkpoints for prefix hits; None: max_batch
    verify_checksums: bool = True
    seed: int = 0                         # draws the seeds of requests that bring none
    speculative: str = "none"             # none | ngram | draft:CKPT_DIR | mtp
    spec_tokens: int | None = None        # K drafts per request (1..7); None: the build's, else 3
    cuda_graphs: bool | None = None       # decode/verify steps as CUDA graphs; None: on CUDA in bf16/fp16
                                          # (True off CUDA: the padded static steps, uncaptured)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> "EngineOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


class LLM:
    def __init__(self, engine_dir: str | Path, device: str | torch.device = "cpu", **options: Any):
        from k3trt.model.loader import load_model           # the one strict loader
        t0 = time.perf_counter()
        opts = EngineOptions.from_kwargs(options)
        self.engine_dir = ed = read_engine_dir(engine_dir, backend="torch", verify_checksums=opts.verify_checksums)
        _, model = load_model(ed.rank_dir, dtype=ed.build.torch_dtype, device=torch.device(device))
        self._setup(model, ed.build, ed.capacities, ed.tokenizer_dir, torch.device(device), opts)
        log.info("engine ready in %.1fs: %s", time.perf_counter() - t0, ed.path)

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, build: BuildConfig, capacities: Capacities,
                   tokenizer_dir: str | Path | None = None, **options: Any) -> "LLM":
        """An engine over a K3ForCausalLM already in memory, on its device and in build.dtype: for
        benchmarks at sizes no checkpoint on disk holds, and for tests. No engine dir (engine_dir is
        None); token-id prompts only unless tokenizer_dir is given."""
        self = cls.__new__(cls)
        self.engine_dir = None
        device = next(model.parameters()).device
        self._setup(model, build, capacities, Path(tokenizer_dir) if tokenizer_dir else None, device,
                    EngineOptions.from_kwargs(options))
        return self

    def _setup(self, model: torch.nn.Module, b: BuildConfig, caps: Capacities, tokenizer_dir: Path | None,
               device: torch.device, opts: EngineOptions) -> None:
        self.options, cfg = opts, model.cfg
        hybrid = bool(cfg.kda_layers)
        verify = _upto(caps.verify, opts.max_batch, "max_batch")
        max_num_tokens = min(opts.max_num_tokens or b.max_num_tokens, b.max_num_tokens)
        self.max_model_len = min(opts.max_model_len or b.max_seq_len, b.max_seq_len)
        k = spec_tokens_for(opts.speculative, opts.spec_tokens, built=caps.spec_tokens)
        try:
            self.config = SchedulerConfig(
                max_num_tokens=max_num_tokens, verify_capacities=verify,
                prefill_capacities=_upto(caps.prefill, max_num_tokens, "max_num_tokens"),
                max_model_len=self.max_model_len, prefix_caching=opts.prefix_caching, hybrid=hybrid, spec_tokens=k)
        except ValueError as e:
            raise ValueError(f"{e}: lower spec_tokens or max_batch, or raise max_num_tokens") from None
        checkpoints = (verify[-1] if opts.kda_checkpoints is None else opts.kda_checkpoints) \
            if hybrid and opts.prefix_caching else 0
        budget = opts.kv_cache_memory or (int(torch.cuda.mem_get_info(device)[0] * GPU_CACHE_FRACTION)
                                          if device.type == "cuda" else CPU_CACHE_BYTES)
        plan = plan_cache(cfg, budget_bytes=budget, block_size=opts.block_size or b.block_size,
                          max_live=verify[-1], max_model_len=self.max_model_len, kv_dtype=b.kv_torch_dtype,
                          state_dtype=b.torch_dtype, num_blocks=opts.num_blocks, num_checkpoints=checkpoints,
                          max_q=k + 1 if k else 0)
        kw = dict(device=device, dtype=b.torch_dtype, kv_dtype=b.kv_torch_dtype, kv_scale=b.kv_scale,
                  max_q=k + 1 if k else 0)
        graphs = opts.cuda_graphs if opts.cuda_graphs is not None else graphs_by_default(device, b.torch_dtype)
        if graphs and device.type != "cuda":     # the tests check the padded static steps this way
            log.warning("cuda_graphs on %s: static padded steps without capture", device)
        if graphs:
            self.session = GraphSession(model, cfg, plan, capacities=verify, q_values=(1, k + 1) if k else (1,),
                                        max_blocks=-(-self.max_model_len // plan.block_size), **kw)
        else:
            self.session = TorchSession(model, cfg, plan, **kw)
        drafter = make_drafter(opts.speculative, k=k, max_live=verify[-1], max_model_len=self.max_model_len,
                               target=model, dtype=b.torch_dtype, device=device, block_size=plan.block_size,
                               sample_drafts=True, graphs=graphs) if k else NoDrafter()
        self.spec = Speculator(drafter, k, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len)
        self.cache = CacheManager(plan, hybrid=hybrid, prefix_caching=opts.prefix_caching)
        self.scheduler = Scheduler(self.config, self.cache)
        self.tokenizer, self.eos_ids = _load_tokenizer(tokenizer_dir)
        self.vocab_size = cfg.vocab_size
        self._grammars = None       # structured.runtime.Grammars, made by the first guided request
        self._ahead: lookahead.Launched | None = None    # a step launched before its inputs' commit
        self._requests: dict[str, Request] = {}
        self._touched: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(opts.seed)
        self.counters: dict[str, Any] = {"steps": 0, "preemptions": 0, "generated_tokens": 0, "launched_ahead": 0,
                                         "capacity_hits": {"verify": Counter(), "prefill": Counter()}}
        log.info("runtime on %s: verify capacities %s, prefill capacities %s, max_model_len %d, speculative %s "
                 "(K=%d), CUDA graphs %s", device, list(verify), list(self.config.prefill_capacities),
                 self.max_model_len, opts.speculative, k, "on" if graphs else "off")

    # ---------------------------------------------------------------------------- requests
    def add_request(self, prompt: Prompt, params: ParamsLike = None, request_id: str | None = None) -> str:
        req = self._make_request(prompt, params, 0, request_id)
        self._submit(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._finish(req, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def _make_request(self, prompt: Prompt, params: ParamsLike, index: int, request_id: str | None) -> Request:
        req = new_request(prompt, params, index=index, request_id=request_id or f"req-{next(self._ids)}",
                          tokenizer=self.tokenizer, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        if not req.params.greedy:
            req.seed = req.params.seed if req.params.seed is not None else self._seeds.getrandbits(63)
            req.generator = sampling.make_generator(req.seed, self.session.device)
        if self.tokenizer is not None:
            from k3trt.runtime.tokenizer import IncrementalDetokenizer
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special=True)
        if req.params.guided is not None:     # compiles off the step loop; the request waits for it
            req.guide_future = self._grammar_runtime().submit(req.params.guided)
        return req

    def _grammar_runtime(self):
        if self._grammars is None:
            from k3trt.runtime.structured.runtime import Grammars
            self._grammars = Grammars(self.tokenizer, self.vocab_size,
                                      rows=self.config.max_batch * (1 + self.spec.k))
        return self._grammars

    def _submit(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise RequestError("request_id", f"{req.request_id!r} is already in flight")
        self._requests[req.request_id] = req
        self.scheduler.add(req)

    def _finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None,
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
        self._requests.pop(req.request_id, None)
        self._touched[req.request_id] = req
        if error:
            log.warning("request %s failed: %s", req.request_id, error)

    def _fault(self, req: Request, error: str) -> None:
        """A fault confined to one request (its drafter, grammar or processors): it ends, alone."""
        self._finish(req, FinishReason.ERROR, error=error)

    def close(self) -> None:
        """Stop the grammar compile threads (the engine itself needs no closing)."""
        if self._grammars is not None:
            self._grammars.close()

    # ---------------------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns a snapshot (with deltas) of every request that changed."""
        if self._ahead is not None:      # launched by the previous call, ahead of its tokens
            plan, out, self._ahead = self._ahead.plan, self._ahead.out, None
        else:
            scheduled = self._schedule_and_forward()
            if isinstance(scheduled, list):
                return scheduled
            plan, out = scheduled
        argmax = None
        if lookahead.can_launch_ahead(self, plan):
            # the next step starts from this one's argmax on the device; this one's tokens are
            # read (and committed) while it runs
            argmax = lookahead.ArgmaxOnHost(out.logits)
            try:
                self._ahead = lookahead.launch_ahead(self, plan, argmax)
            except Exception as e:   # this step's tokens still commit; the next step is scheduled normally
                log.warning("launching the next step ahead failed (%s: %s); stepping synchronously",
                            type(e).__name__, e)
                self._ahead = None
        self._sample_and_commit(out.rows, out.logits, argmax.tolist() if argmax is not None else None)
        return self._emit()

    def _schedule_and_forward(self) -> tuple[StepPlan, StepOutput] | list[RequestOutput]:
        """Schedule a step and launch it; the outputs to return instead when nothing can run."""
        if self._grammars is not None:
            self._grammars.attach_ready(self.scheduler.compiling, self._fault)
        self.spec.draft([r for r in self.scheduler.running if r.status is Status.RUNNING and r.decoding],
                        self._fault)
        plan = self.scheduler.schedule()
        self.counters["preemptions"] += len(plan.preempted)
        for req in plan.preempted:
            self.spec.release(req)                     # it recomputes from its prompt: so does the drafter
        self.session.copy_kda(self.cache.copies)      # checkpoint saves/restores, before the forward
        self.cache.copies.clear()
        if self._grammars is not None:      # drafts cut at the first refused token; a fault takes its request out
            self._grammars.cut_drafts(plan.decodes, self._fault)
            self.scheduler.refit(plan)
        if plan.empty:
            pending = [r.guide_future for r in self.scheduler.compiling]
            if pending:                      # nothing to run until a grammar is compiled
                concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
            elif self.scheduler.has_work:    # cannot happen while the pool holds one max_model_len request
                raise RuntimeError(f"the scheduler made no progress ({len(self.scheduler.running)} running, "
                                   f"{len(self.scheduler.waiting)} waiting, cache {self.cache.usage()})")
            return self._emit()
        try:
            out = self._forward(plan)
        except Exception as e:
            for req in [*plan.decodes, *(c.req for c in plan.prefills)]:
                self._finish(req, FinishReason.ERROR, error=f"engine step failed: {type(e).__name__}: {e}")
            raise
        if self._grammars is not None:      # masks filled while the forward runs (CUDA: launched, not done)
            guided_rows = self._grammars.fill(out.rows, self._fault)
            if guided_rows:
                self._grammars.apply(out.logits, guided_rows)
        return plan, out

    def _forward(self, plan: StepPlan) -> StepOutput:
        """Run the step; prefill chunks that do not complete their prompt are committed here."""
        out = run_plan(self.session, plan, block_size=self.cache.block_size, keep_hidden=self.spec.needs_hidden)
        self.count_step(plan)
        for c, hidden in zip(plan.prefills, out.chunk_hidden):
            self.spec.on_prefill(c.req, c.start, hidden, self._fault)
            if not c.completes and not c.req.finished:     # a completing chunk moves at its commit
                c.req.num_computed += c.num_tokens
                self.cache.commit(c.req)
        return out

    def count_step(self, plan: StepPlan) -> None:
        """One step run (here or launched ahead, runtime/lookahead.py), in the counters."""
        self.counters["steps"] += 1
        for kind, cap in (("verify", plan.verify_capacity), ("prefill", plan.prefill_capacity)):
            if cap is not None:
                self.counters["capacity_hits"][kind][cap] += 1

    def _sample_and_commit(self, rows: list[Rows], logits: torch.Tensor, argmax: list[int] | None = None) -> None:
        verdicts = decide([r for r in rows if not r.req.finished], logits, self._fault, argmax)
        slots, positions = [], []
        for r in rows:
            req = r.req
            if req.finished or id(req) not in verdicts:
                continue
            self._touched[req.request_id] = req
            try:
                kept = self._commit(req, verdicts[id(req)], r.hidden)
            except Exception as e:
                self._fault(req, f"output processing failed: {type(e).__name__}: {e}")
                continue
            if kept is not None and kept - 1 < len(req.drafts):
                slots.append(req.kda_slot)
                positions.append(kept - 1)     # the KDA state after the last kept row
            req.set_drafts([])
        if slots:
            self.session.rollback_kda(slots, positions)

    def _commit(self, req: Request, v: Verdict, hidden: torch.Tensor | None) -> int | None:
        """Commit one request's emitted block; returns how many tokens it kept (None: it ended)."""
        p, base = req.params, len(req.token_ids)
        self.spec.record(req, v)
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        block, _ = truncate_at_stop(v.tokens, stops, p.max_tokens - req.num_output)
        if req.guided is not None:
            block = block[:req.guided.commit(block)]   # GrammarError: a token its mask refused
        if not block:
            raise RuntimeError("no token to commit")
        for i, t in enumerate(block):
            self.counters["generated_tokens"] += 1
            end = req.append_token(t, v.logprobs[i] if v.logprobs else None, self.eos_ids, self.max_model_len)
            if end:
                self._finish(req, *end)
                return None
        if req.guided is not None and req.guided.is_terminated:    # ignore_eos: the grammar still ended it
            self._finish(req, FinishReason.STOP, block[-1])
            return None
        # cached now: every row but the last kept token's (the verify rows of the token before the
        # block and of the accepted drafts); rows past them belong to rejected drafts
        req.num_computed = base - 1 + len(block)
        # a step launched ahead writes this request's next position: its block stays
        self.cache.commit(req, reserve=1 if self._ahead is not None and self._ahead.holds(req) else 0)
        self.spec.committed(req, base - 1, block, hidden, self._fault)
        return None if req.finished else len(block)

    def _emit(self) -> list[RequestOutput]:
        outs = []
        for req in self._touched.values():
            hold = max(map(len, req.params.stop), default=1) - 1
            outs.append(req.snapshot(hold))
        self._touched.clear()
        return outs

    # ---------------------------------------------------------------------------- batch API
    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: ParamsLike | Sequence[ParamsLike] = None) -> Iterator[RequestOutput]:
        """Yield a snapshot with deltas whenever one of these requests changes; the last one of each
        has finished=True. Closing the iterator early cancels what is left."""
        reqs = self._make_requests(prompts, sampling_params)
        for r in reqs:
            self._submit(r)
        pending = {r.request_id for r in reqs}
        try:
            while pending:
                for out in self.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in list(pending):
                self.abort(rid)
                self._touched.pop(rid, None)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: ParamsLike | Sequence[ParamsLike] = None) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in prompt order."""
        done = {o.index: o for o in self.stream(prompts, sampling_params) if o.finished}
        return [done[i] for i in sorted(done)]

    def _make_requests(self, prompts, sampling_params) -> list[Request]:
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise RequestError("sampling_params", f"{len(sampling_params)} given for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if not prompts:
            raise RequestError("prompt", "no prompts given")
        return [self._make_request(p, sp, i, None) for i, (p, sp) in enumerate(zip(prompts, params))]

    def stats(self) -> dict[str, Any]:
        """Engine counters: steps, preemptions, generated tokens, capacity hits, cache usage, and
        speculative decoding (method, K, verify steps with drafts, drafted / accepted tokens,
        acceptance rate, mean accepted length, accepted-length histogram)."""
        c = self.counters
        return {**{k: v for k, v in c.items() if k != "capacity_hits"},
                "capacity_hits": {k: dict(sorted(v.items())) for k, v in c["capacity_hits"].items()},
                "graphs": dict(getattr(self.session, "graph_stats", {})),
                "cache": self.cache.usage(), "speculative": self.spec.to_dict()}


def run(engine_dir: str | Path, prompt: str, **kwargs: Any) -> dict[str, Any]:
    """One prompt through a fresh engine: what `k3trt run ... --json` prints (oneshot.run has the
    keyword arguments: chat, max_tokens, temperature, seed, device, speculative, json_schema, regex,
    grammar, and engine options)."""
    from k3trt.runtime.oneshot import run as run_once
    return run_once(engine_dir, prompt, **kwargs)


def _upto(caps: tuple[int, ...], limit: int | None, name: str) -> tuple[int, ...]:
    out = tuple(c for c in caps if limit is None or c <= limit)
    if not out:
        raise ValueError(f"engine option {name}={limit} is below the smallest built capacity {caps[0]}")
    return out


def _load_tokenizer(tok_dir: Path | None):
    """The tokenizer and the EOS ids (the tokenizer's and generation_config.json's), if present."""
    if tok_dir is None or not any(tok_dir.glob("tokenizer*")):
        log.warning("engine dir has no tokenizer: token-id prompts only, no text or stop strings")
        return None, frozenset()
    from k3trt.runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(tok_dir)
    eos = {tok.eos_token_id} - {None}
    gen = tok_dir / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        eos |= set(e if isinstance(e, list) else [e]) - {None}
    return tok, frozenset(eos)
