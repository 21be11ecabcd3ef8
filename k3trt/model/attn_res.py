"""Attention residuals (AttnRes): each layer reads a learned softmax mix over earlier block summaries.

State per token: ``blocks`` [T, num_blocks, H] (one summary per block of B layers) and a running
``prefix`` [T, H]. It is per token, so it needs no cache across steps.

The math (the spec's attn_res) is ``attn_res_reference`` in plugins/attn_res.py; on the GPU it
runs as one kernel per call (``k3trt::attn_res``) instead of ~45 small ones.
"""

from __future__ import annotations

import torch

from k3trt.model.layers import fused_ops
from k3trt.plugins.attn_res import attn_res_reference


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, w_norm: torch.Tensor,
             w_q: torch.Tensor, out_norm: torch.Tensor | None, num_blocks: int, write_idx: int,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's attn_res; returns (read value, updated prefix). `blocks` is written in place.
    w_norm [H] is the sources' RMSNorm weight, w_q [1, H] the rank-1 logit projection."""
    fn = torch.ops.k3trt.attn_res if fused_ops(prefix) else attn_res_reference
    return fn(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps)
