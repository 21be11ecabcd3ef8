"""Plain-torch side of ``k3trt::merge_attn_states`` (merge.py has the op and its layouts): the
reference (also the oracle of the kernel), the argument checks and what the Triton kernel covers.
Imported by the op and the DCP simulation (dcp_sim.py) alike.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def merge_attn_states_ref(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch merge (fp32); also the oracle for the kernel."""
    a, b = lse_a.float(), lse_b.float()
    m = torch.maximum(a, b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(a - m_safe), torch.exp(b - m_safe)
    total = wa + wb
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    zero = torch.zeros((), dtype=torch.float32, device=out_a.device)
    part_a = torch.where((wa > 0)[..., None], out_a.float() * wa[..., None], zero)
    part_b = torch.where((wb > 0)[..., None], out_b.float() * wb[..., None], zero)
    out = (part_a + part_b) * inv[..., None]
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, NEG_INF))
    return out.to(out_a.dtype), lse


def check_merge_attn_states(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.shape != out_b.shape or out_a.dtype != out_b.dtype:
        raise ValueError(f"merge_attn_states: out shapes/dtypes differ: {tuple(out_a.shape)} "
                         f"{out_a.dtype} vs {tuple(out_b.shape)} {out_b.dtype}")
    if lse_a.shape != out_a.shape[:-1] or lse_b.shape != out_a.shape[:-1]:
        raise ValueError(f"merge_attn_states: lse must be {tuple(out_a.shape[:-1])}, got "
                         f"{tuple(lse_a.shape)} and {tuple(lse_b.shape)}")


def merge_attn_states_unsupported(out_a: torch.Tensor, out_b: torch.Tensor) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can). Metadata only."""
    d_v = out_a.shape[-1]
    if d_v & (d_v - 1):
        return f"d_v={d_v} (need a power of two)"
    if not (out_a.is_contiguous() and out_b.is_contiguous()):
        return "non-contiguous out_a / out_b"
    return None
