"""KDA rollback after a verify step: each sequence's recurrent state and conv window <- their
values after its accepted position, in every KDA layer at once.

    kda_restore(state [L, slots, *S], step_state [L, slots, max_q, *S], slots int64 [B],
                positions int64 [B]) -> None        (mutates state; called for the conv windows too)

``state[l, slots[b]] = step_state[l, slots[b], positions[b]]`` for every layer l and b (distinct
slots). The reference is that indexed assignment, in groups of layers so its gathered copy stays
under RESTORE_CHUNK_BYTES. On CUDA the Triton kernel (kda_restore_triton.py) copies each row
straight from the step states: a torch gather and scatter move the states twice and through an
elementwise index kernel (a verify step at batch 32 over 46 KDA layers: 26 ms, against a 80 ms
verify step on the H100).
"""

from __future__ import annotations

import torch

from . import dispatch

__all__ = ["kda_restore", "kda_restore_reference", "kda_restore_unsupported"]

RESTORE_CHUNK_BYTES = 256 << 20


def kda_restore_reference(state: torch.Tensor, step_state: torch.Tensor, slots: torch.Tensor,
                          positions: torch.Tensor) -> None:
    per_layer = max(1, slots.numel() * state[0, 0].nbytes)
    group = max(1, RESTORE_CHUNK_BYTES // per_layer)
    for a in range(0, state.shape[0], group):
        state[a:a + group, slots] = step_state[a:a + group, slots, positions]


def kda_restore_unsupported(state: torch.Tensor, step_state: torch.Tensor, slots: torch.Tensor,
                            positions: torch.Tensor) -> str | None:
    """Why the kernel cannot take this call (None when it can). Shapes, dtypes and layout only."""
    if step_state.dim() != state.dim() + 1 or step_state.shape[:2] != state.shape[:2] \
            or step_state.shape[3:] != state.shape[2:]:
        return f"shapes state {tuple(state.shape)}, step_state {tuple(step_state.shape)}"
    if step_state.dtype != state.dtype:
        return f"dtypes state {state.dtype}, step_state {step_state.dtype}"
    if not (state.is_contiguous() and step_state.is_contiguous()):
        return "non-contiguous states"
    if slots.dtype != torch.int64 or positions.dtype != torch.int64 or slots.shape != positions.shape:
        return f"slots {slots.dtype} {tuple(slots.shape)}, positions {positions.dtype} {tuple(positions.shape)}"
    return None


def kda_restore(state: torch.Tensor, step_state: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    if not slots.numel():
        return
    if state.device.type != "cuda":
        kda_restore_reference(state, step_state, slots, positions)
        return
    dispatch.call("kda_restore", kda_restore_unsupported(state, step_state, slots, positions),
                  "kda_restore_triton.kda_restore_fwd", kda_restore_reference, state, step_state, slots, positions)
