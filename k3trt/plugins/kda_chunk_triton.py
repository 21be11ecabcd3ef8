"""Triton kernel behind ``k3trt::kda_chunked`` (prefill's chunked KDA), imported lazily by the op's
CUDA kernel in kda.py, so importing k3trt never needs triton.

    kda_chunked_fwd(q, k, v, g, beta, state, scale, chunk_size, *, block_v=None, out=None)
        -> (o, final_state)

Layouts are the op's (kda.py module doc): q, k, g [B, T, H, dk], v [B, T, H, dv], beta [B, T, H],
state [B, H, dk, dv], or the same without B; every input may have any strides and any float
dtype; o is contiguous in v's dtype, final_state contiguous fp32. The launcher does no host
synchronisation and allocates only its two outputs, so it can be captured in a CUDA graph (compile
it with one eager call first). The op's CUDA registration (kda.py) calls it where
``kda_ref.kda_chunked_unsupported`` allows, and the torch body otherwise.

Chunk. The kernel always works in chunks of BT = 16 tokens, whatever ``chunk_size`` says (it is
validated, and only changes rounding in the torch body). Per token the chunked form costs the same
per-channel pair work at any chunk length (each token pairs with the earlier tokens of its own
16-block), while chunks longer than 16 add off-diagonal 16x16 blocks on top; the state work per
token does not depend on the chunk. So 16 is the cheapest in flops, and one chunk is one
diagonal block: no sub-block factoring is needed.

Stability, for any g <= 0. Every exponent is a sum of the g's it spans, formed as that sum, so each
is <= 0 (nothing overflows) and its rounding is relative to its own size (no cancellation between
two large cumulative decays, which a G_t - G_i form suffers after a strong decay early in a chunk):
e^{G_t} (chunk start to t) is a cumsum, e^{G_end - G_i} a reverse cumsum of g shifted by one token,
and the pairwise spans sum_{i<j<=t} g_j, per channel, are accumulated column by column (i from the
end of the chunk down) by adding g_i to the rows below it.

Per chunk, with S the state before it (the torch body's algebra, kda_ref.py):
    A_ti = sum_c k_t k_i e^{span}, i < t;  M_ti = sum_c q_t k_i e^{span}, i <= t     [16, 16]
    Tm = (I + diag(b) A)^-1 diag(b)   (column by column from the last, as A's columns are formed)
    d = Tm V - Tm (K e^G) S;   o = scale ((Q e^G) S + M d);
    S <- Diag(e^{G_end}) S + (K e^{G_end - G})^T d.
Matrix products use tl.dot with fp32 inputs at DOT_PRECISION; all accumulation is fp32.

Parallelism. One program per (block of BV state columns, head, sequence), as in the decode kernel
(kda_triton.py): under the delta rule the dv columns of the state are independent, so a program
keeps S[:, block] (dk x BV fp32) in registers across every chunk, reads the state once and writes it
once, and needs no scratch. The intra-chunk matrices (M, Tm, Tm K e^G) depend only on q, k, g and
beta, so the R = dv / BV programs of a head each recompute them; those programs are adjacent in
the grid, so their q, k, g reads mostly hit L2. The alternative, a parallel intra-chunk kernel
writing fp32 W, U, M, Q e^G, K e^{G_end - G} (~2.1 KB per token and head: ~420 MB at T = 2048,
H = 96, growing with T) for a sequential state kernel, would move more bytes than the recompute
costs in flops at R = 2.

Cost at K3 sizes (B = 1, T = 2048, H = 96, dk = dv = 128): pick_block_v gives BV = 64, R = 2,
192 programs of 8 warps for the H200's 132 SMs. Per token and head, over a head's programs: the
pairwise decays 16 * dk * R = 4 K exps and ~30 K flops, Tm K e^G ~8 K flops, the state products
(W S, Q e^G S, K^T d, M d, Tm V) ~104 K flops; ~140 K flops and 4 K exps in all, i.e. ~28 GFLOP
and 0.8 G exps per layer: ~0.4 ms of fp32 CUDA-core work (67 TFLOP/s) with DOT_PRECISION = "ieee"
plus ~0.2 ms of exps, so expect 1-2 ms once the reductions and the exp/FMA contention are counted.
"tf32x3" would move the 104 K of products to the tensor cores. Memory: q, k, g, v read and o
written once per head (fp32, as prefill passes them: 5 MB per head, ~0.5 GB per layer, ~0.1 ms;
bf16 q / k / v: ~0.3 GB), plus the states: compute-bound. The torch body takes ~37 ms, in many
small kernels over [n, n, dk] decay tensors. With few heads (a TP-sharded layer) the grid is small
and the sequential chunk loop sets the time; pick_block_v then narrows the column blocks, trading
recompute for SMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kda_ref import check_kda

__all__ = ["kda_chunked_fwd", "pick_block_v"]

CHUNK = 16                    # tokens per chunk inside the kernel (module doc: why 16)
# tl.dot's input precision for the fp32 operands. "ieee" is exact fp32 on the CUDA cores; "tf32x3"
# (three tf32 products) is close to it on the tensor cores: the one to try when tuning on the H200.
DOT_PRECISION = "ieee"
# fp32 state elements per thread (dk * BV / (32 * num_warps)), as in the decode kernel: it leaves
# registers for the [16, dk] tiles of q, k, g, the spans and the decays (dk = 128: 8 each at 8 warps).
STATE_REGS_PER_THREAD = 32
MAX_WARPS = 8


@triton.jit
def _kda_chunk_kernel(
    Q, K, V, G, BETA, S0, O, S1,
    T, num_heads, scale,
    sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d,
    sg_b, sg_t, sg_h, sg_d, sb_b, sb_t, sb_h, ss_b, ss_h, ss_k, ss_v,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    rv = tl.program_id(0) * BV + tl.arange(0, BV)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)       # int64: b * stride passes 2^31 for long batches
    rk = tl.arange(0, DK)
    rt = tl.arange(0, BT)
    # per-chunk base pointers, advanced by one chunk at the end of each (64-bit pointer arithmetic,
    # so no token offset can overflow), and the small in-chunk offsets, computed once
    q_at = Q + b * sq_b + h * sq_h
    k_at = K + b * sk_b + h * sk_h
    v_at = V + b * sv_b + h * sv_h
    g_at = G + b * sg_b + h * sg_h
    beta_at = BETA + b * sb_b + h * sb_h
    o_at = O + (b * T * num_heads + h) * DV
    q_off = rt[:, None] * sq_t + rk[None, :] * sq_d
    k_off = rt[:, None] * sk_t + rk[None, :] * sk_d
    g_off = rt[:, None] * sg_t + rk[None, :] * sg_d
    v_off = rt[:, None] * sv_t + rv[None, :] * sv_d
    o_off = rt[:, None] * (num_heads * DV) + rv[None, :]
    eye = (rt[:, None] == rt[None, :]).to(tl.float32)

    S = tl.load(S0 + b * ss_b + h * ss_h + rk[:, None] * ss_k + rv[None, :] * ss_v).to(tl.float32)
    for s in range(0, T, BT):
        live = s + rt < T
        # tokens past T load as q = k = v = 0, g = 0, beta = 0: they neither decay nor write
        q = tl.load(q_at + q_off, mask=live[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_at + k_off, mask=live[:, None], other=0.0).to(tl.float32)
        g = tl.load(g_at + g_off, mask=live[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_at + v_off, mask=live[:, None], other=0.0).to(tl.float32)
        beta = tl.load(beta_at + rt * sb_t, mask=live, other=0.0).to(tl.float32)

        # Column by column from the last, with span[t] = sum_{i<j<=t} g_j (rows t >= i):
        #   M[:, i] (diagonal included), and column i of X = (I + N)^-1, N = diag(b) A strictly lower:
        #   with X' the inverse of the trailing block (columns > i, final), X[:, i] = e_i - X' N[:, i].
        #   X is kept transposed so that its column is a row and N[:, i] broadcasts without a
        #   layout change.
        M = tl.zeros([BT, BT], dtype=tl.float32)
        XT = eye
        span = tl.zeros([BT, DK], dtype=tl.float32)
        k_row = k_at + (BT - 1) * sk_t + rk * sk_d
        g_row = g_at + (BT - 1) * sg_t + rk * sg_d
        left = T - s + rk * 0                                # a block, not a scalar, for the mask
        for c in range(BT):
            i = BT - 1 - c
            k_i = tl.load(k_row, mask=left > i, other=0.0).to(tl.float32)
            g_i = tl.load(g_row, mask=left > i, other=0.0).to(tl.float32)
            p = tl.exp(span) * k_i[None, :]
            M = tl.where((rt[None, :] == i) & (rt[:, None] >= i), tl.sum(q * p, 1)[:, None], M)
            n_i = tl.where(rt > i, beta * tl.sum(k * p, 1), 0.0)
            XT -= tl.where(rt[:, None] == i, tl.sum(XT * n_i[:, None], 0)[None, :], 0.0)
            span = tl.where(rt[:, None] >= i, span + g_i[None, :], 0.0)
            k_row -= sk_t
            g_row -= sg_t
        Tm = tl.trans(XT) * beta[None, :]                    # (I + diag(b) A)^-1 diag(b)

        # g_{t+1} within the chunk, so that a reverse cumsum gives sum_{t<j<end} g_j without
        # subtracting g_t from a sum that holds it
        nxt = (rt + 1 < BT) & (s + rt + 1 < T)
        g_next = tl.load(g_at + sg_t + g_off, mask=nxt[:, None], other=0.0).to(tl.float32)
        decay_in = tl.exp(tl.cumsum(g, 0))                   # e^{G_t}
        decay_out = tl.exp(tl.cumsum(g_next, 0, reverse=True))   # e^{G_end - G_t}
        decay_all = tl.exp(tl.sum(g, 0))                     # e^{G_end}

        W = tl.dot(Tm, k * decay_in, input_precision=DOT_PRECISION)
        d = tl.dot(Tm, v, input_precision=DOT_PRECISION) - tl.dot(W, S, input_precision=DOT_PRECISION)
        o = tl.dot(q * decay_in, S, input_precision=DOT_PRECISION) + tl.dot(M, d, input_precision=DOT_PRECISION)
        tl.store(o_at + o_off, (o * scale).to(O.dtype.element_ty), mask=live[:, None])
        S = S * decay_all[:, None] + tl.dot(tl.trans(k * decay_out), d, input_precision=DOT_PRECISION)
        q_at += BT * sq_t
        k_at += BT * sk_t
        v_at += BT * sv_t
        g_at += BT * sg_t
        beta_at += BT * sb_t
        o_at += BT * num_heads * DV
    tl.store(S1 + (b * num_heads + h) * (DK * DV) + rk[:, None] * DV + rv[None, :], S)


def pick_block_v(batch: int, heads: int, dk: int, dv: int, num_sms: int) -> tuple[int, int]:
    """(BV, num_warps): the widest column block the register budget allows that still gives every SM
    a program (wider blocks recompute the intra-chunk matrices fewer times), narrowing to 16."""
    bv = dv
    while bv > 16 and (dk * bv > STATE_REGS_PER_THREAD * 32 * MAX_WARPS or batch * heads * (dv // bv) < num_sms):
        bv //= 2
    return bv, _warps(dk, bv)


def _warps(dk: int, bv: int) -> int:
    return max(4, min(MAX_WARPS, dk * bv // (32 * STATE_REGS_PER_THREAD)))


def kda_chunked_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, scale: float, chunk_size: int = 64, *, block_v: int | None = None,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel. ``chunk_size`` is validated only (the kernel's chunk is CHUNK; module doc).
    ``block_v`` overrides the column block; ``out`` = (o, final_state) gives contiguous output
    buffers of the right shapes and dtypes to write instead of allocating (tests fill them with NaN
    to check that every element is written)."""
    check_kda(q, k, v, g, beta, state)
    if chunk_size < 1:
        raise ValueError(f"kda_chunked: chunk_size must be >= 1, got {chunk_size}")
    single = q.dim() == 3
    qb, kb, vb, gb, bb, sb = (t.unsqueeze(0) if single else t for t in (q, k, v, g, beta, state))
    B, T, H, dk = qb.shape
    dv = vb.shape[-1]
    if out is None:
        o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        final = torch.empty(state.shape, dtype=torch.float32, device=state.device)
    else:
        o, final = out
        for name, t, like, dtype in (("out[0]", o, v, v.dtype), ("out[1]", final, state, torch.float32)):
            if t.shape != like.shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"kda_chunked_fwd: {name} must be contiguous {tuple(like.shape)} {dtype}, "
                                 f"got {tuple(t.shape)} {t.dtype} (contiguous: {t.is_contiguous()})")
    if B == 0 or H == 0:
        return o, final
    if block_v is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        bv, warps = pick_block_v(B, H, dk, dv, sms)
    else:
        bv, warps = block_v, _warps(dk, block_v)
    if bv < 16 or dv % bv or bv & (bv - 1):
        raise ValueError(f"kda_chunked_fwd: block_v {bv} must be a power of two >= 16 dividing dv={dv}")
    _kda_chunk_kernel[(dv // bv, H, B)](
        qb, kb, vb, gb, bb, sb, o, final,
        T, H, float(scale),
        *qb.stride(), *kb.stride(), *vb.stride(), *gb.stride(), *bb.stride(), *sb.stride(),
        DK=dk, DV=dv, BV=bv, BT=CHUNK, DOT_PRECISION=DOT_PRECISION, num_warps=warps,
    )
    return o, final
