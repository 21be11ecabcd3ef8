"""Plain-torch side of ``k3trt::moe_gemm`` (moe_gemm.py has the op and its layouts): the reference
and the argument checks. Imported by the op and the tests alike.
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


def check_moe_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, src_rows: torch.Tensor | None = None,
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
