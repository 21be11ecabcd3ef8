"""``torch.ops.k3trt.merge_attn_states``: exact merge of two partial attention results.

    out, lse = torch.ops.k3trt.merge_attn_states(out_a, lse_a, out_b, lse_b)

out_a, out_b [T, H, d_v] (bf16 / fp16 / fp32, same dtype), lse_a, lse_b [T, H] fp32 natural-log
sums of exp over each side's keys. Returns out [T, H, d_v] in out_a's dtype and lse [T, H] fp32:
``m = max(a, b)``, ``out = (e^{a-m}·A + e^{b-m}·B) / (e^{a-m} + e^{b-m})``,
``lse = m + log(e^{a-m} + e^{b-m})``. A side whose lse is -inf contributes nothing (its out is not
read, so garbage there is harmless); both -inf gives out = 0, lse = -inf. Arithmetic in fp32.
On CUDA a one-pass Triton kernel is used (the torch form is ~10 elementwise passes over out; the
kernel was checked on the H200, not timed on its own).
"""

from __future__ import annotations

import torch

from . import dispatch
from .merge_ref import check_merge_attn_states, merge_attn_states_ref, merge_attn_states_unsupported
from .onnx_spec import F32, FLOATS, OnnxOp, params

__all__ = ["merge_attn_states", "merge_attn_states_ref", "ONNX"]


@torch.library.custom_op("k3trt::merge_attn_states", mutates_args=())
def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_merge_attn_states(out_a, lse_a, out_b, lse_b)
    return merge_attn_states_ref(out_a, lse_a, out_b, lse_b)


@merge_attn_states.register_kernel("cuda")
def _merge_attn_states_cuda(out_a, lse_a, out_b, lse_b):
    check_merge_attn_states(out_a, lse_a, out_b, lse_b)
    return dispatch.call("merge_attn_states", merge_attn_states_unsupported(out_a, out_b), "mla_triton.merge_two",
                         merge_attn_states_ref, out_a, lse_a, out_b, lse_b)


@merge_attn_states.register_fake
def _merge_fake(out_a, lse_a, out_b, lse_b):
    return torch.empty_like(out_a), torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)


ONNX = (
    OnnxOp("merge_attn_states", "MergeAttnStates",
           params("out_a", FLOATS) + params("lse_a", F32) + params("out_b", FLOATS) + params("lse_b", F32),
           params("out", FLOATS) + params("lse", F32),
           "Exact LSE merge of two partial attention results."),
)
