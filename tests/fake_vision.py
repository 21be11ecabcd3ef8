"""A stand-in for k3trt.model.vision with the tower's API, for the serving tests: deterministic and
tiny (a seeded linear over each patch, merged by the mean of merge × merge patches). Tests reach it
through one fixture (`vision` in tests/conftest.py), which installs it as
k3trt.model.vision and attaches an encoder to the loaded model.

    VisionConfig                        frozen; `ModelConfig.vision`
    VisionEncoder(vcfg, text_hidden)    forward(pixel_values float [n_patches, 3, p, p],
                                        grid_thws int64 [n_images, 3]) -> [sum tokens, text hidden]
    num_image_tokens(vcfg, grid_thw)    placeholders of one image
    preprocess(images, vcfg)            (pixel_values, grid_thws), patches in image order
    load_image(source, *, max_bytes, max_pixels) -> PIL.Image;  ImageError(ValueError)
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn


class ImageError(ValueError):
    """An image that cannot be used (corrupt, too large, unsupported)."""


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int = 14
    merge_kernel_size: tuple[int, int] = (2, 2)
    max_side_units: int = 4          # a side is at most this many merged patches after the resize


def num_image_tokens(vcfg: VisionConfig, grid_thw) -> int:
    t, h, w = (int(x) for x in grid_thw)
    mh, mw = vcfg.merge_kernel_size
    return t * (h // mh) * (w // mw)


def load_image(source: bytes | str | Path, *, max_bytes: int, max_pixels: int) -> Image.Image:
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    if len(data) > max_bytes:
        raise ImageError(f"image is {len(data)} bytes; the limit is {max_bytes}")
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > max_pixels:
            raise ImageError(f"image has {img.width}x{img.height} pixels; the limit is {max_pixels}")
        img.load()
    except ImageError:
        raise
    except Exception as e:
        raise ImageError(f"cannot decode the image: {e}") from None
    return img.convert("RGB")


def preprocess(images: list[Image.Image], vcfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    p, (mh, mw) = vcfg.patch_size, vcfg.merge_kernel_size
    patches, grids = [], []
    for img in images:
        uh, uw = (max(1, min(vcfg.max_side_units, round(s / (p * m)))) for s, m in ((img.height, mh), (img.width, mw)))
        h, w = uh * mh, uw * mw
        x = torch.from_numpy(np.asarray(img.convert("RGB").resize((w * p, h * p)), dtype=np.float32).copy())
        x = x.permute(2, 0, 1) / 127.5 - 1.0                                       # [3, H, W] in [-1, 1]
        x = x.view(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p)   # row-major patches
        patches.append(x)
        grids.append([1, h, w])
    return torch.cat(patches), torch.tensor(grids, dtype=torch.int64)


def png(seed: int, width: int = 56, height: int = 56) -> bytes:
    """A random RGB PNG (test input)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class VisionEncoder(nn.Module):
    def __init__(self, vcfg: VisionConfig, text_hidden: int, seed: int = 0):
        super().__init__()
        self.cfg = vcfg
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Parameter(torch.randn(3 * vcfg.patch_size ** 2, text_hidden, generator=g) * 0.05)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        x = pixel_values.flatten(1).to(self.proj.dtype) @ self.proj               # [n_patches, H]
        mh, mw = self.cfg.merge_kernel_size
        out, at = [], 0
        for t, h, w in grid_thws.tolist():
            n = t * h * w
            y = x[at:at + n].view(t, h // mh, mh, w // mw, mw, -1).mean(dim=(2, 4))
            out.append(y.reshape(-1, x.shape[-1]))
            at += n
        return torch.cat(out)
