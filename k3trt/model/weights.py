"""Checkpoint tensors <-> model parameters: strict loading, writing, and random initialisation.

Which checkpoint tensors make each parameter is data, in k3trt/model/layout.py (the published
layout). Loading is strict: the checkpoint's index is first checked against the config from the
headers alone (k3trt/model/checkpoint_check.py: every problem listed at once, unknown names with
the nearest known rule), then every model parameter comes from the checkpoint with its exact shape
and every checkpoint tensor is consumed (the vision tower and projector included, when config.json has
a ``vision_config``; MTP layers' copies of the embedding and lm_head are checked by their headers
and not read).

With a ParallelConfig, each rank loads its shard (k3trt/parallel/shard.py says which slice of each
tensor): the slice is cut from the memory-mapped tensor before it is converted, so only its bytes
are read; another EP rank's experts are marked consumed without reading them. Quantized (fp8 /
mxfp4) weights are dequantized whole before the cut; K3's mxfp4 tensors are per-expert, so EP
still reads only its own. A rank dir of a multi-rank engine (model/rank_checkpoint.py: its index
carries the shard marker) holds the slices already: they are read as they are, checked against
the rank's shapes, and a model built for another shard is refused.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from k3trt.config import ModelConfig
from k3trt.model.checkpoint_check import WeightError, check_reader, linear_like, open_checkpoint, pick_name
from k3trt.model.checkpoint_io import CheckpointReader
from k3trt.model.layout import Source, checkpoint_prefix, copy_of, source, tensor_prefix
from k3trt.model.quant import WEIGHT_SUFFIXES, load_linear_weight, quantize_for_checkpoint
from k3trt.model.rank_checkpoint import read_marker
from k3trt.parallel.config import ParallelConfig
from k3trt.parallel.shard import WHOLE, Part, ShardError, param_part

log = logging.getLogger(__name__)

__all__ = ["QUANT_TARGETS", "WeightError", "checkpoint_prefix", "checkpoint_tensors", "init_random_",
           "load_weights"]


def _read(reader: CheckpointReader, name: str, expect: torch.Size, dtype: torch.dtype, param: str,
          part: Part = WHOLE, src: Source | None = None) -> torch.Tensor:
    """Checkpoint tensor `name` (of full model shape `expect`), cut to `part`, as `dtype`."""
    try:
        if linear_like(name, expect):
            t = load_linear_weight(reader, name[: -len(".weight")], out_dtype=dtype)
        else:
            t = reader.get(name)
    except KeyError:
        raise WeightError(f"checkpoint {reader.path}: missing tensor '{name}' (model parameter '{param}')") from None
    if not t.is_floating_point():
        raise WeightError(f"checkpoint {reader.path}: tensor '{name}' has dtype {t.dtype}; expected a floating type")
    if src is not None and t.shape != expect and tuple(t.shape) == src.stored_shape(tuple(expect)):
        t = t.reshape(expect)
    if t.shape != expect:
        raise WeightError(f"checkpoint {reader.path}: tensor '{name}' has shape {tuple(t.shape)}; "
                          f"model parameter '{param}' expects {tuple(expect)}")
    return part.take(t).to(dtype)


def _skip(reader: CheckpointReader, name: str, param: str) -> None:
    """Mark another rank's linear weight `name` (any stored format) consumed without reading it."""
    module = name.removesuffix(".weight")
    present = [f"{module}.{s}" for s in WEIGHT_SUFFIXES if f"{module}.{s}" in reader]
    if not present:
        raise WeightError(f"checkpoint {reader.path}: missing tensor '{name}' (model parameter '{param}')")
    for n in present:
        reader.get(n)           # a view of the mmap: marks it consumed, reads no data


