"""``k3trt::mla_cache_write``: write new tokens' latent KV rows into the paged MLA cache.

    mla_cache_write(kv_c [T, R], k_pe [T, P], cache [blocks, block_size, R+P], slot_mapping int64 [T],
                    kv_scale: float) -> None   (mutates cache)

Row t goes to flat row ``slot_mapping[t]`` (= block · block_size + offset); a negative slot marks a
padding token and is skipped. For a float8_e4m3fn cache the stored value is x / kv_scale
(saturated to the fp8 range), so that reading back fp8 · kv_scale gives x.

The torch body (cache_write_ref.py) runs everywhere; on CUDA the Triton kernel
(cache_write_triton.py) skips the host-side bounds check (a sync a CUDA graph cannot hold). For
export the op has a functional form, ``k3trt::mla_cache_update`` (builder/export.py), whose ONNX
node and plain-torch lowering are described here.
"""

from __future__ import annotations

import torch

from . import dispatch
from .cache_write_ref import (FP8_MAX, check_mla_cache_write, mla_cache_write_reference, mla_cache_write_unsupported,
                              read_cache_rows)
from .onnx_spec import CACHE, FLOATS, I64, OnnxOp, params

__all__ = ["mla_cache_write", "mla_cache_write_reference", "read_cache_rows", "native_cache_update", "FP8_MAX",
           "ONNX"]


@torch.library.custom_op("k3trt::mla_cache_write", mutates_args=("cache",))
def mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_scale: float) -> None:
    check_mla_cache_write(kv_c, k_pe, cache)
    if slot_mapping.numel() and int(slot_mapping.max()) >= cache.shape[0] * cache.shape[1]:
        raise IndexError(f"mla_cache_write: slot {int(slot_mapping.max())} past the cache's "
                         f"{cache.shape[0] * cache.shape[1]} rows")
    mla_cache_write_reference(kv_c, k_pe, cache, slot_mapping, kv_scale)


@mla_cache_write.register_fake
def _(kv_c, k_pe, cache, slot_mapping, kv_scale):
    return None


@mla_cache_write.register_kernel("cuda")
def _mla_cache_write_cuda(kv_c, k_pe, cache, slot_mapping, kv_scale):
    # no bounds check on the slots here: it would read slot_mapping back (a host sync); the kernel
    # skips a slot past the cache instead
    check_mla_cache_write(kv_c, k_pe, cache)
    dispatch.call("mla_cache_write", mla_cache_write_unsupported(kv_c, k_pe, cache, slot_mapping),
                  "cache_write_triton.mla_cache_write_fwd", mla_cache_write_reference,
                  kv_c, k_pe, cache, slot_mapping, kv_scale)


# ----------------------------------------------------------------------------- export
def native_cache_update(kv_c, k_pe, cache, slot_mapping, kv_scale=1.0):
    """mla_cache_update without skipping by a mask: negative slots go to a spare row that is cut off."""
    rows = torch.cat([kv_c, k_pe], -1)
    if cache.dtype == torch.float8_e4m3fn:
        rows = (rows.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX)
    flat = cache.reshape(-1, cache.shape[-1])
    n = flat.shape[0]
    spare = torch.cat([flat, flat[:1]], 0)
    idx = torch.where(slot_mapping >= 0, slot_mapping, n)
    return torch.index_put(spare, (idx,), rows.to(cache.dtype))[:n].reshape(cache.shape)


ONNX = (
    OnnxOp("mla_cache_update", "MlaCacheWrite",
           params("kv_c k_pe", FLOATS) + params("cache", CACHE) + params("slot_mapping", I64),
           params("cache_out", CACHE),
           "The cache with rows written at slot_mapping (negative slots skipped); in place in an engine.",
           native=native_cache_update),
)
