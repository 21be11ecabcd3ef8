"""``k3trt::attn_res``: one Attention Residuals read (spec/K3_MODEL.md, "AttnRes") as one op.

    out, new_prefix = torch.ops.k3trt.attn_res(prefix, delta, blocks, w_norm, w_q, out_norm,
                                               num_blocks, write_idx, eps)

    prefix, delta  [T, H] bf16 / fp16 / fp32 (delta may be None); any strides
    blocks         [T, NB, H], prefix's dtype, any strides; mutated: blocks[:, write_idx] <- new_prefix
                   when write_idx >= 0 (-1: no write)
    w_norm [H], w_q [1, H], out_norm [H] or None: any float dtype (read as fp32)
    num_blocks     0 <= num_blocks <= NB: the sources are blocks[:, :num_blocks] then new_prefix
    out, new_prefix  [T, H] contiguous, prefix's dtype; new_prefix is a new tensor even without delta

Per token row, rounding where the plain-torch form rounds (so bf16 results agree to ~1 ulp):
``new_prefix = dtype(f32(prefix) + f32(delta))``; ``logit_s = Σ_h f32(dtype(v_s·r_s·w_norm))·w_q``
with ``r_s = rsqrt(mean(v_s²) + eps)``; ``α = softmax(logit)`` (fp32);
``mixed = dtype(Σ_s α_s·v_s)``; ``out = rms_norm(mixed, out_norm)`` (or mixed when out_norm is None).

The torch body (``attn_res_reference``, attn_res_ref.py) runs everywhere; on CUDA a single Triton kernel
(attn_res_triton.py, imported on the first CUDA call so importing k3trt never needs triton)
replaces its ~45 small kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .attn_res_ref import attn_res_reference, attn_res_unsupported, check_attn_res

__all__ = ["attn_res", "attn_res_reference"]


@torch.library.custom_op("k3trt::attn_res", mutates_args=("blocks",))
def attn_res(prefix: Tensor, delta: Tensor | None, blocks: Tensor, w_norm: Tensor, w_q: Tensor,
             out_norm: Tensor | None, num_blocks: int, write_idx: int, eps: float) -> tuple[Tensor, Tensor]:
    """One AttnRes read; returns (out, new_prefix). See the module docstring for layouts."""
    check_attn_res(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
    return attn_res_reference(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)


@attn_res.register_fake
def _(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps):
    check_attn_res(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
    shape = tuple(prefix.shape)
    return prefix.new_empty(shape), prefix.new_empty(shape)


@attn_res.register_kernel("cuda")
def _attn_res_cuda(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps):
    check_attn_res(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
    return dispatch.call("attn_res", attn_res_unsupported(prefix, delta, w_norm, w_q, out_norm, num_blocks),
                         "attn_res_triton.attn_res_fwd", attn_res_reference,
                         prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
