"""Patch embedding: a linear map of each 3×p×p patch, plus the learned 2-D position table
resampled bicubically to the image's grid (and a fixed sinusoid per frame for multi-frame clips)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from k3trt.model.vision.geometry import VisionBatch
from k3trt.vision_config import VisionConfig


class PosEmb(nn.Module):
    """``weight`` [pos_emb_height, pos_emb_width, hidden]: the learned table (published name)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))

    def forward(self, batch: VisionBatch) -> Tensor:
        """[P, hidden] fp32: the table at each patch's position, resampled as F.interpolate(bicubic)."""
        table = self.weight.flatten(0, 1).float()
        # one gather per tap keeps the temporary at [P, hidden] (16× less than gathering all taps)
        out = table[batch.pos_index[:, 0]] * batch.pos_weight[:, :1]
        for k in range(1, batch.pos_index.shape[1]):
            out = out + table[batch.pos_index[:, k]] * batch.pos_weight[:, k:k + 1]
        return out + frame_sinusoid(batch.frame, table.shape[1])


def frame_sinusoid(frame: Tensor, dim: int) -> Tensor:
    """[P, dim] fp32: [sin(f·ω), cos(f·ω)] with ω_i = 10000^(-2i/dim) for frame f >= 0; 0 where f < 0."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=frame.device, dtype=torch.float32) / dim))
    ang = frame.clamp(min=0).float()[:, None] * inv[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=1) * (frame >= 0).float()[:, None]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = PosEmb(cfg)

    def forward(self, pixel_values: Tensor, batch: VisionBatch) -> Tensor:
        """pixel_values [P, 3, p, p] -> [P, hidden] in the weights' dtype."""
        w = self.proj.weight
        # a p×p convolution with stride p over one p×p patch is a matmul over its 3·p·p values
        x = nn.functional.linear(pixel_values.to(w.dtype).flatten(1), w.flatten(1), self.proj.bias)
        return (x.float() + self.pos_emb(batch)).to(w.dtype)
