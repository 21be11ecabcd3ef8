"""Decode context parallelism (DCP) placement: where a global token lives and each rank's local
length. Plain integer (or integer tensor) arithmetic, imported by mla_verify_ref.py and
parallel/cache.py.

Placement (spec K3_MODEL.md, "KV cache and verification"): with D ranks and interleave I, global
token t lives on rank ``(t // I) % D`` at local index ``(t // (D·I))·I + t % I``; each rank stores
its tokens densely in local order in its own paged cache. Rank r's local length for a global
length L is ``(L // (D·I))·I + clamp(L % (D·I) - r·I, 0, I)``.

The one-process simulation of a DCP group (for tests) is dcp_sim.py.
"""

from __future__ import annotations

import torch


def local_len(length, size: int, rank: int, interleave: int = 1):
    """Rank `rank`'s share of the first `length` global tokens (int or integer tensor)."""
    if size == 1:
        return length
    span = size * interleave
    tail = length % span - rank * interleave
    if isinstance(tail, torch.Tensor):
        tail = tail.clamp(0, interleave)
    else:
        tail = min(max(tail, 0), interleave)
    return (length // span) * interleave + tail


def token_rank(t, size: int, interleave: int = 1):
    """The rank that stores global token `t`."""
    return (t // interleave) % size


def local_index(t, size: int, interleave: int = 1):
    """Where global token `t` sits in its rank's dense local order."""
    return (t // (size * interleave)) * interleave + t % interleave
