"""The tower's 2-D RoPE, in the published checkpoint's convention: each head's values are complex
pairs (2i, 2i+1); even pairs turn with the patch's column, odd pairs with its row, pair 2j and
2j+1 at frequency θ^(-4j/head_dim). (transformers' kimi_k25 permutes q/k weights to rotate halves
instead; the parity test checks the two agree.)"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_angles(rope_pos: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """rope_pos int64 [P, 2] (row, col) -> (cos, sin) fp32 [P, head_dim / 2], one per pair."""
    j = torch.arange(0, head_dim // 4, device=rope_pos.device, dtype=torch.float32)
    inv = 1.0 / (theta ** (4.0 * j / head_dim))                             # [head_dim / 4]
    col = rope_pos[:, 1:].float() * inv                                     # even pairs
    row = rope_pos[:, :1].float() * inv                                     # odd pairs
    ang = torch.stack([col, row], dim=-1).flatten(1)                        # [P, head_dim / 2]
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [P, heads, head_dim] rotated pair by pair (in fp32), returned in x's dtype."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)
