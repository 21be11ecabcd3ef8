"""Helpers for model tests: a step context over a simple contiguous block layout, a vision encoder
with random weights."""

from __future__ import annotations

import torch

from k3trt.model.context import StepContext
from k3trt.model.vision import VisionConfig, VisionEncoder

BLOCK = 16
MAX_BLOCKS = 8          # per sequence: up to 128 tokens


def step_ctx(q_lens, ctx_lens, *, save_kda_states=False, slots=None) -> StepContext:
    """Sequence i owns physical blocks [i·MAX_BLOCKS, (i+1)·MAX_BLOCKS) and KDA slot i."""
    S = len(q_lens)
    table = torch.arange(S * MAX_BLOCKS, dtype=torch.int32).view(S, MAX_BLOCKS)
    slot_map = torch.cat([i * MAX_BLOCKS * BLOCK + torch.arange(c, c + n)
                          for i, (c, n) in enumerate(zip(ctx_lens, q_lens))])
    kda_slots = torch.tensor(slots if slots is not None else list(range(S)), dtype=torch.long)
    return StepContext(tuple(q_lens), tuple(ctx_lens), slot_map, table, kda_slots, save_kda_states)


def num_blocks(num_seqs: int) -> int:
    return num_seqs * MAX_BLOCKS


def random_vision_encoder(cfg: VisionConfig) -> VisionEncoder:
    """An fp32 encoder of `cfg` with seeded random weights (norm weights near 1, so activations stay
    in range through the layers)."""
    torch.manual_seed(0)
    enc = VisionEncoder(cfg).float().eval()
    with torch.no_grad():
        for name, p in enc.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return enc
