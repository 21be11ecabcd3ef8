"""spec_speedup.py's engines: one at a time on the device, each cache sized from need, and the
runtime's MTP drafter with the options the runtime offers.

An engine's cache holds every live request at --max-seq-len and its KDA states for the K + 1
positions a verify step saves; sized from that need, never from free memory (which the cached
blocks of an engine just closed would distort). A batch whose cache would pass --kv-cache-mb is
skipped at that K, as a row saying why. ``engine`` yields the LLM to a function that returns after
the block; the next ``engine`` (and the run's end, ``settle``) checks the last one is gone and
its memory back with the driver, else the record's errors say so.
"""

from __future__ import annotations

import gc
import inspect
import logging
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.runtime.kv_cache import CachePlan, plan_cache
from k3trt.runtime.llm import LLM
from k3trt.runtime.speculative.mtp import MTPDrafter

if TYPE_CHECKING:
    from spec_speedup import Run

log = logging.getLogger("spec_speedup")
BLOCK = 64


def build_config(a) -> BuildConfig:
    return BuildConfig(dtype=a.dtype, block_size=BLOCK, max_num_tokens=a.max_num_tokens, max_seq_len=a.max_seq_len)


def cache_plan(cfg, a, k: int, batches: list[int]) -> CachePlan:
    """The cache an engine for `batches` at K = k allocates, sized from need (every live request at
    max_seq_len, its KDA slots with the K + 1 states a verify saves), never from free memory,
    which a previous engine's cached blocks would distort."""
    b = build_config(a)
    return plan_cache(cfg, budget_bytes=1 << 62, block_size=BLOCK, max_live=max(batches), max_model_len=a.max_seq_len,
                      kv_dtype=b.kv_torch_dtype, state_dtype=b.torch_dtype, max_q=k + 1 if k else 0,
                      num_blocks=max(batches) * -(-a.max_seq_len // BLOCK))


def fitting_batches(run: "Run", cfg, k: int, batches: list[int]) -> list[int]:
    """Those of `batches` whose cache fits --kv-cache-mb at this K; those left out are rows saying why."""
    a, fit = run.args, sorted(batches)
    while fit and cache_plan(cfg, a, k, fit).total_bytes > a.kv_cache_mb << 20:
        b = fit.pop()
        need = cache_plan(cfg, a, k, fit + [b]).total_bytes / 2**30
        run.skip(f"K{k} b{b}", f"its cache (KDA states for K+1 positions) needs {need:.1f} GiB, over --kv-cache-mb "
                 f"{a.kv_cache_mb} MiB at {cfg.num_hidden_layers} layers", kind="spec" if k else "plain",
                 spec_tokens=k, batch=b, layers=cfg.num_hidden_layers)
    return fit


@contextmanager
def engine(run: "Run", model, k: int, batches: list[int], drafter=None):
    """An engine for `batches` at K = k with an exactly sized cache, closed on exit. Hold it only in
    the frame of a function that returns after the block: the next engine checks it is gone."""
    a = run.args
    settle(run)
    caps = Capacities.plan(max_batch=max(batches), max_num_tokens=a.max_num_tokens, spec_tokens=k, verify=batches)
    plan = cache_plan(model.cfg, a, k, batches)
    llm = LLM.from_model(model, build=build_config(a), capacities=caps, prefix_caching=False, spec_tokens=k or None,
                         drafter=drafter, cuda_graphs=True, adaptive_k=False, kv_cache_memory=plan.total_bytes,
                         num_blocks=plan.num_blocks)
    run.last_engine = weakref.ref(llm)
    try:
        yield llm
    finally:
        llm.close()


def settle(run: "Run") -> None:
    """The last engine gone and its memory back to the driver, or the record says it was not."""
    gc.collect()
    if run.last_engine is not None and run.last_engine() is not None:
        run.doc["errors"].append("an engine outlived its run: its memory stays held (a reference leaked)")
    run.last_engine = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated() - run.base_bytes
        if held > 1 << 30:
            run.doc["errors"].append(f"{held / 2**30:.1f} GiB still allocated after an engine closed")


def mtp_drafter(run: "Run", model, llm: LLM, k: int, max_live: int) -> MTPDrafter:
    """The runtime's MTP drafter on the target's MTP layer, with the reduced draft vocabulary and
    CUDA graphs the runtime offers; options this runtime's MTPDrafter lacks are noted in the record."""
    a, takes, kw = run.args, inspect.signature(MTPDrafter).parameters, {}
    wanted = {"graphs": a.mtp_graphs if a.mtp_graphs is not None else a.device.startswith("cuda"),
              "draft_vocab": a.mtp_draft_vocab}
    if "graphs" in takes:
        kw["graphs"] = a.mtp_graphs
    if a.mtp_draft_vocab and "draft_vocab" in takes:   # random weights: any n ids cost the same
        kw["draft_vocab"] = torch.arange(a.mtp_draft_vocab, dtype=torch.int64)
    for opt in (o for o, want in wanted.items() if want and o not in takes):
        note = f"this runtime's MTPDrafter takes no {opt}: MTP drafts run without it"
        if note not in run.doc["notes"]:
            log.warning(note)
            run.doc["notes"].append(note)
    return MTPDrafter(model, model.cfg, k_max=k, max_live=max_live, max_model_len=llm.max_model_len,
                      block_size=llm.cache.block_size, **kw)
