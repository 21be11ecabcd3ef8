"""Triton kernels behind ``k3trt::mla_verify`` and ``k3trt::merge_attn_states`` (CUDA only;
imported lazily by those ops, so importing k3trt never needs triton).

The verification kernel folds a request's Q rows × H heads into the tile's M dimension (m = j·H + h,
so the rows of one request are contiguous in q), streams the request's pages through shared memory
once per M tile (the M tiles of one request run side by side, repeats hit L2), keeps an online
softmax in base 2 and splits long contexts over ``plan.num_splits`` programs whose fp32 partials a
second kernel merges by LSE. Cache rows are [kv_c | rope]: the dot over all D columns gives the
scores and the first d_v columns are the values, so each chunk is loaded once for both.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .plans import VerifyPlan, split_scratch

LOG2E = 1.4426950408889634
CHUNK_TOKENS = 2048  # page ids held in registers per outer step


@triton.jit
def _local_len(length, size, rank, interleave):
    span = size * interleave
    tail = tl.minimum(tl.maximum(length % span - rank * interleave, 0), interleave)
    return (length // span) * interleave + tail


# lengths-independent integers stay unspecialised: one binary serves every head count, split
# count and DCP layout of a tile shape, so a plan's warm-up covers the launches that follow
_RUNTIME_INTS = ["stride_bt", "rows_per_req", "num_heads", "q_per_req", "num_splits",
                 "min_split_tokens", "dcp_size", "dcp_rank", "dcp_interleave", "sp_chunk",
                 "sp_sink", "sp_stride", "sp_recent"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _mla_verify_kernel(
    Q, KV, BT, SL, O, LSE, OP, LSEP,
    qk_scale, v_scale, stride_bt, rows_per_req, num_heads, q_per_req, num_splits, min_split_tokens,
    dcp_size, dcp_rank, dcp_interleave, sp_chunk, sp_sink, sp_stride, sp_recent,
    PAGE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_PAGES: tl.constexpr, TILES_PER_PAGE: tl.constexpr,
    SPLIT: tl.constexpr, SPARSE: tl.constexpr, KV_FP8: tl.constexpr, DV_SPLIT: tl.constexpr,
):
    _mla_verify_tile(Q, KV, BT, SL, O, LSE, OP, LSEP, qk_scale, v_scale, stride_bt, rows_per_req,
                     num_heads, q_per_req, num_splits, min_split_tokens, dcp_size, dcp_rank,
                     dcp_interleave, sp_chunk, sp_sink, sp_stride, sp_recent, PAGE, DV, DR,
                     BLOCK_M, BLOCK_N, CHUNK_PAGES, TILES_PER_PAGE, SPLIT, SPARSE, KV_FP8, DV_SPLIT)


@triton.jit
def _mla_verify_tile(
    Q, KV, BT, SL, O, LSE, OP, LSEP,
    qk_scale, v_scale, stride_bt, rows_per_req, num_heads, q_per_req, num_splits, min_split_tokens,
    dcp_size, dcp_rank, dcp_interleave, sp_chunk, sp_sink, sp_stride, sp_recent,
    PAGE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_PAGES: tl.constexpr, TILES_PER_PAGE: tl.constexpr,
    SPLIT: tl.constexpr, SPARSE: tl.constexpr, KV_FP8: tl.constexpr, DV_SPLIT: tl.constexpr,
):
    D: tl.constexpr = DV + DR
    DVT: tl.constexpr = DV // DV_SPLIT
    # with DV_SPLIT = 2 a pair of adjacent programs shares an M tile, each owning half of the
    # output columns and computing the full scores itself: one warpgroup per program, so the
    # softmax needs no exchange between warpgroups (the pair's second KV read comes from L2)
    pid_m = tl.program_id(0) // DV_SPLIT
    pid_v = tl.program_id(0) % DV_SPLIT
    pid_s = tl.program_id(1)
    b = tl.program_id(2)

    length = tl.load(SL + b)
    n = _local_len(length, dcp_size, dcp_rank, dcp_interleave)
    n_tiles = tl.cdiv(n, BLOCK_N)
    # the split count is fixed by the plan; a short request spreads over fewer splits so that no
    # split holds a sliver (the others find an empty range and only write lse = -inf). Splits
    # start on page boundaries so that a chunk's page ids are one aligned slice of the table.
    active = tl.maximum(tl.minimum(num_splits, tl.cdiv(n, min_split_tokens)), 1)
    per = tl.cdiv(tl.cdiv(n_tiles, active), TILES_PER_PAGE) * TILES_PER_PAGE
    t_lo = pid_s * per
    t_hi = tl.minimum(t_lo + per, n_tiles)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows_per_req
    vis = _local_len(tl.maximum(length - (q_per_req - 1 - offs_m // num_heads), 0),
                     dcp_size, dcp_rank, dcp_interleave)
    row = b.to(tl.int64) * rows_per_req + offs_m
    offs_v = pid_v * DVT + tl.arange(0, DVT)           # this program's value columns
    offs_w = (1 - pid_v) * DVT + tl.arange(0, DVT)     # the rest of kv_c (scores only)
    offs_r = tl.arange(0, DR)
    q_ptr = Q + row[:, None] * D
    qn = tl.load(q_ptr + offs_v[None, :], mask=m_ok[:, None], other=0.0)
    if DV_SPLIT == 2:
        qw = tl.load(q_ptr + offs_w[None, :], mask=m_ok[:, None], other=0.0)
    qr = tl.load(q_ptr + DV + offs_r[None, :], mask=m_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DVT], tl.float32)
    n_chunks = tl.cdiv(n, tl.maximum(sp_chunk, 1))
    offs_p = tl.arange(0, CHUNK_PAGES)
    offs_t = tl.arange(0, BLOCK_N)
    n_pages = tl.cdiv(n, PAGE)
    for c in range(t_lo, t_hi, CHUNK_PAGES * TILES_PER_PAGE):
        # the chunk's page ids sit in registers, so the inner loop's KV addresses depend on no
        # load of its own and the pipeliner can issue them num_stages - 1 steps ahead
        pg0 = c // TILES_PER_PAGE
        pages = tl.load(BT + b * stride_bt + pg0 + offs_p, mask=pg0 + offs_p < n_pages, other=0)
        for t in range(c, tl.minimum(c + CHUNK_PAGES * TILES_PER_PAGE, t_hi)):
            page = tl.sum(tl.where(offs_p == t // TILES_PER_PAGE - pg0, pages, 0), 0)
            offs_n = t * BLOCK_N + offs_t
            n_ok = offs_n < n
            if SPARSE:
                c_id = offs_n // sp_chunk
                n_ok &= ((c_id < sp_sink) | (c_id >= n_chunks - sp_recent)
                         | ((c_id - sp_sink) % sp_stride == 0))
            row0 = page.to(tl.int64) * PAGE + (t % TILES_PER_PAGE) * BLOCK_N
            kv_ptr = KV + (row0 + offs_t)[:, None] * D
            kn = tl.load(kv_ptr + offs_v[None, :], mask=n_ok[:, None], other=0.0)
            kr = tl.load(kv_ptr + DV + offs_r[None, :], mask=n_ok[:, None], other=0.0)
            if KV_FP8:
                kn = kn.to(qn.dtype)
                kr = kr.to(qn.dtype)
            s = tl.dot(qn, tl.trans(kn))
            if DV_SPLIT == 2:
                kw = tl.load(kv_ptr + offs_w[None, :], mask=n_ok[:, None], other=0.0)
                s = tl.dot(qw, tl.trans(kw.to(qn.dtype)), s)
            s = tl.dot(qr, tl.trans(kr), s) * qk_scale
            s = tl.where((offs_n[None, :] < vis[:, None]) & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(kn.dtype), kn, acc * alpha[:, None])
            m_i = m_new

    seen = l_i > 0
    o = tl.where(seen[:, None], acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634,
                   float("-inf"))
    if SPLIT:
        prow = row * num_splits + pid_s
        tl.store(LSEP + prow, lse, mask=m_ok & (pid_v == 0))
        # an empty split is never read back (its lse is -inf), so skip its 2 KB per row
        tl.store(OP + prow[:, None] * DV + offs_v[None, :], o, mask=(m_ok & seen)[:, None])
    else:
        tl.store(O + row[:, None] * DV + offs_v[None, :], o.to(O.dtype.element_ty),
                 mask=m_ok[:, None])
        tl.store(LSE + row, lse, mask=m_ok & (pid_v == 0))


@triton.jit
def _merge_splits_kernel(OP, LSEP, O, LSE, num_splits, DV: tl.constexpr, S_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, S_BLOCK)
    lse = tl.load(LSEP + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(tl.exp(lse - mx), 0)
    offs_v = tl.arange(0, DV)
    acc = tl.zeros([DV], tl.float32)
    for s in range(num_splits):
        ls = tl.load(LSEP + row * num_splits + s)
        if ls > float("-inf"):
            acc += tl.exp(ls - mx) * tl.load(OP + (row * num_splits + s) * DV + offs_v)
    seen = total > 0
    out = tl.where(seen, acc / tl.where(seen, total, 1.0), 0.0)
    tl.store(O + row * DV + offs_v, out.to(O.dtype.element_ty))
    tl.store(LSE + row, tl.where(seen, mx + tl.log(tl.where(seen, total, 1.0)), float("-inf")))


@triton.jit
def _merge_two_kernel(OA, LA, OB, LB, O, L, n_rows, DV: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < n_rows
    a = tl.load(LA + rows, mask=r_ok, other=float("-inf"))
    b = tl.load(LB + rows, mask=r_ok, other=float("-inf"))
    m = tl.maximum(a, b)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(a - m)
    wb = tl.exp(b - m)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    offs = rows[:, None] * DV + tl.arange(0, DV)[None, :]
    oa = tl.load(OA + offs, mask=(r_ok & (wa > 0))[:, None], other=0.0).to(tl.float32)
    ob = tl.load(OB + offs, mask=(r_ok & (wb > 0))[:, None], other=0.0).to(tl.float32)
    out = (oa * wa[:, None] + ob * wb[:, None]) * inv[:, None]
    tl.store(O + offs, out.to(O.dtype.element_ty), mask=r_ok[:, None])
    tl.store(L + rows, tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)),
                                float("-inf")), mask=r_ok)


def mla_verify_fwd(plan: VerifyPlan, q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale,
                   kv_scale=1.0, d_v=512, dcp_size=1, dcp_rank=0, dcp_interleave=1,
                   sparse_chunk=0, sparse_sink=1, sparse_stride=1, sparse_recent=1, *,
                   out=None, lse=None, poison_scratch=False):
    """Launch per `plan` (callers check support first: mla_verify_ref.mla_verify_unsupported).
    Tests pass NaN-filled `out` / `lse` and `poison_scratch` to prove every element is written
    and no unwritten partial is read."""
    batch, heads, width = block_table.shape[0], q.shape[1], q.shape[2]
    rows = batch * q_per_req * heads
    if out is None:
        out = torch.empty(batch * q_per_req, heads, d_v, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(batch * q_per_req, heads, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out, lse
    splits = plan.num_splits
    part_o, part_lse = split_scratch(rows, splits, d_v, q.device, poison_scratch) if splits > 1 \
        else (out, lse)  # unused without splits
    cfg = plan.config
    page = kv_cache.shape[1]
    block_n = math.gcd(cfg.block_n, page)  # a tile never straddles two pages
    _mla_verify_kernel[(plan.m_tiles * cfg.dv_split, splits, batch)](
        q, kv_cache, block_table, seq_lens, out, lse, part_o, part_lse,
        softmax_scale * kv_scale * LOG2E, kv_scale, block_table.stride(0), q_per_req * heads,
        heads, q_per_req, splits, plan.min_split_tokens, dcp_size, dcp_rank, dcp_interleave,
        sparse_chunk, sparse_sink, sparse_stride, sparse_recent,
        PAGE=page, DV=d_v, DR=width - d_v, BLOCK_M=cfg.block_m, BLOCK_N=block_n,
        CHUNK_PAGES=triton.next_power_of_2(max(1, CHUNK_TOKENS // page)),
        TILES_PER_PAGE=page // block_n, SPLIT=splits > 1,
        SPARSE=sparse_chunk > 0 and sparse_stride > 1, KV_FP8=kv_cache.dtype == torch.float8_e4m3fn,
        DV_SPLIT=cfg.dv_split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        _merge_splits_kernel[(rows,)](part_o, part_lse, out, lse, splits, DV=d_v,
                                      S_BLOCK=triton.next_power_of_2(splits), num_warps=4)
    return out, lse


def merge_two(out_a, lse_a, out_b, lse_b):
    """One-pass LSE merge of two partials ([T, H, d_v] contiguous + [T, H] of any float dtype)."""
    lse_a, lse_b = lse_a.float().contiguous(), lse_b.float().contiguous()
    d_v = out_a.shape[-1]
    rows = lse_a.numel()
    out = torch.empty_like(out_a)
    lse = torch.empty_like(lse_a)
    if rows:
        block_r = max(1, 4096 // d_v)
        _merge_two_kernel[(triton.cdiv(rows, block_r),)](out_a, lse_a, out_b, lse_b, out, lse, rows,
                                                          DV=d_v, BLOCK_R=block_r, num_warps=4)
    return out, lse
