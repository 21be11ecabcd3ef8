"""Triton kernels behind ``k3trt::short_conv_slots`` and ``k3trt::kda_prep`` (imported lazily by the
ops' CUDA kernels in kda_front.py, so importing k3trt never needs triton).

    short_conv_slots_fwd(x, weight, conv_cache, slots, fresh, step_conv, save, block_c=None) -> y
    kda_prep_fwd(y, f, b, dt_bias, A_log, num_heads, head_dim, lower_bound, block_h=None)
        -> (q, k, v, g, beta)

Layouts are the ops' (kda_front.py module doc); every input may have any strides. The launchers do
no host synchronisation and allocate only their outputs, so they can be captured in a CUDA graph
(compile them with one eager call first).

short_conv_slots: one program per (row, block of channels) keeps the K-1 window vectors in
registers across the n positions: it reads the slot once (a masked load for fresh rows, so NaN
garbage never enters), writes y and, when saving, every position's window, then the slot once.
Window values pass through x's dtype, as the torch body's ``conv_cache[slots].to(x.dtype)`` does.
A slot outside [0, num_slots) is neither read nor written (a host-side bounds check would sync; the
torch body raises instead): that row runs from a zero window.

kda_prep: one program per (token, block of heads) holds [heads, D] tiles of q, k, v and the gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kda_front_ref import L2_EPS

# Fewer programs than this leave an H200's 132 SMs mostly idle (B = 1 decode), so the blocks shrink.
MIN_PROGRAMS = 512
SOFTPLUS_THRESHOLD = 20.0     # F.softplus's default: x itself above it


@triton.jit
def _short_conv_slots_kernel(
    X, W, CACHE, SLOTS, FRESH, STEP, Y,
    n, C, num_slots,
    sx_b, sx_t, sx_c, sw_c, sw_k, sc_s, sc_c, sc_k, ss_s, ss_t, ss_c, ss_k, sl_b, sf_b,
    BLOCK_C: tl.constexpr, SAVE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < C
    slot = tl.load(SLOTS + b * sl_b).to(tl.int64)              # int64: slot * stride can pass 2^31
    in_range = (slot >= 0) & (slot < num_slots)
    read = in_range & (tl.load(FRESH + b * sf_b) == 0)
    # all-or-nothing row masks written as a bound on `c` (Triton's interpreter rejects a scalar
    # bool broadcast into a block mask)
    read_mask = c < read.to(tl.int32) * C
    write_mask = c < in_range.to(tl.int32) * C
    xdt = X.dtype.element_ty

    win = CACHE + slot * sc_s + c * sc_c
    # masked lanes take `other` and never touch memory: a select, so a NaN in the slot cannot leak
    w0 = tl.load(win, mask=read_mask, other=0.0).to(xdt).to(tl.float32)
    w1 = tl.load(win + sc_k, mask=read_mask, other=0.0).to(xdt).to(tl.float32)
    w2 = tl.load(win + 2 * sc_k, mask=read_mask, other=0.0).to(xdt).to(tl.float32)
    wc = W + c * sw_c
    k0 = tl.load(wc, mask=in_c, other=0.0).to(tl.float32)
    k1 = tl.load(wc + sw_k, mask=in_c, other=0.0).to(tl.float32)
    k2 = tl.load(wc + 2 * sw_k, mask=in_c, other=0.0).to(tl.float32)
    k3 = tl.load(wc + 3 * sw_k, mask=in_c, other=0.0).to(tl.float32)

    for t in range(n):
        x_t = tl.load(X + b * sx_b + t * sx_t + c * sx_c, mask=in_c, other=0.0).to(tl.float32)
        # the torch body's order: oldest tap first
        acc = w0 * k0
        acc = acc + w1 * k1
        acc = acc + w2 * k2
        acc = acc + x_t * k3
        out = acc / (1.0 + tl.exp(-acc))                          # SiLU
        tl.store(Y + (b * n + t) * C + c, out.to(xdt), mask=in_c)
        w0, w1, w2 = w1, w2, x_t
        if SAVE:
            step = STEP + slot * ss_s + t * ss_t + c * ss_c
            sdt = STEP.dtype.element_ty
            tl.store(step, w0.to(sdt), mask=write_mask)
            tl.store(step + ss_k, w1.to(sdt), mask=write_mask)
            tl.store(step + 2 * ss_k, w2.to(sdt), mask=write_mask)
    cdt = CACHE.dtype.element_ty
    tl.store(win, w0.to(cdt), mask=write_mask)
    tl.store(win + sc_k, w1.to(cdt), mask=write_mask)
    tl.store(win + 2 * sc_k, w2.to(cdt), mask=write_mask)


def pick_block_c(rows: int, channels: int) -> tuple[int, int]:
    """(BLOCK_C, num_warps): up to 1024 channels per program, fewer while that leaves under
    MIN_PROGRAMS programs; four channels per thread."""
    bc = min(1024, max(128, triton.next_power_of_2(channels)))
    while bc > 128 and rows * triton.cdiv(channels, bc) < MIN_PROGRAMS:
        bc //= 2
    return bc, max(1, min(8, bc // 128))


def short_conv_slots_fwd(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor, slots: torch.Tensor,
                         fresh: torch.Tensor, step_conv: torch.Tensor, save: bool,
                         block_c: int | None = None) -> torch.Tensor:
    """Launch the conv kernel (shapes are checked by the op; here only what the kernel itself
    needs). ``block_c`` overrides the channel block (tests use it to cover partial blocks)."""
    B, n, C = x.shape
    if weight.shape[-1] != 4:
        raise ValueError(f"short_conv_slots_fwd: weight has kernel size {weight.shape[-1]}, the kernel needs 4")
    y = torch.empty(B, n, C, dtype=x.dtype, device=x.device)
    if B == 0 or n == 0 or C == 0:
        return y
    bc, warps = pick_block_c(B, C) if block_c is None else (block_c, max(1, min(8, block_c // 128)))
    if bc & (bc - 1):
        raise ValueError(f"short_conv_slots_fwd: block_c {bc} must be a power of two")
    step = step_conv if save else conv_cache                 # any valid pointer: SAVE=False never touches it
    step_strides = step_conv.stride() if save else (0, 0, 0, 0)
    # bool -> uint8 is a view (same element size): no copy, nothing for a graph to capture
    fresh_u8 = fresh.view(torch.uint8)
    _short_conv_slots_kernel[(B, triton.cdiv(C, bc))](
        x, weight, conv_cache, slots, fresh_u8, step, y,
        n, C, conv_cache.shape[0],
        *x.stride(), weight.stride(0), weight.stride(2), *conv_cache.stride(), *step_strides,
        slots.stride(0), fresh_u8.stride(0),
        BLOCK_C=bc, SAVE=bool(save), num_warps=warps,
    )
    return y


@triton.jit
def _kda_prep_kernel(
    Yin, Fin, Bin, DT, ALOG, Q, K, V, G, BETA,
    num_heads, lower_bound, eps,
    sy_t, sy_c, sf_t, sf_c, sb_t, sb_h, s_dt, s_a,
    D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr, HAS_LB: tl.constexpr, THRESHOLD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, DP)
    in_h = h < num_heads
    m = in_h[:, None] & (d[None, :] < D)
    col = h[:, None] * D + d[None, :]                          # [BH, DP] within one H·D block
    HD = num_heads * D
    row = Yin + t * sy_t
    q = tl.load(row + col * sy_c, mask=m, other=0.0).to(tl.float32)
    k = tl.load(row + (HD + col) * sy_c, mask=m, other=0.0).to(tl.float32)
    v = tl.load(row + (2 * HD + col) * sy_c, mask=m, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + eps)[:, None]
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    out = t * HD + col
    tl.store(Q + out, q, mask=m)
    tl.store(K + out, k, mask=m)
    tl.store(V + out, v, mask=m)

    raw = tl.load(Fin + t * sf_t + col * sf_c, mask=m, other=0.0).to(tl.float32) \
        + tl.load(DT + col * s_dt, mask=m, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(ALOG + h * s_a, mask=in_h, other=0.0).to(tl.float32))[:, None]
    if HAS_LB:
        g = lower_bound * tl.sigmoid(a * raw)
    else:
        # softplus = log1p(e^x) below the threshold; log1p(e) = log(u) · e / (u - 1) with u = 1 + e
        # (Goldberg) keeps the tiny values of very negative x that log(1 + e) rounds to 0
        e = tl.exp(tl.minimum(raw, THRESHOLD))
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
        g = -a * tl.where(raw > THRESHOLD, raw, lp)
    tl.store(G + out, g, mask=m)
    beta = tl.sigmoid(tl.load(Bin + t * sb_t + h * sb_h, mask=in_h, other=0.0).to(tl.float32))
    tl.store(BETA + t * num_heads + h, beta, mask=in_h)


def pick_block_h(tokens: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(BH, num_warps): up to 8 heads per program while that leaves MIN_PROGRAMS programs."""
    bh = 1
    while bh < 8 and tokens * triton.cdiv(heads, 2 * bh) >= MIN_PROGRAMS:
        bh *= 2
    return bh, _prep_warps(bh, head_dim)


