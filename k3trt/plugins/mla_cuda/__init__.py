"""SM90 CUDA kernels for K3's MLA verification (issue 11), JIT-built at first use.

    from k3trt.plugins.mla_cuda import mla_verify_cuda
    out, lse = mla_verify_cuda(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale,
                               kv_scale=1.0, d_v=512, num_splits=None)

Same semantics as ``mla_verify_ref`` (k3trt/plugins/mla_verify.py) without DCP or the sparse
policy, for the case the kernels are built for: q bf16 [B·Q, H, 576], d_v = 512, a contiguous
paged cache [pages, 64, 576] in bf16 or float8_e4m3fn (value = fp8 · kv_scale), int32 block table
and lengths. Any head count works (the Q·H folded rows are cut into 64-row tiles, one CTA each per
split). ``num_splits`` None picks the split-K count that fills the GPU's SMs (plans.choose_splits,
one CTA per SM); splits > 1 write 16-bit partials to scratch ([rows, splits, 512], each split's O
normalised by its own sum, with an fp32 LSE; half the bytes of mla_triton's fp32, one more
rounding: bf16 for a bf16 cache, fp16 in the cache's units for an fp8 one) and a merge kernel
combines them by LSE. A request shorter than splits · full_split_blocks pages
spreads over fewer splits: at most ``max_spread`` (None: as many as keep the grid in one wave of
CTAs), with at least min_split_blocks pages each (the rule and why: MIN_SPLIT_BLOCKS). The grid
stays as planned, so a captured graph replays at any length. A request on one split needs no merge:
its CTA writes the bf16 output and the merge skips its rows (at 48 and 96 heads, batch 32, 1K the
fp32 partials and the merge had cost 13%). The merge reads only the splits used: in plans of at
most 8 splits a warp per row issues all its loads at once; in larger plans a row spread over at most
8 splits does the same with 128 threads, and rows spread wider use a group of 128 threads per 8
splits (up to 1024 threads). The merge is a programmatic dependent launch: its CTAs start while the
verify kernel's last ones run, and those with nothing to merge exit without waiting for it.

Two schedules of the same CTA (64 rows × one split, two consumer warpgroups, each owning 256 of
the 512 output columns; TMA streams the pages through a two-stage ring of 72 KB blocks with one
mbarrier per 8 KB chunk, and each warpgroup reloads the chunks it was the last to read):
- ``pair`` (default; mla_verify_sm90_pair.cu): the warpgroups take the blocks two at a time, one
  each for Q·K^T (a whole 64x64 score tile) and softmax, so one's softmax overlaps the other's
  MMAs; P goes to the P·V wgmma from registers, and through shared memory to the other
  warpgroup. Its Q tile also comes by TMA (a second tensor map, over Q's [B·Q·H, 576] rows).
- ``shared`` (mla_verify_sm90.cu, the first version): both warpgroups on each block, 32 tokens of
  scores each; kept as the measured baseline.
In these two an fp8 cache lands as raw bytes and is expanded in place to fp16 before the same MMAs.
- ``swap`` (mla_verify_sm90_swap.cu; an fp8 cache): the tokens are the MMA's M dimension and the
  cache its A operand (e4m3 for the scores, converted in registers for P·V), so nothing is expanded
  through shared memory and no row is padding; two warpgroups compute the scores and P of alternate
  blocks, two multiply P into their halves of O (512 threads). A CTA takes at most 48 rows: a
  request's 12 heads x 4 query rows at TP 8, and at 48 / 96 heads (TP 2 / 1) one of 4 / 8 head
  groups, which read the same pages (swap_head_group). The default where pick_schedule says so
  (batch >= 32: it costs more per CTA and wins from a few blocks a CTA).

Build: torch.utils.cpp_extension.load with nvcc for sm_90a (``-gencode=arch=compute_90a,
code=sm_90a``: wgmma needs the "a" target). The build is cached by torch under
~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time

import torch

from ..plans import choose_splits, split_scratch

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
PAGE, D_QK, D_V = 64, 576, 512
# How a request spreads over the plan's splits (SplitRule in sm90_common.cuh): over all of them
# from FULL_SPLIT_BLOCKS pages per split; shorter, over at most as many as keep the grid in one wave
# of CTAs (wave_splits), with at least MIN_SPLIT_BLOCKS pages (one pair) each. Extra waves pay for
# themselves only on long requests: each extra CTA writes 64 KB of partials (128 KB when they were
# fp32 and these figures were taken) that the merge reads back, so at 48 heads, batch 32 and 1K
# context four splits took 75 us and one 51 us, and at batch 1 the request is spread as far as it
# goes (mla_cuda_h200.json runs 9-10).
MIN_SPLIT_BLOCKS, FULL_SPLIT_BLOCKS = 2, 16
_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("binding.cpp", "mla_verify_sm90.cu", "mla_verify_sm90_pair.cu", "mla_verify_sm90_swap.cu")
CUDA_FLAGS = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo",
              "-Xptxas=-v"]
_TIMEOUT_NAMES = {1: "KV chunk mbarrier wait timed out", 2: "Q tile mbarrier wait timed out",
                  3: "swap kernel: P^T ready mbarrier wait timed out",
                  4: "swap kernel: P^T free mbarrier wait timed out",
                  6: "swap kernel: running-max ready mbarrier wait timed out"}
# kernel schedules (mla_verify_sm90.h): "shared" = both warpgroups on each block (v4), "pair" = the
# warpgroups on alternate blocks (mla_verify_sm90_pair.cu), "swap" = tokens as the MMA's M, an fp8
# cache converted in registers (mla_verify_sm90_swap.cu: fp8, at most SWAP_MAX_ROWS rows a CTA)
SCHEDULES = {"shared": 0, "pair": 1, "swap": 2}
DEFAULT_SCHEDULE = "pair"
SWAP_MAX_ROWS = 48
# The swap kernel has the faster loop but a dearer CTA (batch 1, 1K: 16.1 us against the pair
# kernel's 13.0, each CTA a block or two; where the ~3 us go is not measured: candidates are its Q^T,
# gathered and permuted by plain loads, and its O^T, staged through shared memory). At 12 heads,
# fp8 it took 3.7-16% off batch 32-128 from 2K context and 10% off batch 128 / 1K, but added 6% at
# batch 32 / 1K and 16-24% at batch 1, whose plans spread a request over 113 CTAs
# (mla_ab_h200.json run 41). The choice is per plan (batch capacity), as a CUDA graph replays its
# plan at any length; batch 2-16 is not measured.
SWAP_MIN_BATCH = 32


def swap_head_group(q_per_req: int, heads: int) -> int:
    """Heads a swap CTA takes: the most that divide `heads` with q_per_req x them <= SWAP_MAX_ROWS
    (0 when q_per_req alone is more). The kernel computes the same (swap_head_group in
    sm90_common.cuh); its grid has heads / this CTAs per request and split."""
    g = min(SWAP_MAX_ROWS // max(q_per_req, 1), heads)
    while g > 1 and heads % g:
        g -= 1
    return g


def pick_schedule(kv_dtype: torch.dtype, q_per_req: int, heads: int, batch: int) -> str:
    """The default kernel for a call: swap for an fp8 cache and a batch of at least SWAP_MIN_BATCH
    whose request fits one CTA or fills its CTAs (SWAP_MAX_ROWS rows each), else pair."""
    rows = q_per_req * swap_head_group(q_per_req, heads)
    if kv_dtype == FP8 and batch >= SWAP_MIN_BATCH and rows > 0 and \
            (rows == q_per_req * heads or rows == SWAP_MAX_ROWS):
        return "swap"
    return DEFAULT_SCHEDULE


@functools.lru_cache(maxsize=4)
def load_extension(verbose: bool = False, timeline: bool = False, src_dir: str | None = None):
    """JIT-build (or load the cached build of) the extension; raises on a compiler error.
    Diagnostics (benchmarks/mla_breakdown.py, benchmarks/mla_ab.py) pass the result as
    mla_verify_cuda's `ext`: timeline = the build whose pair kernel stamps each CTA's phases
    (mod.timeline(ctas)); src_dir = the same sources from another folder (an A/B baseline). Each is
    a module of its own beside the production one."""
    from torch.utils.cpp_extension import load

    t0 = time.time()
    src = os.path.abspath(src_dir or _DIR)
    flags = ["-DMLA_TIMELINE"] if timeline else []
    name = "k3trt_mla_sm90" + ("_timeline" if timeline else "")
    if src != _DIR:
        name += "_" + hashlib.sha1(src.encode()).hexdigest()[:8]
    mod = load(name=name, sources=[os.path.join(src, s) for s in SOURCES],
               extra_cuda_cflags=CUDA_FLAGS + flags, extra_cflags=["-O3"] + flags,
               extra_include_paths=[src], verbose=verbose)
    log.info("mla_cuda: extension %s ready in %.1fs", name, time.time() - t0)
    return mod


def unsupported(q, kv_cache, block_table, seq_lens, d_v) -> str | None:
    """Why the kernel cannot take this call (None when it can)."""
    if not q.is_cuda:
        return "q not on CUDA"
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} (bf16 only)"
    if q.dim() != 3 or q.shape[2] != D_QK or d_v != D_V:
        return f"q {tuple(q.shape)}, d_v {d_v} (need width 576, d_v 512)"
    if kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != (PAGE, D_QK):
        return f"kv_cache {tuple(kv_cache.shape)} (need [pages, 64, 576])"
    if kv_cache.dtype not in (torch.bfloat16, FP8):
        return f"kv dtype {kv_cache.dtype}"
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        return "block_table / seq_lens not int32"
    if not (q.is_contiguous() and kv_cache.is_contiguous() and seq_lens.is_contiguous()
            and block_table.stride(-1) == 1):
        return "non-contiguous input"
    if q.data_ptr() % 16 or kv_cache.data_ptr() % 16:  # TMA reads both (the binding checks too)
        return "q / kv_cache not 16-byte aligned"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"device capability {torch.cuda.get_device_capability(q.device)} (sm_90 only)"
    return None


@functools.lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=16)
def _err_buffer(index: int) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, device=f"cuda:{index}")


def _tiles(batch: int, q_per_req: int, heads: int, schedule: str = DEFAULT_SCHEDULE) -> int:
    """CTAs per split: the batch's 64-row M tiles of folded Q·H rows, or its head groups (swap)."""
    if schedule == "swap":
        return batch * (heads // max(1, swap_head_group(q_per_req, heads)))
    return batch * -(-q_per_req * heads // 64)


def default_splits(batch: int, q_per_req: int, heads: int, device_index: int = 0,
                   schedule: str = DEFAULT_SCHEDULE) -> int:
    return choose_splits(max(1, _tiles(batch, q_per_req, heads, schedule)), _num_sms(device_index))


def default_plan(kv_dtype: torch.dtype, batch: int, q_per_req: int, heads: int,
                 device_index: int = 0, schedule: str | None = None) -> tuple[str, int]:
    """(schedule, splits) that mla_verify_cuda takes for a call left to its defaults (schedule None:
    pick_schedule's), for callers that report or pass the split count themselves."""
    schedule = schedule or pick_schedule(kv_dtype, q_per_req, heads, batch)
    return schedule, default_splits(batch, q_per_req, heads, device_index, schedule)


def wave_splits(batch: int, q_per_req: int, heads: int, splits: int, num_sms: int,
                schedule: str = DEFAULT_SCHEDULE) -> int:
    """The most splits (<= splits) whose grid is one wave of CTAs (one CTA per SM)."""
    return max(1, min(splits, num_sms // max(1, _tiles(batch, q_per_req, heads, schedule))))


def kernel_error(device=None) -> dict | None:
    """The first in-kernel timeout since the last reset (syncs), or None. A timeout means the
    pipeline lost a TMA completion: results of that call are garbage."""
    index = torch.device(device or "cuda").index or 0
    err = _err_buffer(index).tolist()
    if err[0] == 0:
        return None
    return {"what": _TIMEOUT_NAMES.get(err[0], f"code {err[0]}"), "block": err[1],
            "chunk": err[2], "parity": err[3]}


def reset_kernel_error(device=None) -> None:
    _err_buffer(torch.device(device or "cuda").index or 0).zero_()


def mla_verify_cuda(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale=1.0,
                    d_v=512, num_splits=None, *, out=None, lse=None, poison_scratch=False,
                    min_split_blocks=MIN_SPLIT_BLOCKS, full_split_blocks=FULL_SPLIT_BLOCKS,
                    max_spread=None, schedule=None, ext=None):
    """out [B·Q, H, 512] bf16, lse [B·Q, H] fp32 (see the module docstring). Tests pass NaN-filled
    `out` / `lse` and `poison_scratch` to prove every element is written and no unwritten partial
    is read. schedule None: pick_schedule's. ext: another build of the extension to run
    (load_extension's diagnostics)."""
    if schedule is None:
        schedule = pick_schedule(kv_cache.dtype, q_per_req, q.shape[1], block_table.shape[0])
    if schedule not in SCHEDULES:
        raise ValueError(f"mla_verify_cuda: schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
    reason = unsupported(q, kv_cache, block_table, seq_lens, d_v)
    if reason:
        raise ValueError(f"mla_verify_cuda: unsupported call: {reason}")
    batch, heads = block_table.shape[0], q.shape[1]
    if q.shape[0] != batch * q_per_req or seq_lens.shape != (batch,):
        raise ValueError(f"mla_verify_cuda: {q.shape[0]} query rows, {batch} block-table rows, "
                         f"seq_lens {tuple(seq_lens.shape)}, q_per_req {q_per_req} disagree")
    index = q.device.index or 0
    if num_splits is None:
        num_splits = default_splits(batch, q_per_req, heads, index, schedule)
    num_splits = max(1, int(num_splits))
    if max_spread is None:
        max_spread = wave_splits(batch, q_per_req, heads, num_splits, _num_sms(index), schedule)
    if out is None:
        out = torch.empty(batch * q_per_req, heads, D_V, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(batch * q_per_req, heads, dtype=torch.float32, device=q.device)
    rows = batch * q_per_req * heads
    if rows == 0:
        return out, lse
    mod = ext or load_extension()
    part_o = part_lse = lse  # unused without splits
    if num_splits > 1:  # (builds before 16-bit partials have no partial_dtype: fp32)
        name = getattr(mod, "partial_dtype", "float32")
        if kv_cache.dtype == FP8:
            name = getattr(mod, "partial_dtype_fp8", name)
        part_dtype = getattr(torch, name)
        part_o, part_lse = split_scratch(rows, num_splits, D_V, q.device, poison_scratch, part_dtype)
    mod.forward(q, kv_cache, block_table, seq_lens, int(q_per_req), float(softmax_scale),
                float(kv_scale), num_splits, int(max_spread), int(min_split_blocks),
                int(full_split_blocks), out, lse, part_o, part_lse,
                _err_buffer(index), SCHEDULES[schedule],
                torch.cuda.current_stream(q.device).cuda_stream)
    return out, lse
