"""Image preprocessing as the released Kimi K2.5 image processor does it (transformers'
``Kimi_K25ImageProcessor``): RGB (transparency over white), downscale to the patch budget, pad to
whole merge blocks, scale to [0, 1], normalise, cut into patches.

Resize: never up; by the most restrictive of sqrt(max_patches / patches) and
max_patches_per_side·p / side; then bicubic with antialiasing (torch's, on uint8, which is what
torchvision runs on a CPU). Pad: zeros to a multiple of merge·p on the bottom and right, before
normalising (so padding is (0 - mean) / std).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.nn import functional as F

from k3trt.vision_config import VisionConfig


def resized_size(cfg: VisionConfig, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) in pixels for an image of `height` × `width`."""
    p, side = cfg.patch_size, cfg.max_patches_per_side
    patches = max(1.0, height // p) * max(1.0, width // p)
    scale = min(1.0, math.sqrt(cfg.max_patches / patches), side * p / height, side * p / width)
    h = min(max(1, int(height * scale)), side * p)
    w = min(max(1, int(width * scale)), side * p)
    f_h, f_w = cfg.merge_kernel_size[0] * p, cfg.merge_kernel_size[1] * p
    return (h, w), (-(-h // f_h) * f_h, -(-w // f_w) * f_w)


def image_grid(cfg: VisionConfig, height: int, width: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid preprocessing gives an image of `height` × `width` pixels."""
    _, (ph, pw) = resized_size(cfg, height, width)
    return 1, ph // cfg.patch_size, pw // cfg.patch_size


def to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def image_patches(cfg: VisionConfig, image: Image.Image) -> tuple[Tensor, tuple[int, int, int]]:
    """One image -> (fp32 [h·w, 3, p, p] patches in row-major grid order, (1, h, w))."""
    # contiguous [1, 3, H, W] uint8, the layout the released processor resizes
    rgb = torch.from_numpy(np.asarray(to_rgb(image)).copy()).permute(2, 0, 1)[None].contiguous()
    (h, w), (ph, pw) = resized_size(cfg, rgb.shape[2], rgb.shape[3])
    if (h, w) != tuple(rgb.shape[2:]):
        rgb = F.interpolate(rgb, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    rgb = F.pad(rgb, (0, pw - w, 0, ph - h), value=0)
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(cfg.image_std, dtype=torch.float32)[:, None, None]
    x = (rgb[0].float() / 255.0 - mean) / std
    p = cfg.patch_size
    gh, gw = ph // p, pw // p
    patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
    return patches, (1, gh, gw)


def preprocess(images: list[Image.Image], cfg: VisionConfig) -> tuple[Tensor, Tensor]:
    """Images -> (pixel_values fp32 [sum patches, 3, p, p], grid_thws int64 [n_images, 3]),
    patches in image order (VisionEncoder's input)."""
    if not images:
        raise ValueError("preprocess: no images")
    done = [image_patches(cfg, im) for im in images]
    return torch.cat([p for p, _ in done]), torch.tensor([g for _, g in done], dtype=torch.long)
