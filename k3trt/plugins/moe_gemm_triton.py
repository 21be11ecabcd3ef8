"""Triton kernel behind ``k3trt::moe_gemm`` on CUDA (imported on the op's first CUDA call).

    moe_gemm_fwd(x, w, offs, src_rows=None, dst_rows=None, out_rows=-1, *, config=None) -> y

One program per (N tile, expert): it reads offs on the device (no host sync, so a CUDA graph can
hold it), returns at once when its expert has no rows, and otherwise walks the expert's rows in
BM-row tiles, streaming its [BN, K] slice of the expert's weights through BK-wide steps. With at
most BM rows an expert's weights are read exactly once, which is what decode is bound by.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (mean pairs per expert up to, (BM, BN, BK, num_warps, num_stages)); the first row that covers a
# step's mean is its config. BM = 16 is tl.dot's smallest M. An expert with more rows than BM
# reads its weights once per BM-row tile, and routing is uneven (at a mean of 16 about half the
# experts get more), so BM grows ahead of the mean. From the H200 sweeps of benchmarks/moe_gemm.py
# at K3's expert sizes, top-16 of 32 experts (results/moe_gemm_h200.json).
CONFIGS = (
    (1, (16, 32, 128, 4, 5)),
    (2, (16, 32, 256, 4, 4)),
    (8, (16, 128, 128, 4, 3)),
    (16, (32, 64, 128, 4, 3)),
    (32, (64, 128, 128, 8, 4)),
    (float("inf"), (128, 128, 64, 4, 3)),
)


def pick_config(pairs: int, experts: int) -> tuple[int, int, int, int, int]:
    mean = pairs / max(experts, 1)
    return next(cfg for limit, cfg in CONFIGS if mean <= limit)


@triton.jit
def _moe_gemm_kernel(X, W, OFFS, SRC, DST, Y, N, K, sx_p, sw_e, sw_n, sy_p,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GATHER: tl.constexpr, SCATTER: tl.constexpr):
    nb = tl.program_id(0)
    e = tl.program_id(1)
    end = tl.load(OFFS + e)
    start = tl.load(OFFS + tl.maximum(e - 1, 0)) * (e > 0).to(tl.int32)
    if end <= start:
        return
    rn = nb * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    w_rows = W + e.to(tl.int64) * sw_e + rn[:, None] * sw_n
    for m0 in range(start, end, BM):
        rm = m0 + tl.arange(0, BM)
        live = rm < end
        src = tl.load(SRC + rm, mask=live, other=0) if GATHER else rm.to(tl.int64)
        dst = tl.load(DST + rm, mask=live, other=0) if SCATTER else rm.to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + rk
            a = tl.load(X + src[:, None] * sx_p + kk[None, :],
                        mask=live[:, None] & (kk[None, :] < K), other=0.0)
            b = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
        tl.store(Y + dst[:, None] * sy_p + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=live[:, None] & (rn[None, :] < N))


def moe_gemm_fwd(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, src_rows: torch.Tensor | None = None,
                 dst_rows: torch.Tensor | None = None, out_rows: int = -1, *,
                 config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    (_, K), (E, N, _) = x.shape, w.shape
    P = src_rows.shape[0] if src_rows is not None else x.shape[0]
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("moe_gemm: x and w need a contiguous last (K) dimension")
    BM, BN, BK, warps, stages = config or pick_config(P, E)
    y = x.new_empty(out_rows if out_rows >= 0 else P, N)
    if P == 0 or E == 0:
        return y
    # an absent index tensor is never read (GATHER / SCATTER off): pass x as a placeholder
    _moe_gemm_kernel[(triton.cdiv(N, BN), E)](
        x, w, offs, x if src_rows is None else src_rows, x if dst_rows is None else dst_rows, y,
        N, K, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
        BM=BM, BN=BN, BK=BK, GATHER=src_rows is not None, SCATTER=dst_rows is not None,
        num_warps=warps, num_stages=stages)
    return y
