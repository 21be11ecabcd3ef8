"""Triton kernels behind ``k3trt::moe_route`` and ``k3trt::moe_combine`` (moe_route.py has the
semantics; imported on the ops' first CUDA call). No host synchronisation, only the outputs are
allocated: both can be captured in a CUDA graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(LOGITS, BIAS, IDS, WTS, E, s_t, scale,
                  K: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BE)
    ok = e < E
    x = tl.load(LOGITS + t * s_t + e, mask=ok, other=float("-inf"))
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, 0))
        s = p / tl.sum(p, 0)
    c = s
    if HAS_BIAS:
        c = s + tl.load(BIAS + e, mask=ok, other=0.0)
    c = tl.where(ok, c, float("-inf"))
    kk = tl.arange(0, BK)
    ids = tl.zeros((BK,), dtype=tl.int64)
    ws = tl.zeros((BK,), dtype=tl.float32)
    # k rounds of "take the best, then remove it": best first, ties to the lower expert id
    for j in tl.static_range(K):
        best = tl.max(c, 0)
        idx = tl.min(tl.where(c == best, e, BE), 0)
        w = tl.sum(tl.where(e == idx, s, 0.0), 0)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        ws = tl.where(kk == j, w, ws)
        c = tl.where(e == idx, float("-inf"), c)
    if RENORM:
        ws = ws / tl.maximum(tl.sum(ws, 0), 1e-20)
    tl.store(IDS + t * K + kk, ids, mask=kk < K)
    tl.store(WTS + t * K + kk, ws * scale, mask=kk < K)


def moe_route_fwd(logits: torch.Tensor, bias: torch.Tensor | None, k: int, sigmoid: bool, renormalize: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    wts = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, wts
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    BE = triton.next_power_of_2(E)
    _route_kernel[(T,)](logits, logits if bias is None else bias, ids, wts, E, logits.stride(0), float(scale),
                        K=k, BK=triton.next_power_of_2(k), BE=BE, HAS_BIAS=bias is not None,
                        SIGMOID=bool(sigmoid), RENORM=bool(renormalize), num_warps=4 if BE <= 256 else 8)
    return ids, wts


@triton.jit
def _combine_kernel(Y, IDS, WTS, OUT, W, num_local, s_y, s_o, K: tl.constexpr, BW: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BW + tl.arange(0, BW)
    acc = tl.zeros((BW,), dtype=tl.float32)
    for j in range(K):
        expert = tl.load(IDS + t * K + j)
        w = tl.load(WTS + t * K + j)
        # another rank's choice reads nothing: an all-or-nothing mask written as a bound on
        # `cols` (Triton's interpreter rejects a scalar bool broadcast into a block mask)
        width = (expert < num_local).to(tl.int32) * W
        row = tl.load(Y + (t * K + j).to(tl.int64) * s_y + cols, mask=cols < width, other=0.0)
        acc += row.to(tl.float32) * w
    tl.store(OUT + t.to(tl.int64) * s_o + cols, acc.to(OUT.dtype.element_ty), mask=cols < W)


def moe_combine_fwd(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_local: int) -> torch.Tensor:
    (T, k), W = ids.shape, y.shape[1]
    out = y.new_empty(T, W)
    if T == 0:
        return out
    y = y if y.stride(1) == 1 else y.contiguous()
    BW = min(1024, triton.next_power_of_2(W))
    _combine_kernel[(T, triton.cdiv(W, BW))](y, ids.contiguous(), weights.float().contiguous(), out, W,
                                            num_local, y.stride(0), out.stride(0), K=k, BW=BW, num_warps=4)
    return out
