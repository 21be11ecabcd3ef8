"""SM90 CUDA kernels for K3's MLA verification, JIT-built at first use.

    from k3trt.plugins.mla_cuda import mla_verify_cuda
    out, lse = mla_verify_cuda(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale,
                               kv_scale=1.0, d_v=512, num_splits=None)

Same semantics as ``mla_verify_ref`` (k3trt/plugins/mla_verify.py) without DCP or the sparse
policy, for the case the kernels are built for: q bf16 [B·Q, H, 576], d_v = 512, a contiguous
paged cache [pages, 64, 576] in bf16 or float8_e4m3fn (value = fp8 · kv_scale), int32 block table
and lengths. Any head count works. ``num_splits`` None picks the split-K count that fills the GPU's
SMs; splits > 1 write 16-bit partials to scratch ([rows, splits, 512]: bf16 for a bf16 cache, fp16
in the cache's units for an fp8 one, with an fp32 LSE) that a merge kernel combines by LSE. A
request shorter than splits · full_split_blocks pages spreads over fewer splits (at most
``max_spread``; None: as many as keep the grid in one wave of CTAs), and the grid stays as
planned, so a captured graph replays at any length. ``schedule`` None takes pick_schedule's: the
pair kernel, or the swap kernel for fp8 caches from batch 32 (schedule.py; docs/mla_verify.md
explains both, the merge and the split rule).

Build: torch.utils.cpp_extension.load with nvcc for sm_90a (wgmma needs the "a" target), cached
by torch under ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR); the shared constants'
header (constants.py) is written beside that cache.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from ..plans import split_scratch
from . import constants
from .constants import D_QK, D_V, PAGE, SCHEDULES, TIMEOUT_NAMES
from .schedule import (DEFAULT_SCHEDULE, FP8, FULL_SPLIT_BLOCKS, MIN_SPLIT_BLOCKS,  # noqa: F401
                       SWAP_MIN_BATCH, default_plan, default_splits, pick_schedule, sm_count,
                       swap_head_group, tiles, wave_splits)

log = logging.getLogger(__name__)

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("binding.cpp", "launch.cu", "pair.cu", "swap.cu", "merge.cu")
CUDA_FLAGS = ("-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-Xptxas=-v")
EXTENSION = "k3trt_mla_sm90"


def header_dir(name: str) -> str:
    """Where the build of extension `name` finds mla_constants.h: beside torch's build cache."""
    from torch.utils.cpp_extension import get_default_build_root  # noqa: PLC0415 (heavy: only when building)

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return os.path.join(root, name + "_include")


@functools.lru_cache(maxsize=1)
def load_extension(verbose: bool = False):
    """JIT-build (or load the cached build of) the extension; raises on a compiler error."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 (heavy: only when building)

    t0 = time.time()
    include = constants.write_header(header_dir(EXTENSION))
    mod = load(name=EXTENSION, sources=[os.path.join(SOURCE_DIR, s) for s in SOURCES],
               extra_cuda_cflags=list(CUDA_FLAGS), extra_cflags=["-O3"],
               extra_include_paths=[SOURCE_DIR, include], verbose=verbose)
    log.info("mla_cuda: extension %s ready in %.1fs", EXTENSION, time.time() - t0)
    return mod


def unsupported(q, kv_cache, block_table, seq_lens, d_v) -> str | None:
    """Why the kernel cannot take this call (None when it can)."""
    if not q.is_cuda:
        return "q not on CUDA"
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} (bf16 only)"
    if q.dim() != 3 or q.shape[2] != D_QK or d_v != D_V:
        return f"q {tuple(q.shape)}, d_v {d_v} (need width {D_QK}, d_v {D_V})"
    if kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != (PAGE, D_QK):
        return f"kv_cache {tuple(kv_cache.shape)} (need [pages, {PAGE}, {D_QK}])"
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
def _err_buffer(index: int) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, device=f"cuda:{index}")


def kernel_error(device=None) -> dict | None:
    """The first in-kernel timeout since the last reset (syncs), or None. A timeout means the
    pipeline lost a TMA completion: results of that call are garbage."""
    index = torch.device(device or "cuda").index or 0
    err = _err_buffer(index).tolist()
    if err[0] == 0:
        return None
    return {"what": TIMEOUT_NAMES.get(err[0], f"code {err[0]}"), "block": err[1],
            "chunk": err[2], "parity": err[3]}


def reset_kernel_error(device=None) -> None:
    _err_buffer(torch.device(device or "cuda").index or 0).zero_()


def launch(mod, q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale, out, lse,
           schedule: str, num_splits: int, max_spread: int, min_split_blocks: int,
           full_split_blocks: int) -> None:
    """One call of a built extension `mod` with every choice made (mla_verify_cuda's last step):
    allocates the split scratch and launches the verify kernel and the merge on the current
    stream."""
    rows = out.shape[0] * out.shape[1]
    part_o = part_lse = lse  # unused without splits
    if num_splits > 1:  # 16-bit partials: bf16, or fp16 in an fp8 cache's units
        part_dtype = torch.float16 if kv_cache.dtype == FP8 else torch.bfloat16
        part_o, part_lse = split_scratch(rows, num_splits, D_V, q.device, o_dtype=part_dtype)
    index = q.device.index or 0
    mod.forward(q, kv_cache, block_table, seq_lens, int(q_per_req), float(softmax_scale),
                float(kv_scale), num_splits, int(max_spread), int(min_split_blocks),
                int(full_split_blocks), out, lse, part_o, part_lse, _err_buffer(index),
                SCHEDULES[schedule], swap_head_group(q_per_req, q.shape[1]),
                torch.cuda.current_stream(q.device).cuda_stream)


def mla_verify_cuda(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale=1.0,
                    d_v=512, num_splits=None, *, out=None, lse=None,
                    min_split_blocks=MIN_SPLIT_BLOCKS, full_split_blocks=FULL_SPLIT_BLOCKS,
                    max_spread=None, schedule=None):
    """out [B·Q, H, 512] bf16, lse [B·Q, H] fp32 (see the module docstring); `out` / `lse` may be
    given (tests pass NaN-filled ones to prove every element is written)."""
    if schedule is None:
        schedule = pick_schedule(kv_cache.dtype, q_per_req, q.shape[1], block_table.shape[0])
    if schedule not in SCHEDULES:
        raise ValueError(f"mla_verify_cuda: schedule {schedule!r} is not one of "
                         f"{sorted(SCHEDULES)}")
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
        max_spread = wave_splits(batch, q_per_req, heads, num_splits, sm_count(index), schedule)
    if out is None:
        out = torch.empty(batch * q_per_req, heads, D_V, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(batch * q_per_req, heads, dtype=torch.float32, device=q.device)
    if batch * q_per_req * heads == 0:
        return out, lse
    launch(load_extension(), q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale,
           kv_scale, out, lse, schedule, num_splits, max_spread, min_split_blocks,
           full_split_blocks)
    return out, lse