def load_weights(model: nn.Module, ckpt_dir: str | Path, cfg: ModelConfig,
                 pc: ParallelConfig | None = None) -> None:
    """Fill every parameter of `model` (built on any device, e.g. meta then to_empty) from the
    checkpoint at `ckpt_dir`, strictly. With `pc`, `model` is rank pc.rank's shard (built with a
    Comm of that config) and gets its slice of every tensor."""
    with open_checkpoint(ckpt_dir, cfg) as reader:
        presliced = _check_shard(reader, pc)
        check_reader(reader, cfg, pc if presliced else None).raise_if_bad()
        params = dict(model.named_parameters())
        for i, (pname, p) in enumerate(params.items()):
            src = source(pname, cfg)
            prefix = tensor_prefix(src, cfg)
            part = param_part(pname, pc) if pc is not None and pc.world_size > 1 else WHOLE
            if src.combine == "one":
                name = pick_name(reader, [prefix + n for n in (*src.names, *src.also)])
                if presliced:
                    t = _read(reader, name, p.shape, p.dtype, pname, WHOLE, src)
                else:
                    t = _read(reader, name, part.full_shape(p.shape), p.dtype, pname, part, src)
            elif src.combine == "stack":
                if part.dim not in (None, 0):
                    raise ShardError(f"'{pname}': stacked experts split only along dim 0 (experts)")
                mine = part.range(len(src.names))                  # this rank's experts
                for e, n in enumerate(src.names):
                    if e not in mine and not presliced:
                        _skip(reader, prefix + n, pname)
                t = torch.stack([_read(reader, prefix + src.names[e], p.shape[1:], p.dtype, pname) for e in mine])
            elif part.dim is not None:
                raise ShardError(f"'{pname}' is concatenated from {src.names}; splitting it is not supported")
            else:
                sizes = src.rule.split(cfg)
                t = torch.cat([_read(reader, prefix + n, torch.Size([s, *p.shape[1:]]), p.dtype, pname)
                               for n, s in zip(src.names, sizes)])
            with torch.no_grad():
                p.copy_(t.to(p.device))
            if (i + 1) % 200 == 0:
                log.info("loaded %d/%d parameters", i + 1, len(params))
        prefix = checkpoint_prefix(cfg)
        copies = [n for n in reader.unconsumed() if copy_of(n.removeprefix(prefix), cfg)]
        for n in copies:
            reader.get(n)       # a view of the mmap: marks it consumed, reads no data
        if copies:
            log.info("MTP layers' copies of the embedding / lm_head not read (the model shares the main ones): %s",
                     ", ".join(copies))
        left = reader.unconsumed()
        if left:
            more = f" (and {len(left) - 10} more)" if len(left) > 10 else ""
            raise WeightError(f"checkpoint {ckpt_dir}: {len(left)} unexpected tensors not used by the model: "
                              f"{', '.join(left[:10])}{more}")


def _check_shard(reader: CheckpointReader, pc: ParallelConfig | None) -> bool:
    """Whether `reader` is a rank dir (its tensors pre-sliced); refuses one of another shard."""
    marker = read_marker(reader)
    if marker is None:
        return False
    if pc is None or marker != pc:
        mine = "one process" if pc is None or pc.world_size == 1 else \
            f"rank {pc.rank} of tp={pc.tp} dcp={pc.dcp} ep={pc.ep} dcp_interleave={pc.dcp_interleave}"
        raise WeightError(f"{reader.path} holds rank {marker.rank}'s slices of a tp={marker.tp} dcp={marker.dcp} "
                          f"ep={marker.ep} dcp_interleave={marker.dcp_interleave} engine, but the model is built "
                          f"for {mine}: a multi-rank engine runs one process per rank (LLM and `k3trt run|serve` "
                          f"start them), each loading its own rank dir with its rank's ParallelConfig")
    return True


