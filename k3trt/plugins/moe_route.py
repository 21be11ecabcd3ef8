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

from . import dispatch
from .moe_route_ref import check_moe_combine, check_moe_route, moe_combine_reference, moe_route_reference

__all__ = ["moe_route", "moe_combine", "moe_route_reference", "moe_combine_reference"]


@torch.library.custom_op("k3trt::moe_route", mutates_args=())
def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, sigmoid: bool, renormalize: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_moe_route(logits, bias, k)
    return moe_route_reference(logits, bias, k, sigmoid, renormalize, scale)


@moe_route.register_fake
def _(logits, bias, k, sigmoid, renormalize, scale):
    T = logits.shape[0]
    return logits.new_empty(T, k, dtype=torch.int64), logits.new_empty(T, k)


@moe_route.register_kernel("cuda")
def _moe_route_cuda(logits, bias, k, sigmoid, renormalize, scale):
    check_moe_route(logits, bias, k)
    # no fallback: the kernel covers every call that passes the check
    return dispatch.call("moe_route", None, "moe_route_triton.moe_route_fwd", moe_route_reference,
                         logits, bias, k, sigmoid, renormalize, scale)


@torch.library.custom_op("k3trt::moe_combine", mutates_args=())
def moe_combine(y: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_local: int) -> torch.Tensor:
    check_moe_combine(y, ids, weights)
    return moe_combine_reference(y, ids, weights, num_local)


@moe_combine.register_fake
def _(y, ids, weights, num_local):
    return y.new_empty(ids.shape[0], y.shape[1])


@moe_combine.register_kernel("cuda")
def _moe_combine_cuda(y, ids, weights, num_local):
    check_moe_combine(y, ids, weights)
    return dispatch.call("moe_combine", None, "moe_route_triton.moe_combine_fwd", moe_combine_reference,
                         y, ids, weights, num_local)
