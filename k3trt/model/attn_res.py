"""Attention residuals (AttnRes): each layer reads a learned softmax mix over earlier block summaries.

State per token: ``blocks`` [T, num_blocks, H] (one summary per block of B layers) and a running
``prefix`` [T, H]. It is per token, so it needs no cache across steps.
"""

from __future__ import annotations

import torch
from k3trt.model.layers import rms_norm


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, w_norm: torch.Tensor,
             w_q: torch.Tensor, out_norm: torch.Tensor | None, num_blocks: int, write_idx: int,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's attn_res; returns (read value, updated prefix). `blocks` is written in place.
    w_norm [H] is the sources' RMSNorm weight, w_q [1, H] the rank-1 logit projection."""
    if delta is not None:
        prefix = (prefix.float() + delta.float()).to(prefix.dtype)
    if write_idx >= 0:
        blocks[:, write_idx] = prefix
    sources = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1)                  # [T, S, H]
    logits = (rms_norm(sources, w_norm, eps).float() * w_q.float()[0]).sum(-1)          # [T, S]
    alpha = logits.softmax(-1)
    mixed = (alpha[..., None] * sources.float()).sum(1).to(prefix.dtype)
    return (rms_norm(mixed, out_norm, eps) if out_norm is not None else mixed), prefix