def _prep_warps(bh: int, head_dim: int) -> int:
    return max(1, min(4, bh * triton.next_power_of_2(head_dim) // 256))


def kda_prep_fwd(y: torch.Tensor, f: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                 num_heads: int, head_dim: int, lower_bound: float | None,
                 block_h: int | None = None) -> tuple[torch.Tensor, ...]:
    """Launch the prep kernel (shapes are checked by the op). ``block_h`` overrides the heads per
    program (tests use it to cover a partial block)."""
    T, H, D = y.shape[0], num_heads, head_dim
    q, k, v, g = (torch.empty(T, H, D, dtype=torch.float32, device=y.device) for _ in range(4))
    beta = torch.empty(T, H, dtype=torch.float32, device=y.device)
    if T == 0:
        return q, k, v, g, beta
    bh, warps = pick_block_h(T, H, D) if block_h is None else (block_h, _prep_warps(block_h, D))
    if bh & (bh - 1):
        raise ValueError(f"kda_prep_fwd: block_h {bh} must be a power of two")
    _kda_prep_kernel[(T, triton.cdiv(H, bh))](
        y, f, b, dt_bias, A_log, q, k, v, g, beta,
        H, 0.0 if lower_bound is None else float(lower_bound), L2_EPS,
        *y.stride(), *f.stride(), *b.stride(), dt_bias.stride(0), A_log.stride(0),
        D=D, DP=triton.next_power_of_2(D), BH=bh, HAS_LB=lower_bound is not None,
        THRESHOLD=SOFTPLUS_THRESHOLD, num_warps=warps,
    )
    return q, k, v, g, beta
