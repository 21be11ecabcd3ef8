"""``k3trt::mla_cache_write``: write new tokens' latent KV rows into the paged MLA cache.

    mla_cache_write(kv_c [T, R], k_pe [T, P], cache [blocks, block_size, R+P], slot_mapping int64 [T],
                    kv_scale: float) -> None   (mutates cache)

Row t goes to flat row ``slot_mapping[t]`` (= block · block_size + offset); a negative slot marks a
padding token and is skipped. For a float8_e4m3fn cache the stored value is x / kv_scale
(saturated to the fp8 range), so that reading back fp8 · kv_scale gives x.
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


@torch.library.custom_op("k3trt::mla_cache_write", mutates_args=("cache",))
def mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_scale: float) -> None:
    if kv_c.shape[-1] + k_pe.shape[-1] != cache.shape[-1]:
        raise ValueError(f"mla_cache_write: kv_c width {kv_c.shape[-1]} + k_pe width {k_pe.shape[-1]} "
                         f"!= cache row width {cache.shape[-1]}")
    if slot_mapping.numel() and int(slot_mapping.max()) >= cache.shape[0] * cache.shape[1]:
        raise IndexError(f"mla_cache_write: slot {int(slot_mapping.max())} past the cache's "
                         f"{cache.shape[0] * cache.shape[1]} rows")
    mla_cache_write_reference(kv_c, k_pe, cache, slot_mapping, kv_scale)


@mla_cache_write.register_fake
def _(kv_c, k_pe, cache, slot_mapping, kv_scale):
    return None


def read_cache_rows(cache: torch.Tensor, slots: torch.Tensor, kv_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows at `slots`, dequantized to `dtype` (the inverse of the write)."""
    rows = cache.view(-1, cache.shape[-1])[slots]
    return (rows.float() * kv_scale).to(dtype) if cache.dtype == torch.float8_e4m3fn else rows.to(dtype)
