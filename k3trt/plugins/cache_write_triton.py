"""Triton kernel behind ``k3trt::mla_cache_write`` on CUDA (imported on the op's first CUDA call by
its CUDA registration in cache_write.py, so importing k3trt never needs triton).

    mla_cache_write_fwd(kv_c [T, R], k_pe [T, P], cache [blocks, block_size, R+P],
                        slot_mapping int [T], kv_scale: float) -> None      (mutates cache)

Row t of [kv_c | k_pe] goes to flat cache row slot_mapping[t]; a negative slot (padding) is
skipped, and so is a slot past the cache (the op's torch body raises IndexError there, but a
bounds check on the host would read slot_mapping back, a sync a CUDA graph cannot hold). A
float8_e4m3fn cache stores x / kv_scale clamped to +-448 and rounded to nearest even, as the
torch body; any other cache dtype stores x cast to it. kv_c and k_pe may be strided views (the
latent projection's output sliced in two). No host synchronisation, no allocation: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_write_ref import FP8_MAX

FP8 = torch.float8_e4m3fn
BLOCK_COLS = 128     # columns per program: K3's 576-wide row is 5 programs (the last one partly masked)


@triton.jit
def _cache_write_kernel(KVC, KPE, CACHE, SLOTS, num_rows, kv_scale,
                        skc_t, skc_c, skp_t, skp_c,
                        R: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, FP8_OUT: tl.constexpr,
                        FP8_LIMIT: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(SLOTS + t).to(tl.int64)                   # int64: slot * width can pass 2^31
    ok = (slot >= 0) & (slot < num_rows)
    # all-or-nothing row mask as a bound on `cols` (Triton's interpreter rejects a scalar bool
    # broadcast into a block mask)
    width = ok.to(tl.int32) * (R + P)
    in_c = cols < tl.minimum(width, R)
    in_p = (cols >= R) & (cols < width)
    x = tl.load(KVC + t * skc_t + cols * skc_c, mask=in_c, other=0.0).to(tl.float32)
    y = tl.load(KPE + t * skp_t + (cols - R) * skp_c, mask=in_p, other=0.0).to(tl.float32)
    row = tl.where(cols < R, x, y)
    dst = CACHE + slot * (R + P) + cols
    if FP8_OUT:
        # IEEE division, as the torch body's x / kv_scale (a reciprocal multiply rounds differently)
        row = tl.math.div_rn(row, kv_scale)
        # NaN stays NaN, as torch.clamp keeps it
        row = tl.minimum(tl.maximum(row, -FP8_LIMIT, propagate_nan=tl.PropagateNan.ALL), FP8_LIMIT,
                         propagate_nan=tl.PropagateNan.ALL)
    tl.store(dst, row.to(CACHE.dtype.element_ty), mask=cols < width)


def mla_cache_write_fwd(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                        slot_mapping: torch.Tensor, kv_scale: float) -> None:
    """Launch the kernel: one program per (token, block of BLOCK_COLS columns)."""
    T, R = kv_c.shape
    P = k_pe.shape[1]
    if T == 0:
        return
    fp8 = cache.dtype == FP8
    grid = (T, triton.cdiv(R + P, BLOCK_COLS))
    _cache_write_kernel[grid](
        kv_c, k_pe, cache, slot_mapping, cache.shape[0] * cache.shape[1], float(kv_scale),
        kv_c.stride(0), kv_c.stride(1), k_pe.stride(0), k_pe.stride(1),
        R=R, P=P, BLOCK=BLOCK_COLS, FP8_OUT=fp8, FP8_LIMIT=float(FP8_MAX), num_warps=4,
    )
