"""Projections that read the same input, fused into one GEMM at run time.

A KDA layer multiplies its input by six matrices (q, k, v, the output gate, the decay's low-rank
a, beta), a gated MLP by two, the routed experts by two per expert. At decode sizes each GEMM is a
launch and a pass over weights too small to reach the copy bandwidth alone, so the engine
concatenates them once (``fuse_projections_``) and the modules run one GEMM and split its output.

The checkpoint layout, the parameter names and the TensorRT export do not change: after fusing,
every original parameter is a view into the fused tensor, so state_dict(), in-place weight loads
and init_random_ still see (and write) the same memory. Replacing a parameter's .data afterwards
(e.g. ``model.to(...)``) would detach it from the fused tensor: fuse after the model is final.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def fuse_params_(params: list[nn.Parameter], dim: int) -> torch.Tensor:
    """Concatenate `params` along `dim` into one tensor and make each a view of its slice."""
    with torch.no_grad():
        fused = torch.cat([p.data for p in params], dim)
        start = 0
        for p in params:
            n = p.shape[dim]
            p.data = fused.narrow(dim, start, n)
            start += n
    return fused


def fuse_projections_(model: nn.Module) -> int:
    """Fuse every module that knows how (a ``fuse_()`` method); returns how many were fused.
    Idempotent: a fused module returns False from fuse_()."""
    n = sum(bool(m.fuse_()) for m in model.modules() if m is not model and hasattr(m, "fuse_"))
    if n:
        log.info("fused the projections of %d modules", n)
    return n
