"""Fused row-wise norm / activation ops (namespace ``k3trt``) for the decode path, where the torch
forms are 8-12 launches of tiny kernels each (launch-bound at batch 1).

``rms_norm(x, weight, eps) -> y``
    x [..., N] (bf16 / fp16 / fp32; last-dim stride 1, rows may be strided), weight [N];
    y = x · rsqrt(mean(x²) + eps) · weight in fp32, returned contiguous in x.dtype.
``gated_act(gate, up, kind, beta, linear_beta) -> y``
    gate, up [..., I] of equal shape (often the two halves of one [T, 2I] projection); kind "silu"
    (y = silu(gate) · up) or "situ" (y = β·tanh(gate/β)·sigmoid(gate) · lb·tanh(up/lb), the up
    clamp skipped when linear_beta is 0.0; beta is unused by silu); fp32 arithmetic, returned
    contiguous in gate.dtype.
``kda_out_gate(o, gate, weight, eps) -> y``
    o [T, H, D] (fp32 from the KDA recurrence), gate [T, H·D] (the model dtype), weight [D];
    y = rms_norm(o per head, fp32) · sigmoid(gate), returned [T, H·D] contiguous in gate.dtype.

The ``*_reference`` functions (norm_act_ref.py) are the model's own math and the ops' bodies on
every device. On CUDA the op runs one Triton kernel (norm_act_triton.py, imported
on the first CUDA call so importing k3trt never needs triton); inputs the kernel does not cover
(fp64, leading dims that need more than two strides, ...) take the reference, with a warning once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .norm_act_ref import (ACTIVATIONS, check_gated_act, check_kda_out_gate, check_rms_norm, gated_act_reference,
                           gated_act_unsupported, kda_out_gate_reference, kda_out_gate_unsupported,
                           rms_norm_reference, rms_norm_unsupported, silu_mul_reference, situ_mul_reference)

__all__ = ["rms_norm", "gated_act", "kda_out_gate", "ACTIVATIONS", "rms_norm_reference", "gated_act_reference",
           "kda_out_gate_reference", "silu_mul_reference", "situ_mul_reference"]


# ----------------------------------------------------------------------------- ops
# The bodies return .contiguous(): the reference follows a permuted input's layout, the kernel and
# the fake implementations do not, and the three must agree.
def _rms_norm_body(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm_reference(x, weight, eps).contiguous()


def _gated_act_body(gate: Tensor, up: Tensor, kind: str, beta: float, linear_beta: float) -> Tensor:
    return gated_act_reference(gate, up, kind, beta, linear_beta).contiguous()


def _kda_out_gate_body(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    return kda_out_gate_reference(o, gate, weight, eps).contiguous()


@torch.library.custom_op("k3trt::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    check_rms_norm(x, weight)
    return _rms_norm_body(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    check_rms_norm(x, weight)
    return x.new_empty(x.shape)


@rms_norm.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps):
    check_rms_norm(x, weight)
    return dispatch.call("rms_norm", rms_norm_unsupported(x, weight), "norm_act_triton.rms_norm_fwd",
                         _rms_norm_body, x, weight, eps)


@torch.library.custom_op("k3trt::gated_act", mutates_args=())
def gated_act(gate: Tensor, up: Tensor, kind: str, beta: float, linear_beta: float) -> Tensor:
    check_gated_act(gate, up, kind, beta)
    return _gated_act_body(gate, up, kind, beta, linear_beta)


@gated_act.register_fake
def _(gate, up, kind, beta, linear_beta):
    check_gated_act(gate, up, kind, beta)
    return gate.new_empty(gate.shape)


@gated_act.register_kernel("cuda")
def _gated_act_cuda(gate, up, kind, beta, linear_beta):
    check_gated_act(gate, up, kind, beta)
    return dispatch.call("gated_act", gated_act_unsupported(gate, up), "norm_act_triton.gated_act_fwd",
                         _gated_act_body, gate, up, kind, beta, linear_beta)


@torch.library.custom_op("k3trt::kda_out_gate", mutates_args=())
def kda_out_gate(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    check_kda_out_gate(o, gate, weight)
    return _kda_out_gate_body(o, gate, weight, eps)


@kda_out_gate.register_fake
def _(o, gate, weight, eps):
    check_kda_out_gate(o, gate, weight)
    return gate.new_empty(gate.shape)


@kda_out_gate.register_kernel("cuda")
def _kda_out_gate_cuda(o, gate, weight, eps):
    check_kda_out_gate(o, gate, weight)
    return dispatch.call("kda_out_gate", kda_out_gate_unsupported(o, gate, weight), "norm_act_triton.kda_out_gate_fwd",
                         _kda_out_gate_body, o, gate, weight, eps)