def checkpoint_tensors(model: nn.Module, cfg: ModelConfig, quant: str = "none") -> dict[str, torch.Tensor]:
    """The model's parameters under their published checkpoint names and shapes, in checkpoint
    order (the inverse of load_weights). quant: "none"; "fp8" (block-scaled e4m3 projections, as
    DeepSeek-V3 ships); "mxfp4" (routed experts only, compressed-tensors pack-quantized, as K3
    ships)."""
    if quant not in QUANT_TARGETS:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {sorted(QUANT_TARGETS)}")
    out = {}
    for pname, p in model.named_parameters():
        src = source(pname, cfg)
        prefix = tensor_prefix(src, cfg)
        t = p.detach()
        if src.combine == "stack":
            parts = list(t.unbind(0))
        elif src.combine == "cat":
            parts = list(t.split(src.rule.split(cfg)))
        else:
            parts = [t.reshape(src.stored_shape(tuple(t.shape)))]
        for n, part in zip(src.names, parts):
            fmt = QUANT_TARGETS[quant](n, part.shape)
            if fmt != "none":
                out.update({prefix + k: v for k, v in quantize_for_checkpoint(n, part, fmt).items()})
            else:
                out[prefix + n] = part.contiguous()
    return out


def _fp8_target(name: str, shape) -> str:
    # the vision tower and projector ship in bf16 beside fp8 text weights
    skip = ("embed_tokens", "lm_head", ".block_sparse_moe.gate.", "_res_proj", "eh_proj", "vision_tower.",
            "mm_projector.")
    return "fp8" if linear_like(name, shape) and not any(s in name for s in skip) else "none"


def _mxfp4_target(name: str, shape) -> str:
    return "mxfp4" if ".block_sparse_moe.experts." in name and shape[-1] % 32 == 0 else "none"


QUANT_TARGETS: dict[str, Callable[[str, torch.Size], str]] = {
    "none": lambda name, shape: "none",
    "fp8": _fp8_target,
    "mxfp4": _mxfp4_target,
}


# ------------------------------------------------------------------------------ random init
# Every initialiser draws with generator g on g.device: a CPU generator gives the CPU tensors these
# rules always gave (bit for bit); a CUDA generator draws on the GPU (init_random_'s `device`).
def _randn(p, g):
    return torch.randn(p.shape, generator=g, device=g.device)


def _linear(p, g):
    return _randn(p, g) / math.sqrt(p.shape[-1])


# (regex over the parameter name, initialiser); the first match wins. Norm weights are not all
# ones so that a test can tell whether a norm's weight was applied.
INIT_RULES: tuple[tuple[str, Callable[[nn.Parameter, torch.Generator], torch.Tensor]], ...] = (
    (r".*embed_tokens\.weight", _randn),
    (r"vision\..*(norm\d?|pre_norm)\.weight", lambda p, g: 1 + 0.1 * _randn(p, g)),
    (r"vision\..*\.bias", lambda p, g: 0.02 * _randn(p, g)),
    (r"vision\..*pos_emb\.weight", lambda p, g: 0.5 * _randn(p, g)),
    (r"vision\..*\.proj\.weight", lambda p, g: _randn(p, g) / math.sqrt(p[0].numel())),
    (r".*(norm|layernorm)\.weight", lambda p, g: 1 + 0.1 * _randn(p, g)),
    (r".*e_score_correction_bias", lambda p, g: 0.05 * _randn(p, g)),
    (r".*A_log", lambda p, g: torch.empty(p.shape, device=g.device).uniform_(0.0, math.log(16.0), generator=g)),
    (r".*dt_bias", lambda p, g: 0.1 * _randn(p, g)),
    (r".*conv1d\.weight", lambda p, g: _randn(p, g) / math.sqrt(p.shape[-1])),
    (r".*", _linear),
)


def init_random_(model: nn.Module, seed: int, device: str | torch.device | None = None) -> None:
    """Deterministic random weights: same seed (and device), same parameters, bit for bit.

    device None or "cpu": drawn on the CPU (what checkpoints are made with). A CUDA device: drawn
    there by a CUDA generator of that seed — seconds instead of minutes at the medium preset's 9B
    parameters, deterministic too, but other numbers than the CPU draw."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init = next(fn for pat, fn in INIT_RULES if re.fullmatch(pat, name))
            p.copy_(init(p, g).to(p.dtype))
