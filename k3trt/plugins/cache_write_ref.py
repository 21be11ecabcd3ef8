"""Plain-torch side of ``k3trt::mla_cache_write`` (cache_write.py has the op and its layouts): the
reference write, its inverse (the model's cache read), the argument checks and what the Triton
kernel covers. Imported by the op and the kernel alike.
"""

from __future__ import annotations

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def mla_cache_write_reference(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                              slot_mapping: torch.Tensor, kv_scale: float) -> None:
    rows = torch.cat([kv_c, k_pe], dim=-1)
    keep = slot_mapping >= 0
    rows, slots = rows[keep], slot_mapping[keep]
    if cache.dtype == torch.float8_e4m3fn:
        rows = (rows.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX)
    cache.view(-1, cache.shape[-1])[slots] = rows.to(cache.dtype)


def read_cache_rows(cache: torch.Tensor, slots: torch.Tensor, kv_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows at `slots`, dequantized to `dtype` (the inverse of the write)."""
    rows = cache.view(-1, cache.shape[-1])[slots]
    return (rows.float() * kv_scale).to(dtype) if cache.dtype == torch.float8_e4m3fn else rows.to(dtype)


def check_mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor) -> None:
    """Shapes only (no device reads)."""
    if kv_c.shape[-1] + k_pe.shape[-1] != cache.shape[-1]:
        raise ValueError(f"mla_cache_write: kv_c width {kv_c.shape[-1]} + k_pe width {k_pe.shape[-1]} "
                         f"!= cache row width {cache.shape[-1]}")


def mla_cache_write_unsupported(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> str | None:
    """Why the kernel cannot take this call (None when it can). Shapes and dtypes only."""
    if kv_c.dim() != 2 or k_pe.dim() != 2 or kv_c.shape[0] != k_pe.shape[0] or cache.dim() != 3 \
            or slot_mapping.shape != kv_c.shape[:1]:
        return (f"shapes kv_c {tuple(kv_c.shape)}, k_pe {tuple(k_pe.shape)}, cache {tuple(cache.shape)}, "
                f"slot_mapping {tuple(slot_mapping.shape)}")
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if kv_c.dtype not in floats or k_pe.dtype not in floats or cache.dtype not in (*floats, torch.float8_e4m3fn):
        return f"dtypes kv_c {kv_c.dtype}, k_pe {k_pe.dtype}, cache {cache.dtype}"
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        return f"slot_mapping dtype {slot_mapping.dtype}"
    if not cache.is_contiguous():
        return "non-contiguous cache"
    return None
