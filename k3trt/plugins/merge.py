"""``torch.ops.k3trt.merge_attn_states``: exact merge of two partial attention results.

    out, lse = torch.ops.k3trt.merge_attn_states(out_a, lse_a, out_b, lse_b)

out_a, out_b [T, H, d_v] (bf16 / fp16 / fp32, same dtype), lse_a, lse_b [T, H] fp32 natural-log
sums of exp over each side's keys. Returns out [T, H, d_v] in out_a's dtype and lse [T, H] fp32:
``m = max(a, b)``, ``out = (e^{a-m}·A + e^{b-m}·B) / (e^{a-m} + e^{b-m})``,
``lse = m + log(e^{a-m} + e^{b-m})``. A side whose lse is -inf contributes nothing (its out is not
read, so garbage there is harmless); both -inf gives out = 0, lse = -inf. Arithmetic in fp32.
On CUDA a one-pass Triton kernel is used (the torch form is ~10 elementwise passes over out; the
kernel was checked on the H200, not timed on its own).
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


@torch.library.custom_op("k3trt::merge_attn_states", mutates_args=())
def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(out_a, lse_a, out_b, lse_b)
    return merge_attn_states_ref(out_a, lse_a, out_b, lse_b)


@merge_attn_states.register_kernel("cuda")
def _merge_cuda(out_a, lse_a, out_b, lse_b):
    _check(out_a, lse_a, out_b, lse_b)
    d_v = out_a.shape[-1]
    if d_v & (d_v - 1) or not (out_a.is_contiguous() and out_b.is_contiguous()):
        return merge_attn_states_ref(out_a, lse_a, out_b, lse_b)
    from . import mla_triton  # lazy: triton is imported only on the CUDA path

    return mla_triton.merge_two(out_a, lse_a.float().contiguous(), out_b, lse_b.float().contiguous())


@merge_attn_states.register_fake
def _merge_fake(out_a, lse_a, out_b, lse_b):
    return torch.empty_like(out_a), torch.empty(lse_a.shape, dtype=torch.float32, device=lse_a.device)


def _check(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.shape != out_b.shape or out_a.dtype != out_b.dtype:
        raise ValueError(f"merge_attn_states: out shapes/dtypes differ: {tuple(out_a.shape)} "
                         f"{out_a.dtype} vs {tuple(out_b.shape)} {out_b.dtype}")
    if lse_a.shape != out_a.shape[:-1] or lse_b.shape != out_a.shape[:-1]:
        raise ValueError(f"merge_attn_states: lse must be {tuple(out_a.shape[:-1])}, got "
                         f"{tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
