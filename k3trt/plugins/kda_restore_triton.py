"""Triton kernel behind kda_restore.py on CUDA (imported on its first CUDA call, so importing k3trt
never needs triton).

    kda_restore_fwd(state [L, slots, *S], step_state [L, slots, max_q, *S], slots int64 [B],
                    positions int64 [B]) -> None      (mutates state)

One program per (layer, sequence, block of a row's elements): reads the sequence's slot and
position and copies that block of step_state[l, slot, position] into state[l, slot]. Each element
is read and written once; no host synchronisation, no allocation: capturable.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 4096     # elements per program: K3's 64·128·128 fp32 state row is 256 programs a layer and sequence


@triton.jit
def _restore_kernel(state_ptr, step_ptr, slots_ptr, pos_ptr, B, num_slots, max_q, row, BLOCK: tl.constexpr):
    lb = tl.program_id(0)
    layer, b = (lb // B).to(tl.int64), lb % B      # int64 offsets: K3's step states pass 2^31 elements
    slot = tl.load(slots_ptr + b)
    pos = tl.load(pos_ptr + b)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row
    src = ((layer * num_slots + slot) * max_q + pos) * row
    dst = (layer * num_slots + slot) * row
    tl.store(state_ptr + dst + cols, tl.load(step_ptr + src + cols, mask=mask), mask=mask)


def kda_restore_fwd(state: torch.Tensor, step_state: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor) -> None:
    L, num_slots = state.shape[:2]
    B, max_q, row = slots.numel(), step_state.shape[2], math.prod(state.shape[2:])
    grid = (L * B, triton.cdiv(row, BLOCK))
    _restore_kernel[grid](state, step_state, slots, positions, B, num_slots, max_q, row, BLOCK=BLOCK)
