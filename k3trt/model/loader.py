"""Build the model on the meta device, then fill it from a checkpoint (no second copy in RAM)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

import k3trt.plugins  # noqa: F401  (registers torch.ops.k3trt.*)
from k3trt.config import ModelConfig
from k3trt.model.k3 import K3ForCausalLM
from k3trt.model.mla import rope_inv_freq
from k3trt.model.weights import load_weights
from k3trt.parallel.comm import SINGLE, Comm

log = logging.getLogger(__name__)


def build_model(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                meta: bool = True, comm: Comm = SINGLE) -> K3ForCausalLM:
    """An uninitialised model with parameters of `dtype` on `device` (allocated but not filled
    when `meta`: the caller loads or initialises every parameter); rank comm.pc.rank's shard."""
    with torch.device("meta" if meta else device):
        model = K3ForCausalLM(cfg, comm)
    if meta:
        # cast on the meta device, then allocate: the weights never exist in fp32 at full size
        model = model.to(dtype).to_empty(device=device)
        # non-persistent buffers (rope frequencies) do not survive to_empty: rebuild them
        for mod in model.modules():
            if hasattr(mod, "inv_freq"):
                freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)[0]
                mod.inv_freq = freq.to(device=device, dtype=dtype)
    return model.to(dtype).eval()


def load_model(ckpt_dir: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", comm: Comm = SINGLE) -> tuple[ModelConfig, K3ForCausalLM]:
    t0 = time.perf_counter()
    cfg = ModelConfig.from_json(ckpt_dir)
    model = build_model(cfg, dtype=dtype, device=device, comm=comm)
    load_weights(model, ckpt_dir, cfg, comm.pc)
    log.info("loaded %s (%d layers, %.1fM parameters) in %.1fs", ckpt_dir, cfg.num_hidden_layers,
             sum(p.numel() for p in model.parameters()) / 1e6, time.perf_counter() - t0)
    return cfg, model
