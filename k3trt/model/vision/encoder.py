"""``VisionEncoder``: tower + merge + projector, pixels to the language model's embeddings.

``forward(pixel_values [n_patches, 3, p, p], grid_thws int64 [n_images, 3])`` returns
[sum of num_image_tokens, text hidden], the images' tokens in image order. ``encode`` takes the
host metadata (geometry.vision_batch) instead of the grids, optionally padded to a capacity;
the exported per-capacity graph is ``encode(attention="masked")`` over a padded batch.
"""

from __future__ import annotations

from torch import Tensor, nn

from k3trt.model.vision.geometry import VisionBatch, vision_batch
from k3trt.model.vision.projector import Projector, merge
from k3trt.model.vision.tower import MoonViT
from k3trt.vision_config import VisionConfig


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = MoonViT(cfg)
        self.mm_projector = Projector(cfg)

    def forward(self, pixel_values: Tensor, grid_thws: Tensor) -> Tensor:
        batch = vision_batch(self.cfg, grid_thws)
        if pixel_values.shape[0] != batch.num_patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches; grid_thws {list(batch.grids)} "
                             f"need {batch.num_patches}")
        return self.encode(pixel_values, batch.to(pixel_values.device))[: batch.num_tokens]

    def encode(self, pixel_values: Tensor, batch: VisionBatch, attention: str = "auto") -> Tensor:
        """pixel_values [P, 3, p, p] (P = batch rows) -> [P / (kh·kw), text hidden]; rows past
        batch.num_tokens are padding. `attention`: tower.ATTENTION's ways, or "auto"; a padded
        batch needs "masked"."""
        p = self.cfg.patch_size
        if tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [patches, 3, {p}, {p}], got {tuple(pixel_values.shape)}")
        if pixel_values.shape[0] != batch.num_patches and attention != "masked":
            raise ValueError(f"a batch padded to {pixel_values.shape[0]} patches ({batch.num_patches} real) runs with "
                             "attention='masked' (the other paths read only the real patches)")
        x = self.vision_tower(pixel_values, batch, attention)
        return self.mm_projector(merge(x, batch, pixel_values.shape[0]))
