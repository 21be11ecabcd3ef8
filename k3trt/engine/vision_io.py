"""The I/O contract of the vision encoder graphs: one static graph per encoder patch capacity P.

    encoder_p{P}   up to P patches of whole images -> P / (kh·kw) rows of image embeddings

Inputs (names are the bindings; the host computes all but the pixels from the images' grids,
k3trt/model/vision/geometry.py ``vision_batch(cfg, grids, capacity=P)``):
    pixel_values  [P, 3, p, p]   the model dtype; padding rows zero
    pos_index     int64 [P, 16]  bicubic taps into the learned position table
    pos_weight    fp32  [P, 16]
    frame         int64 [P]      frame of a multi-frame clip, -1 for none
    rope_pos      int64 [P, 2]   (row, column) in the frame
    segment       int64 [P]      image index (attention stays within it); -1 on padding
    merge_dest    int64 [P]      row of the merge buffer; merge_weight fp32 [P] (0 on padding)
Output: image_embeds [P / (kh·kw), text hidden] in the model dtype; the first
``num_tokens`` rows are the images' tokens in order, the rest padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3trt.engine.graph_io import TensorSpec
from k3trt.vision_config import VisionConfig

TAPS = 16
ENCODER_INPUTS = ("pixel_values", "pos_index", "pos_weight", "frame", "rope_pos", "segment", "merge_dest",
                  "merge_weight")


@dataclass(frozen=True)
class EncoderSpec:
    capacity: int                    # patches
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"encoder_p{self.capacity}"


def encoder_specs(vcfg: VisionConfig, capacities, dtype: torch.dtype) -> list[EncoderSpec]:
    bad = [c for c in capacities if c % vcfg.merge_area]
    if bad:
        raise ValueError(f"encoder capacities {bad} are not multiples of {vcfg.merge_area} (the merge kernel "
                         f"{vcfg.merge_kernel_size[0]}×{vcfg.merge_kernel_size[1]}): choose multiples such as 1024")
    return [EncoderSpec(c, dtype) for c in capacities]


def encoder_io_specs(vcfg: VisionConfig, spec: EncoderSpec) -> tuple[list[TensorSpec], list[TensorSpec]]:
    P, p = spec.capacity, vcfg.patch_size
    shapes = {"pixel_values": ((P, 3, p, p), spec.dtype), "pos_index": ((P, TAPS), torch.int64),
              "pos_weight": ((P, TAPS), torch.float32), "frame": ((P,), torch.int64),
              "rope_pos": ((P, 2), torch.int64), "segment": ((P,), torch.int64),
              "merge_dest": ((P,), torch.int64), "merge_weight": ((P,), torch.float32)}
    ins = [TensorSpec(n, *shapes[n]) for n in ENCODER_INPUTS]
    outs = [TensorSpec("image_embeds", (P // vcfg.merge_area, vcfg.text_hidden_size), spec.dtype)]
    return ins, outs
