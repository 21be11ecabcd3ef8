"""Per-patch metadata of a batch of images, computed on the host from their grids alone.

An image of grid (t, h, w) is t·h·w patches in (frame, row, column) order. Everything the tower
needs besides the pixels and the weights depends only on the grids: the bicubic taps that resample
the learned position table to (h, w), the RoPE positions, which image each patch attends within,
and where the merge puts it. Computing it here keeps the tower's graph free of data-dependent
shapes, so one exported graph serves every mix of image sizes up to its patch capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from k3trt.vision_config import VisionConfig

TAPS = 16                  # bicubic: 4 × 4 source positions per patch
CUBIC_A = -0.75            # F.interpolate's bicubic (Keys) coefficient


class GridError(ValueError):
    """A grid the tower cannot run (the message says why and what fits)."""


@dataclass(frozen=True)
class VisionBatch:
    """Shapes for P patches (P = the capacity when padded; padding rows are inert)."""
    grids: tuple[tuple[int, int, int], ...]
    pos_index: Tensor        # int64 [P, 16] rows of the flattened [pos_emb_height·pos_emb_width] table
    pos_weight: Tensor       # fp32 [P, 16] bicubic weights (0 on padding)
    frame: Tensor            # int64 [P] frame for the temporal sinusoid; -1: none (single-frame, padding)
    rope_pos: Tensor         # int64 [P, 2] (row, column) of the patch in its frame
    segment: Tensor          # int64 [P] image index; padding rows: -1 (they attend among themselves)
    merge_dest: Tensor       # int64 [P] row of the [tokens·kh·kw, hidden] merge buffer
    merge_weight: Tensor     # fp32 [P] 1 / frames (a token is the mean over its frames); 0 on padding
    num_patches: int         # real patches (the first num_patches rows)
    num_tokens: int          # merged tokens (the first num_tokens rows of the output)
    cu_seqlens: Tensor | None = None     # int32 [images + 1] patch offsets (varlen attention)
    max_len: int = 0                     # patches of the largest image

    @property
    def lengths(self) -> list[int]:
        return [t * h * w for t, h, w in self.grids]

    def to(self, device: torch.device | str) -> "VisionBatch":
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return VisionBatch(**moved)


def check_grid(cfg: VisionConfig, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in grid)
    kh, kw = cfg.merge_kernel_size
    if t < 1 or h < 1 or w < 1:
        raise GridError(f"grid (t, h, w) = {grid} must be positive")
    if h % kh or w % kw:
        raise GridError(f"grid (t, h, w) = {grid}: h and w must be multiples of merge_kernel_size {kh}×{kw} "
                        "(preprocess pads images to fit)")
    if t > cfg.pos_emb_time:
        raise GridError(f"grid (t, h, w) = {grid}: at most {cfg.pos_emb_time} frames per clip (pos_emb_time)")
    return t, h, w


def num_image_tokens(cfg: VisionConfig, grid_thw: tuple[int, int, int]) -> int:
    """Tokens an image of grid (t, h, w) becomes after the merge: (h / kh) · (w / kw), frames pooled."""
    _, h, w = check_grid(cfg, grid_thw)
    return (h // cfg.merge_kernel_size[0]) * (w // cfg.merge_kernel_size[1])


def cubic_taps(n_out: int, n_src: int) -> tuple[Tensor, Tensor]:
    """F.interpolate(mode="bicubic", align_corners=False) along one axis as 4 source indices and
    weights per output position: [n_out, 4] each (indices clamped to the border, as F.interpolate)."""
    i = torch.arange(n_out, dtype=torch.float64)
    src = (i + 0.5) * (n_src / n_out) - 0.5
    base = torch.floor(src)
    frac = src - base
    offsets = torch.arange(-1, 3, dtype=torch.float64)
    d = (frac[:, None] - offsets[None, :]).abs()
    a = CUBIC_A
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    weight = torch.where(d <= 1, near, torch.where(d < 2, far, torch.zeros_like(d)))
    index = (base[:, None] + offsets[None, :]).long().clamp(0, n_src - 1)
    return index, weight


def vision_batch(cfg: VisionConfig, grids, capacity: int | None = None) -> VisionBatch:
    """The metadata of images with grids `grids` ([n, 3] tensor or (t, h, w) tuples), padded to
    `capacity` patches when given (a GridError if they do not fit)."""
    if isinstance(grids, Tensor):
        grids = grids.tolist()
    grids = tuple(check_grid(cfg, g) for g in grids)
    if not grids:
        raise GridError("no images: grid_thws is empty")
    kh, kw = cfg.merge_kernel_size
    area = kh * kw
    H, W = cfg.pos_emb_height, cfg.pos_emb_width
    parts: dict[str, list[Tensor]] = {k: [] for k in ("pi", "pw", "fr", "rp", "sg", "md", "mw")}
    token0 = 0
    for img, (t, h, w) in enumerate(grids):
        ri, rw = cubic_taps(h, H)
        ci, cw = cubic_taps(w, W)
        index = (ri[:, None, :, None] * W + ci[None, :, None, :]).reshape(h * w, TAPS)
        weight = (rw[:, None, :, None] * cw[None, :, None, :]).reshape(h * w, TAPS)
        rows = torch.arange(h).repeat_interleave(w)
        cols = torch.arange(w).repeat(h)
        # the merge groups each kh×kw block: token (row // kh, col // kw), slot (row % kh, col % kw)
        token = (rows // kh) * (w // kw) + cols // kw
        dest = (token0 + token) * area + (rows % kh) * kw + cols % kw
        n = t * h * w
        parts["pi"].append(index.repeat(t, 1))
        parts["pw"].append(weight.float().repeat(t, 1))
        parts["fr"].append(torch.arange(t).repeat_interleave(h * w) if t > 1 else torch.full((n,), -1))
        parts["rp"].append(torch.stack([rows, cols], 1).repeat(t, 1))
        parts["sg"].append(torch.full((n,), img))
        parts["md"].append(dest.repeat(t))
        parts["mw"].append(torch.full((n,), 1.0 / t))
        token0 += (h // kh) * (w // kw)
    P = sum(t * h * w for t, h, w in grids)
    if capacity is not None:
        if capacity % area:
            raise GridError(f"encoder capacity {capacity} must be a multiple of {area} (the merge kernel's area)")
        if P > capacity or token0 > capacity // area:
            raise GridError(f"{P} patches do not fit the encoder capacity {capacity}; split the images over "
                            "several calls or build a larger encoder capacity")
        pad = capacity - P
        parts["pi"].append(torch.zeros(pad, TAPS, dtype=torch.long))
        parts["pw"].append(torch.zeros(pad, TAPS))
        parts["fr"].append(torch.full((pad,), -1))
        parts["rp"].append(torch.zeros(pad, 2, dtype=torch.long))
        parts["sg"].append(torch.full((pad,), -1))
        parts["md"].append(torch.zeros(pad, dtype=torch.long))
        parts["mw"].append(torch.zeros(pad))
    cat = {k: torch.cat(v) for k, v in parts.items()}
    lengths = [t * h * w for t, h, w in grids]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return VisionBatch(grids=grids, pos_index=cat["pi"], pos_weight=cat["pw"].float(), frame=cat["fr"].long(),
                       rope_pos=cat["rp"].long(), segment=cat["sg"].long(), merge_dest=cat["md"].long(),
                       merge_weight=cat["mw"].float(), num_patches=P, num_tokens=token0, cu_seqlens=cu,
                       max_len=max(lengths))

