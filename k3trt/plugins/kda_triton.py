"""Triton kernel behind ``k3trt::kda_recurrent_slots`` (imported lazily by the op's CUDA kernel in
kda.py, so importing k3trt never needs triton).

    kda_recurrent_slots_fwd(q, k, v, g, beta, state_cache, slots, fresh, step_state_cache, scale,
                            save, block_v=None) -> o fp32 [B, n, H, dv]

Layouts are the op's (kda.py module doc); q, k, v, g, beta may have any strides, the caches must be
contiguous. The launcher does no host synchronisation and allocates only ``o``, so it can be
captured in a CUDA graph (compile it with one eager call first).

Design: under the delta rule the dv columns of a head's state are independent (every update is
S <- D S + k u^T, and u's column j only reads column j of S), so one program owns one
(sequence, head, block of BV columns): it keeps S[:, block] (dk x BV fp32) in registers across all
n positions, reads the slot once, writes the slot once, and writes the per-position states only
when saving. The state is read with a mask (not multiplied by zero) for fresh rows, so NaN garbage
in a reused slot never enters. Slots outside [0, num_slots) are neither read nor written (a
host-side bounds check would sync; the op's torch body raises instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# fp32 state elements held per thread: dk * BV / (32 * num_warps). 32 leaves room for the vectors
# and addresses well under the 255-register limit (no spills at dk = 128).
STATE_REGS_PER_THREAD = 32
# Below this many programs with BV = 32 the grid would leave an H200's 132 SMs mostly idle
# (B = 1 decode on a TP-sharded layer), so the columns are split finer.
MIN_PROGRAMS = 256


@triton.jit
def _kda_slots_kernel(
    Q, K, V, G, BETA, STATE, SLOTS, FRESH, STEP, O,
    n, num_heads, num_slots, max_q, scale,
    sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d,
    sg_b, sg_t, sg_h, sg_d, sb_b, sb_t, sb_h,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    rk = tl.arange(0, DK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    cell = rk[:, None] * DV + rv[None, :]                     # [DK, BV] offsets in one head's state

    slot = tl.load(SLOTS + b).to(tl.int64)                    # int64: slot * H * dk * dv passes 2^31
    in_range = (slot >= 0) & (slot < num_slots)
    read = in_range & (tl.load(FRESH + b) == 0)
    # all-or-nothing masks written as a bound on `cell` (Triton's interpreter rejects a scalar
    # bool broadcast into a block mask)
    read_mask = cell < read.to(tl.int32) * (DK * DV)
    write_mask = cell < in_range.to(tl.int32) * (DK * DV)
    head_state = STATE + (slot * num_heads + h) * (DK * DV)
    # masked lanes take `other` and never touch memory: a select, so a NaN in the slot cannot leak
    S = tl.load(head_state + cell, mask=read_mask, other=0.0)

    for t in range(n):
        k_t = tl.load(K + b * sk_b + t * sk_t + h * sk_h + rk * sk_d).to(tl.float32)
        q_t = tl.load(Q + b * sq_b + t * sq_t + h * sq_h + rk * sq_d).to(tl.float32)
        g_t = tl.load(G + b * sg_b + t * sg_t + h * sg_h + rk * sg_d).to(tl.float32)
        v_t = tl.load(V + b * sv_b + t * sv_t + h * sv_h + rv * sv_d).to(tl.float32)
        beta_t = tl.load(BETA + b * sb_b + t * sb_t + h * sb_h).to(tl.float32)
        # (I - b k k^T) D S + b k v^T  =  D S + k (b (v - k^T D S))^T, as in kda_recurrent's body
        S = S * tl.exp(g_t)[:, None]
        pred = tl.sum(k_t[:, None] * S, axis=0)               # [BV]
        u = beta_t * (v_t - pred)
        S = S + k_t[:, None] * u[None, :]
        o_t = tl.sum(q_t[:, None] * S, axis=0) * scale
        tl.store(O + ((b * n + t) * num_heads + h) * DV + rv, o_t)
        if SAVE:
            step = STEP + ((slot * max_q + t) * num_heads + h) * (DK * DV)
            tl.store(step + cell, S, mask=write_mask)
    tl.store(head_state + cell, S, mask=write_mask)


def pick_block_v(batch: int, heads: int, dk: int, dv: int) -> tuple[int, int]:
    """(BV, num_warps): BV = 32 columns per program unless that leaves too few programs, then 16;
    warps so that each thread holds STATE_REGS_PER_THREAD state elements."""
    bv = min(32, dv)
    if batch * heads * (dv // bv) < MIN_PROGRAMS and bv > 16:
        bv = 16
    return bv, _warps(dk, bv)


def _warps(dk: int, bv: int) -> int:
    return max(1, min(8, dk * bv // (32 * STATE_REGS_PER_THREAD)))


def kda_recurrent_slots_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state_cache: torch.Tensor, slots: torch.Tensor,
                            fresh: torch.Tensor, step_state_cache: torch.Tensor, scale: float,
                            save: bool, block_v: int | None = None) -> torch.Tensor:
    """Launch the kernel (shapes are checked by the op; here only what the kernel itself needs).
    ``block_v`` overrides the column block (tests use it to cover several)."""
    B, n, H, dk = q.shape
    dv = v.shape[-1]
    if not state_cache.is_contiguous() or (save and not step_state_cache.is_contiguous()):
        raise ValueError("kda_recurrent_slots_fwd: the caches must be contiguous")
    o = torch.empty(B, n, H, dv, dtype=torch.float32, device=q.device)
    if B == 0 or H == 0:
        return o
    if block_v is None:
        bv, warps = pick_block_v(B, H, dk, dv)
    else:
        bv, warps = block_v, _warps(dk, block_v)
    if dv % bv or bv & (bv - 1):
        raise ValueError(f"kda_recurrent_slots_fwd: block_v {bv} must be a power of two dividing dv={dv}")
    step = step_state_cache if save else state_cache        # any valid pointer: SAVE=False never reads it
    max_q = step_state_cache.shape[1] if save else 0
    # bool -> uint8 is a view (same element size): no copy, nothing for a graph to capture
    fresh_u8 = fresh.view(torch.uint8)
    _kda_slots_kernel[(B, H, dv // bv)](
        q, k, v, g, beta, state_cache, slots, fresh_u8, step, o,
        n, H, state_cache.shape[0], max_q, float(scale),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        DK=dk, DV=dv, BV=bv, SAVE=bool(save), num_warps=warps,
    )
    return o
