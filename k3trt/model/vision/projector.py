"""The patch merge and the projector into the language model's hidden size.

Merge: each kh×kw block of patches becomes one token of kh·kw·hidden values (block order
row-major, slots row-major within it), averaged over a clip's frames. Projector (the published
``mm_projector``): LayerNorm per patch, Linear(kh·kw·hidden → same), GELU, Linear(→ text hidden).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3trt.model.vision.geometry import VisionBatch
from k3trt.model.vision.tower import ACT
from k3trt.vision_config import VisionConfig


def merge(x: Tensor, batch: VisionBatch, rows: int) -> Tensor:
    """x [P, hidden] -> [rows, hidden] fp32 (rows = tokens · kh·kw): slot merge_dest of each patch
    gets merge_weight · x; padding rows carry weight 0 and change nothing."""
    out = x.new_zeros(rows, x.shape[1], dtype=torch.float32)
    return out.index_add(0, batch.merge_dest, x.float() * batch.merge_weight[:, None])


class Projector(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.area = cfg.merge_area
        self.pre_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.projection_layer_norm_eps)
        # proj.1 is the activation (no weights): the published names are proj.0 and proj.2
        self.proj = nn.Sequential(nn.Linear(cfg.merged_size, cfg.merged_size), nn.Identity(),
                                  nn.Linear(cfg.merged_size, cfg.text_hidden_size))
        self.act = ACT[cfg.projector_hidden_act]

    def forward(self, merged: Tensor) -> Tensor:
        """merged [tokens · kh·kw, hidden] -> [tokens, text hidden]."""
        x = self.pre_norm(merged.to(self.pre_norm.weight.dtype)).reshape(-1, self.area * merged.shape[1])
        return self.proj[2](self.act(self.proj[0](x)))
