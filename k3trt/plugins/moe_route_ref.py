"""Plain-torch side of ``k3trt::moe_route`` and ``k3trt::moe_combine`` (moe_route.py has the ops and
their layouts): the references and the argument checks. Imported by the ops and the tests alike.
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


def check_moe_route(logits, bias, k):
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"moe_route: logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    if bias is not None and bias.shape != (logits.shape[1],):
        raise ValueError(f"moe_route: bias {tuple(bias.shape)} does not fit {logits.shape[1]} experts")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"moe_route: k={k} outside [1, {logits.shape[1]}]")


def check_moe_combine(y, ids, weights):
    if ids.dim() != 2 or weights.shape != ids.shape or y.dim() != 2 or y.shape[0] != ids.numel():
        raise ValueError(f"moe_combine: y {tuple(y.shape)}, ids {tuple(ids.shape)} and weights "
                         f"{tuple(weights.shape)} do not fit [T·k, W], [T, k], [T, k]")
