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

The torch body below (``attn_res_reference``) runs everywhere; on CUDA a single Triton kernel
(attn_res_triton.py, imported on the first CUDA call so importing k3trt never needs triton)
replaces its ~45 small kernels.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from k3trt.plugins.norm_act import rms_norm_reference

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the kernel holds every source in one tile row; past this it falls back (the full K3 needs ~30)
MAX_KERNEL_SOURCES = 64


def attn_res_reference(prefix: Tensor, delta: Tensor | None, blocks: Tensor, w_norm: Tensor, w_q: Tensor,
                       out_norm: Tensor | None, num_blocks: int, write_idx: int,
                       eps: float) -> tuple[Tensor, Tensor]:
    """k3trt.model.attn_res.attn_res, except that new_prefix never aliases prefix."""
    if delta is not None:
        prefix = (prefix.float() + delta.float()).to(prefix.dtype)
    else:
        prefix = prefix.clone()
    if write_idx >= 0:
        blocks[:, write_idx] = prefix
    sources = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1)                  # [T, S, H]
    logits = (rms_norm_reference(sources, w_norm, eps).float() * w_q.float()[0]).sum(-1)    # [T, S]
    alpha = logits.softmax(-1)
    mixed = (alpha[..., None] * sources.float()).sum(1).to(prefix.dtype)
    return (rms_norm_reference(mixed, out_norm, eps) if out_norm is not None else mixed), prefix


def check_args(prefix: Tensor, delta: Tensor | None, blocks: Tensor, w_norm: Tensor, w_q: Tensor,
               out_norm: Tensor | None, num_blocks: int, write_idx: int, eps: float) -> None:
    """ValueError naming the bad argument; shapes, dtypes and devices only (no device reads)."""
    if prefix.dim() != 2 or not prefix.is_floating_point():
        raise ValueError(f"attn_res: prefix must be a float [T, H] tensor, got {prefix.dtype} {tuple(prefix.shape)}")
    T, H = prefix.shape
    if delta is not None and (delta.shape != prefix.shape or not delta.is_floating_point()):
        raise ValueError(f"attn_res: delta must be a float tensor shaped like prefix {(T, H)}, "
                         f"got {delta.dtype} {tuple(delta.shape)}")
    if blocks.dim() != 3 or blocks.shape[0] != T or blocks.shape[2] != H:
        raise ValueError(f"attn_res: blocks must be [T={T}, NB, H={H}], got {tuple(blocks.shape)}")
    if blocks.dtype != prefix.dtype:
        # torch.cat would promote the sources to a wider dtype and move every rounding point
        raise ValueError(f"attn_res: blocks dtype {blocks.dtype} != prefix dtype {prefix.dtype}")
    for name, w, shape in (("w_norm", w_norm, (H,)), ("w_q", w_q, (1, H)), ("out_norm", out_norm, (H,))):
        if w is not None and (tuple(w.shape) != shape or not w.is_floating_point()):
            raise ValueError(f"attn_res: {name} must be a float tensor of shape {shape}, "
                             f"got {w.dtype} {tuple(w.shape)}")
    NB = blocks.shape[1]
    if not 0 <= num_blocks <= NB:
        raise ValueError(f"attn_res: num_blocks must be in [0, {NB}] (blocks has NB={NB}), got {num_blocks}")
    if not -1 <= write_idx < NB:
        raise ValueError(f"attn_res: write_idx must be -1 or in [0, {NB}), got {write_idx}")
    if not eps >= 0:
        raise ValueError(f"attn_res: eps must be >= 0, got {eps}")
    for name, t in (("delta", delta), ("blocks", blocks), ("w_norm", w_norm), ("w_q", w_q), ("out_norm", out_norm)):
        if t is not None and t.device != prefix.device:
            raise ValueError(f"attn_res: {name} is on {t.device}, prefix on {prefix.device}")


@torch.library.custom_op("k3trt::attn_res", mutates_args=("blocks",))
def attn_res(prefix: Tensor, delta: Tensor | None, blocks: Tensor, w_norm: Tensor, w_q: Tensor,
             out_norm: Tensor | None, num_blocks: int, write_idx: int, eps: float) -> tuple[Tensor, Tensor]:
    """One AttnRes read; returns (out, new_prefix). See the module docstring for layouts."""
    check_args(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
    return attn_res_reference(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)


@attn_res.register_fake
def _(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps):
    check_args(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
    shape = tuple(prefix.shape)
    return prefix.new_empty(shape), prefix.new_empty(shape)


@attn_res.register_kernel("cuda")
def _attn_res_cuda(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps):
    check_args(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
    reason = kernel_unsupported(prefix, delta, w_norm, w_q, out_norm, num_blocks)
    if reason:
        _log_fallback(reason)
        return attn_res_reference(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
    from . import attn_res_triton  # lazy: triton is imported only on the CUDA path

    return attn_res_triton.attn_res_fwd(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)


def kernel_unsupported(prefix: Tensor, delta: Tensor | None, w_norm: Tensor, w_q: Tensor,
                       out_norm: Tensor | None, num_blocks: int) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can). Shapes and dtypes only."""
    dtypes = [t.dtype for t in (prefix, delta, w_norm, w_q, out_norm) if t is not None]
    if any(d not in KERNEL_DTYPES for d in dtypes):
        return f"dtypes {sorted({str(d) for d in dtypes})}"
    if num_blocks + 1 > MAX_KERNEL_SOURCES:
        return f"{num_blocks + 1} sources (at most {MAX_KERNEL_SOURCES})"
    return None


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    log.warning("attn_res: Triton kernel does not cover %s; using the torch reference", reason)
