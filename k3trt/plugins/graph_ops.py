"""The functional ops exported graphs call where the model calls something a graph cannot hold:
``k3trt::mla_cache_update`` (the cache after ``mla_cache_write``, a new tensor: ONNX has no
in-place update) and ``k3trt::moe_experts`` (the routed experts of ``moe.Experts`` as one op: its
Python loop over the experts with tokens is data-dependent). The builder's export substitutes
them (builder/export.py) and their nodes are MlaCacheWrite and MoeExperts (cache_write.ONNX,
moe_gemm.ONNX); onnxruntime runs those nodes through these ops (plugins/onnx_ort.py).

Not imported by ``k3trt.plugins``: this module imports the model's expert loop, whose module
imports the plugins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3trt.model.layers import ACTIVATIONS
from k3trt.model.moe import Experts
from k3trt.plugins.cache_write_ref import mla_cache_write_reference


@torch.library.custom_op("k3trt::mla_cache_update", mutates_args=())
def mla_cache_update(kv_c: Tensor, k_pe: Tensor, cache: Tensor, slot_mapping: Tensor, kv_scale: float) -> Tensor:
    """Functional ``mla_cache_write``: the cache after the write (a new tensor)."""
    out = cache.clone()
    mla_cache_write_reference(kv_c, k_pe, out, slot_mapping, kv_scale)
    return out


@mla_cache_update.register_fake
def _(kv_c, k_pe, cache, slot_mapping, kv_scale):
    return torch.empty_like(cache)


@torch.library.custom_op("k3trt::moe_experts", mutates_args=())
def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                activation: str, beta: float, linear_beta: float) -> Tensor:
    """The routed experts of moe.Experts as one op; its reference is Experts' own expert loop
    (beta / linear_beta 0 mean unset)."""
    fn = ACTIVATIONS[activation]
    experts = _ExpertWeights(w_gate, w_up, w_down, lambda g, u: fn(g, u, beta or None, linear_beta or None))
    return EXPERTS_LOOP(experts, x, ids, weights)


@moe_experts.register_fake
def _(x, ids, weights, w_gate, w_up, w_down, activation, beta, linear_beta):
    return torch.empty_like(x)


@dataclass
class _ExpertWeights:
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor
    act: object


EXPERTS_LOOP = Experts._loop   # the plain per-expert loop: the op's reference
