"""``k3trt::moe_gemm``: the routed experts' grouped GEMM for few rows per expert (decode, verify).

    moe_gemm(x [P, K], w [E, N, K], offs int32 [E], src_rows int64 [P]?, dst_rows int64 [P]?,
             out_rows: int = -1) -> y [P or out_rows, N]

Pair p (0 <= p < P) belongs to expert e when offs[e-1] <= p < offs[e] (offs[-1] = 0), and
y[dst(p)] = x[src(p)] @ w[e].T, where src(p) = src_rows[p] (p without src_rows) and dst(p) =
dst_rows[p] (p without). So the MoE gathers its tokens and scatters its results back to
(token, choice) order inside the GEMMs instead of in separate copies. Pairs at or past offs[E-1]
belong to no expert here (another EP rank's): their output rows are unspecified, as with
torch._grouped_mm, whose ``offs`` means the same. y has P rows, or out_rows when given.

Why a kernel of our own: at batch 1 to 32 an expert sees 1 to ~16 rows and the step is bound by
reading its weights once; torch's grouped GEMM (CUTLASS, 128-row tiles) reads them at 0.5-0.65 of
the copy bandwidth there on the H200. The Triton kernel (moe_gemm_triton.py) tiles N and streams
K, one program per (N tile, expert), with row tiles sized to the step's mean rows per expert;
experts without rows return at once. Larger batches keep torch's kernel (``use_kernel``).
"""

from __future__ import annotations

import torch


def moe_gemm_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, src_rows: torch.Tensor | None = None,
                       dst_rows: torch.Tensor | None = None, out_rows: int = -1) -> torch.Tensor:
    """Per-expert matmuls in fp32, rounded to x's dtype; rows no pair writes are zero."""
    P = pairs(x, src_rows)
    y = x.new_zeros(out_rows if out_rows >= 0 else P, w.shape[1])
    src = src_rows if src_rows is not None else torch.arange(P, device=x.device)
    dst = dst_rows if dst_rows is not None else torch.arange(P, device=x.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            y[dst[start:end]] = (x[src[start:end]].float() @ w[e].float().t()).to(x.dtype)
        start = end
    return y


def pairs(x: torch.Tensor, src_rows: torch.Tensor | None) -> int:
    return src_rows.shape[0] if src_rows is not None else x.shape[0]


def check(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, src_rows: torch.Tensor | None = None,
          dst_rows: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"moe_gemm: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit [P, K], [E, N, K]")
    for name, rows in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
            raise ValueError(f"moe_gemm: {name} must be int64 [P], got {rows.dtype} {tuple(rows.shape)}")
    if src_rows is not None and dst_rows is not None and src_rows.shape != dst_rows.shape:
        raise ValueError(f"moe_gemm: src_rows {tuple(src_rows.shape)} and dst_rows {tuple(dst_rows.shape)} differ")
    if offs.shape != (w.shape[0],) or offs.dtype != torch.int32:
        raise ValueError(f"moe_gemm: offs must be int32 [{w.shape[0]}] (one group end per expert), "
                         f"got {offs.dtype} {tuple(offs.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"moe_gemm: x is {x.dtype} but w is {w.dtype}")


@torch.library.custom_op("k3trt::moe_gemm", mutates_args=())
def moe_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, src_rows: torch.Tensor | None = None,
             dst_rows: torch.Tensor | None = None, out_rows: int = -1) -> torch.Tensor:
    check(x, w, offs, src_rows, dst_rows)
    return moe_gemm_reference(x, w, offs, src_rows, dst_rows, out_rows)


@moe_gemm.register_fake
def _(x, w, offs, src_rows=None, dst_rows=None, out_rows=-1):
    return x.new_empty(out_rows if out_rows >= 0 else pairs(x, src_rows), w.shape[1])


@moe_gemm.register_kernel("cuda")
def _moe_gemm_cuda(x, w, offs, src_rows=None, dst_rows=None, out_rows=-1):
    check(x, w, offs, src_rows, dst_rows)
    from k3trt.plugins import moe_gemm_triton

    return moe_gemm_triton.moe_gemm_fwd(x, w, offs, src_rows, dst_rows, out_rows)


# Up to this many (token, choice) pairs per expert on average the Triton kernel runs; above it
# torch's grouped GEMM. On the H200 at K3's expert sizes (benchmarks/moe_gemm.py,
# results/moe_gemm_h200.json) the configs of moe_gemm_triton.CONFIGS take 0.63-0.82x torch's time
# for one MoE layer's two GEMMs from 1 to 128 tokens (0.5 to 64 pairs per expert); at 512 tokens
# (an earlier sweep, BM <= 64: results/moe_gemm_h200_first.json) torch's was 2x faster.
MAX_PAIRS_PER_EXPERT = 64


def use_kernel(pairs: int, experts: int, x: torch.Tensor) -> bool:
    """Whether Experts should call this op for a step of `pairs` (token, choice) pairs."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and pairs <= MAX_PAIRS_PER_EXPERT * experts
