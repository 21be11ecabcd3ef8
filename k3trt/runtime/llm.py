"""``LLM``: the Python API and the runtime loop (schedule → forward → sample → commit → emit).

    llm = LLM("engine_dir", device="cpu")                      # options: EngineOptions
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=16))
    for delta in llm.stream("Hello", SamplingParams(temperature=0.7, seed=1)): print(delta.delta_text)

Raw prompt strings are encoded with special-token strings recognised (as Hugging Face does); use
k3trt.runtime.chat.render_ids for chat messages with untrusted text. ``run`` is what
``k3trt run --json`` prints. Requests submitted with ``add_request`` are driven by ``step()``; do
not mix them with a ``generate``/``stream`` call in flight (those keep only their own outputs).
"""

from __future__ import annotations

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

from k3trt.builder.engine_dir import read_engine_dir
from k3trt.runtime import sampling
from k3trt.runtime.engine import Seq, TorchSession, make_batch
from k3trt.runtime.kv_cache import CacheManager, plan_cache
from k3trt.runtime.params import RequestError, SamplingParams
from k3trt.runtime.request import FinishReason, Request, RequestOutput, Status, new_request
from k3trt.runtime.scheduler import Scheduler, SchedulerConfig, StepPlan

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
        opts = self.options = EngineOptions.from_kwargs(options)
        self.engine_dir = ed = read_engine_dir(engine_dir, backend="torch", verify_checksums=opts.verify_checksums)
        b, cfg, device = ed.build, ed.model, torch.device(device)
        hybrid = bool(cfg.kda_layers)
        verify = _upto(ed.capacities.verify, opts.max_batch, "max_batch")
        max_num_tokens = min(opts.max_num_tokens or b.max_num_tokens, b.max_num_tokens)
        self.max_model_len = min(opts.max_model_len or b.max_seq_len, b.max_seq_len)
        self.config = SchedulerConfig(
            max_num_tokens=max_num_tokens, verify_capacities=verify,
            prefill_capacities=_upto(ed.capacities.prefill, max_num_tokens, "max_num_tokens"),
            max_model_len=self.max_model_len, prefix_caching=opts.prefix_caching, hybrid=hybrid)
        _, model = load_model(ed.rank_dir, dtype=b.torch_dtype, device=device)
        checkpoints = (verify[-1] if opts.kda_checkpoints is None else opts.kda_checkpoints) \
            if hybrid and opts.prefix_caching else 0
        budget = opts.kv_cache_memory or (int(torch.cuda.mem_get_info(device)[0] * GPU_CACHE_FRACTION)
                                          if device.type == "cuda" else CPU_CACHE_BYTES)
        plan = plan_cache(cfg, budget_bytes=budget, block_size=opts.block_size or b.block_size,
                          max_live=verify[-1], max_model_len=self.max_model_len, kv_dtype=b.kv_torch_dtype,
                          state_dtype=b.torch_dtype, num_blocks=opts.num_blocks, num_checkpoints=checkpoints)
        self.session = TorchSession(model, cfg, plan, device=device, dtype=b.torch_dtype,
                                    kv_dtype=b.kv_torch_dtype, kv_scale=b.kv_scale)
        self.cache = CacheManager(plan, hybrid=hybrid, prefix_caching=opts.prefix_caching)
        self.scheduler = Scheduler(self.config, self.cache)
        self.tokenizer, self.eos_ids = _load_tokenizer(ed.tokenizer_dir)
        self.vocab_size = cfg.vocab_size
        self._requests: dict[str, Request] = {}
        self._touched: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(opts.seed)
        self.counters: dict[str, Any] = {"steps": 0, "preemptions": 0, "generated_tokens": 0,
                                         "capacity_hits": {"verify": Counter(), "prefill": Counter()}}
        log.info("engine ready in %.1fs: %s on %s, verify capacities %s, prefill capacities %s, max_model_len %d",
                 time.perf_counter() - t0, ed.path, device, list(verify), list(self.config.prefill_capacities),
                 self.max_model_len)

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
            seed = req.params.seed if req.params.seed is not None else self._seeds.getrandbits(63)
            req.generator = sampling.make_generator(seed, self.session.device)
        if self.tokenizer is not None:
            from k3trt.runtime.tokenizer import IncrementalDetokenizer
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special=True)
        return req

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
        req.generator = req.detokenizer = None
        req.drafts = []
        self._requests.pop(req.request_id, None)
        self._touched[req.request_id] = req
        if error:
            log.warning("request %s failed: %s", req.request_id, error)

    # ---------------------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns a snapshot (with deltas) of every request that changed."""
        plan = self.scheduler.schedule()
        self.counters["preemptions"] += len(plan.preempted)
        self.session.copy_kda(self.cache.copies)      # checkpoint saves/restores, before the forward
        self.cache.copies.clear()
        if plan.empty:
            if self.scheduler.has_work:      # cannot happen while the pool holds one max_model_len request
                raise RuntimeError(f"the scheduler made no progress ({len(self.scheduler.running)} running, "
                                   f"{len(self.scheduler.waiting)} waiting, cache {self.cache.usage()})")
            return self._emit()
        try:
            wants = self._forward(plan)
        except Exception as e:
            for req in [*plan.decodes, *(c.req for c in plan.prefills)]:
                self._finish(req, FinishReason.ERROR, error=f"engine step failed: {type(e).__name__}: {e}")
            raise
        self._sample_and_commit(wants)
        return self._emit()

    def _forward(self, plan: StepPlan) -> list[tuple[Request, torch.Tensor]]:
        """Run the verify and prefill passes; the logits rows each sampling request needs."""
        bs, wants, hits = self.cache.block_size, [], self.counters["capacity_hits"]
        self.counters["steps"] += 1
        if plan.decodes:
            seqs = [Seq(r.token_ids[r.num_computed:] + r.drafts, r.num_computed, r.blocks, r.kda_slot,
                        1 + len(r.drafts)) for r in plan.decodes]
            logits = self.session.verify(make_batch(seqs, bs, capacity=plan.verify_capacity,
                                                    save_kda_states=any(r.drafts for r in plan.decodes)))
            hits["verify"][plan.verify_capacity] += 1
            rows = itertools.accumulate([s.num_logits for s in seqs], initial=0)
            wants += [(r, logits[a:a + s.num_logits]) for r, s, a in zip(plan.decodes, seqs, rows)]
        if plan.prefills:
            seqs = [Seq(c.req.token_ids[c.start:c.start + c.num_tokens], c.start, c.req.blocks, c.req.kda_slot,
                        int(c.completes)) for c in plan.prefills]
            logits = self.session.prefill(make_batch(seqs, bs, capacity=plan.prefill_capacity))
            hits["prefill"][plan.prefill_capacity] += 1
            done = [c.req for c in plan.prefills if c.completes]
            for c in plan.prefills:
                c.req.num_computed += c.num_tokens
                if not c.completes:
                    self.cache.commit(c.req)
            wants += [(r, logits[i:i + 1]) for i, r in enumerate(done)]
        return wants

    def _sample_and_commit(self, wants: list[tuple[Request, torch.Tensor]]) -> None:
        tokens: dict[int, tuple[list[int], list | None]] = {}
        plain = [(r, x) for r, x in wants if r.params.plain and not r.drafts]
        if plain:
            for (r, _), t in zip(plain, sampling.greedy(torch.cat([x for _, x in plain]))):
                tokens[id(r)] = ([t], None)
        for req, x in wants:
            if id(req) in tokens:
                continue
            try:       # a fault here (e.g. in the request's logits processor) ends this request only
                tokens[id(req)] = sampling.sample(x, req.params, req.token_ids, req.num_prompt, req.generator)
            except Exception as e:
                self._finish(req, FinishReason.ERROR, error=f"sampling failed: {type(e).__name__}: {e}")
        for req, _ in wants:
            if req.finished:
                continue
            new, lps = tokens[id(req)]
            # without drafts one row gives one token; issue 5's acceptance turns K+1 rows into 1..K+1
            req.num_computed = len(req.token_ids)
            self.cache.commit(req)
            self._touched[req.request_id] = req
            try:
                for i, t in enumerate(new[:1]):
                    self.counters["generated_tokens"] += 1
                    end = req.append_token(t, lps[i] if lps else None, self.eos_ids, self.max_model_len)
                    if end:
                        self._finish(req, *end)
                        break
            except Exception as e:
                self._finish(req, FinishReason.ERROR, error=f"output processing failed: {type(e).__name__}: {e}")

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
        c = self.counters
        return {**{k: v for k, v in c.items() if k != "capacity_hits"},
                "capacity_hits": {k: dict(sorted(v.items())) for k, v in c["capacity_hits"].items()},
                "cache": self.cache.usage()}


def run(engine_dir: str | Path, prompt: str, *, chat: bool = False, max_tokens: int = 64,
        temperature: float = 0.0, seed: int | None = None, device: str = "cpu", speculative: str = "none",
        **options: Any) -> dict[str, Any]:
    """One prompt through a fresh engine: what `k3trt run ... --json` prints (its `text` is what the
    plain `k3trt run` prints). `chat` wraps the prompt as one user message (K3 chat template)."""
    if speculative != "none":
        raise NotImplementedError(f"--speculative {speculative}: speculative decoding is not wired in yet "
                                  "(issue 5); use --speculative none")
    llm = LLM(engine_dir, device=device, **options)
    if chat:
        from k3trt.runtime.chat import render_ids
        if llm.tokenizer is None:
            raise ValueError("--chat needs the engine's tokenizer; this engine dir has none")
        prompt = render_ids(llm.tokenizer, [{"role": "user", "content": prompt}])
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed))[0]
    engine = llm.stats()
    return {"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason, "error": out.error,
            "stats": {**out.stats, "capacity_hits": engine["capacity_hits"], "steps": engine["steps"],
                      "device": str(llm.session.device), "backend": llm.engine_dir.backend}}


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
