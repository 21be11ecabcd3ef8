"""What a model needs on one device: parameters, resident weight bytes and the cache plan, from the
config alone (a model built on the meta device, no weight read).

Weights are resident in the build dtype: the loader dequantizes fp8 / mxfp4 checkpoint tensors to
it (model/weights.py), so a quantized checkpoint is smaller on disk but not in device memory.
Per rank, each tensor is the shard that rank holds under the ParallelConfig (tp splits heads,
widths and lm_head's vocabulary; ep splits the routed experts; the rest is replicated).

Cache plan, per rank (the same arithmetic as runtime/kv_cache.plan_cache):
  MLA latent cache   per token: MLA layers x (kv_lora_rank + qk_rope_head_dim) x kv dtype; the
                     latent is shared by all heads, so tp does not split it; dcp holds 1/dcp of the
                     tokens on each rank.
  KDA state          per sequence: KDA layers x (the fp32 recurrent state heads·d·d + the three
                     short-conv windows 3·heads·d·(kernel-1) in the model dtype); heads split by tp.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from k3trt.config import ModelConfig
from k3trt.parallel.comm import Comm
from k3trt.parallel.config import ParallelConfig

log = logging.getLogger(__name__)

GIB = 2**30
# The share of device memory weights may take: the rest holds activations, the CUDA context, the
# cache (at least a few requests' worth) and the allocator's slack.
WEIGHT_FRACTION = 0.9


class DoesNotFitError(ValueError):
    """The model's weights do not fit the target device; the message names the numbers and the remedy."""


@dataclass(frozen=True)
class Footprint:
    params: int                      # the whole model (MTP layers included), unsharded
    params_per_rank: int             # what one rank holds
    weight_bytes_per_rank: int       # params_per_rank in the build dtype
    mla_bytes_per_token: int         # latent cache of every MLA layer, one token, one rank
    kda_bytes_per_seq: int           # KDA state of every KDA layer, one sequence, one rank
    dtype: torch.dtype
    kv_dtype: torch.dtype
    pc: ParallelConfig

    def lines(self) -> list[str]:
        """The build report, one fact a line."""
        ranks = self.pc.world_size
        where = "the device" if ranks == 1 else (f"each of {ranks} ranks "
                                                  f"(tp={self.pc.tp}, dcp={self.pc.dcp}, ep={self.pc.ep})")
        return [
            f"parameters: {self.params / 1e9:.3f} B ({self.params:,})",
            (f"weights on {where}: {self.weight_bytes_per_rank / GIB:.2f} GiB "
             f"({self.params_per_rank:,} parameters in {_name(self.dtype)})"),
            (f"cache plan: MLA latent cache {self.mla_bytes_per_token:,} bytes per token ({_name(self.kv_dtype)}); "
             f"KDA state {self.kda_bytes_per_seq / 2**20:.2f} MiB per sequence"),
        ]

    def check_fits(self, device_bytes: int) -> None:
        """Raise DoesNotFitError when the weights exceed WEIGHT_FRACTION of `device_bytes`."""
        room = int(device_bytes * WEIGHT_FRACTION)
        if self.weight_bytes_per_rank <= room:
            return
        need = -(-self.weight_bytes_per_rank // room)       # ranks that would split them enough
        per = "per rank " if self.pc.world_size > 1 else ""
        smaller = ", or build with --dtype bf16" if _size(self.dtype) > 2 else ""
        raise DoesNotFitError(
            f"the model does not fit the target device: its weights take {self.weight_bytes_per_rank / GIB:.1f} GiB "
            f"{per}in {_name(self.dtype)}, the device has {device_bytes / GIB:.1f} GiB and weights may use "
            f"{room / GIB:.1f} GiB of it ({WEIGHT_FRACTION:.0%}). Remedy: spread the model over more ranks "
            f"(about {need * self.pc.world_size} in all; tensor parallel --tp and expert parallel --ep split the "
            f"layers and the routed experts){smaller}. fp8 / mxfp4 checkpoint experts are "
            f"dequantized to {_name(self.dtype)} at load, so they shrink the download, not this number.")


def footprint(cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None,
              pc: ParallelConfig | None = None) -> Footprint:
    """The footprint of `cfg` in `dtype` (KV cache in `kv_dtype`, default `dtype`) on rank 0 of `pc`."""
    pc = pc or ParallelConfig()
    kv_dtype = kv_dtype or dtype
    pc.validate(cfg)
    whole, local = _count(cfg, ParallelConfig()), _count(cfg, pc)
    la = cfg.linear_attn_config
    heads = la.num_heads // pc.tp
    state = heads * la.head_dim * la.head_dim * 4
    conv = 3 * heads * la.head_dim * (la.short_conv_kernel_size - 1) * _size(dtype)
    return Footprint(
        params=whole, params_per_rank=local, weight_bytes_per_rank=local * _size(dtype),
        mla_bytes_per_token=-(-len(cfg.mla_layers) * cfg.mla_cache_dim * _size(kv_dtype) // pc.dcp),
        kda_bytes_per_seq=len(cfg.kda_layers) * (state + conv), dtype=dtype, kv_dtype=kv_dtype, pc=pc)


def local_device_memory() -> int | None:
    """Total memory of the visible GPU (the first), or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def _count(cfg: ModelConfig, pc: ParallelConfig) -> int:
    from k3trt.model.k3 import K3ForCausalLM  # noqa: PLC0415 (heavy: the model code and its ops, for the count only)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, Comm(pc))
    return sum(p.numel() for p in model.parameters())


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
