"""``k3trt::moe_route`` and ``k3trt::moe_combine``: the MoE's routing and its weighted sum, one
kernel each on the GPU (in torch they are ~8 and ~6 small kernels per layer, at decode sizes all
launch cost).

    moe_route(logits fp32 [T, E], bias fp32 [E]?, k: int, sigmoid: bool, renormalize: bool,
              scale: float) -> (ids int64 [T, k], weights fp32 [T, k])

The router of model/moe.py without expert groups: scores = sigmoid(logits) (softmax when not
`sigmoid`); the k best of scores + bias (bias only chooses), best first; weights = their raw
scores, divided by their sum when `renormalize` (floored at 1e-20), times `scale`.

    moe_combine(y [T·k, W] in (token, choice) order, ids int64 [T, k], weights fp32 [T, k],
                num_local: int) -> [T, W] in y's dtype

out[t] = Σ_j weights[t, j] · y[t·k + j] in fp32, over the choices with ids[t, j] < num_local (an
id of num_local or more is another EP rank's expert: its row of y is never read, so garbage there
cannot leak).
"""

from __future__ import annotations

import torch


def moe_route_reference(logits: torch.Tensor, bias: torch.Tensor | None, k: int, sigmoid: bool,
                        renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(logits) if sigmoid else logits.softmax(-1)
    choice = scores + bias if bias is not None else scores
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    return ids, weights * scale


def moe_combine_reference(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_local: int) -> torch.Tensor:
    T, k = ids.shape
    yk = torch.where((ids < num_local)[..., None], y.view(T, k, -1).float(), 0.0)
    return (yk * weights.float()[..., None]).sum(1).to(y.dtype)


def _check_route(logits, bias, k):
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"moe_route: logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    if bias is not None and bias.shape != (logits.shape[1],):
        raise ValueError(f"moe_route: bias {tuple(bias.shape)} does not fit {logits.shape[1]} experts")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"moe_route: k={k} outside [1, {logits.shape[1]}]")


def _check_combine(y, ids, weights):
    if ids.dim() != 2 or weights.shape != ids.shape or y.dim() != 2 or y.shape[0] != ids.numel():
        raise ValueError(f"moe_combine: y {tuple(y.shape)}, ids {tuple(ids.shape)} and weights "
                         f"{tuple(weights.shape)} do not fit [T·k, W], [T, k], [T, k]")


@torch.library.custom_op("k3trt::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, sigmoid: bool, renormalize: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_route(logits, bias, k)
    return moe_route_reference(logits, bias, k, sigmoid, renormalize, scale)


@moe_route.register_fake
def _(logits, bias, k, sigmoid, renormalize, scale):
    T = logits.shape[0]
    return logits.new_empty(T, k, dtype=torch.int64), logits.new_empty(T, k)


@moe_route.register_kernel("cuda")
def _moe_route_cuda(logits, bias, k, sigmoid, renormalize, scale):
    _check_route(logits, bias, k)
    from k3trt.plugins import moe_route_triton

    return moe_route_triton.moe_route_fwd(logits, bias, k, sigmoid, renormalize, scale)


@torch.library.custom_op("k3trt::moe_combine", mutates_args=())
def moe_combine(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_local: int) -> torch.Tensor:
    _check_combine(y, ids, weights)
    return moe_combine_reference(y, ids, weights, num_local)


@moe_combine.register_fake
def _(y, ids, weights, num_local):
    return y.new_empty(ids.shape[0], y.shape[1])


@moe_combine.register_kernel("cuda")
def _moe_combine_cuda(y, ids, weights, num_local):
    _check_combine(y, ids, weights)
    from k3trt.plugins import moe_route_triton

    return moe_route_triton.moe_combine_fwd(y, ids, weights, num_local)
