"""Plain-torch side of ``k3trt::attn_res`` (attn_res.py has the op and its layouts): the reference,
the argument checks and what the Triton kernel covers. Imported by the op and the kernel alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .norm_act_ref import rms_norm_reference

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


def check_attn_res(prefix: Tensor, delta: Tensor | None, blocks: Tensor, w_norm: Tensor, w_q: Tensor,
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


def attn_res_unsupported(prefix: Tensor, delta: Tensor | None, w_norm: Tensor, w_q: Tensor,
                       out_norm: Tensor | None, num_blocks: int) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can). Shapes and dtypes only."""
    dtypes = [t.dtype for t in (prefix, delta, w_norm, w_q, out_norm) if t is not None]
    if any(d not in KERNEL_DTYPES for d in dtypes):
        return f"dtypes {sorted({str(d) for d in dtypes})}"
    if num_blocks + 1 > MAX_KERNEL_SOURCES:
        return f"{num_blocks + 1} sources (at most {MAX_KERNEL_SOURCES})"
    return None
