"""Checkpoint names <-> model parameters, strict loading, and random initialisation.

The model's parameter names equal the checkpoint's (below ``language_model.`` in a kimi_k3
checkpoint) except for the few rules in ``RULES``, kept as data. Loading is strict: every model
parameter comes from the checkpoint with its exact shape, every checkpoint tensor is consumed (the
vision tower and projector are skipped by the explicit ``SKIP_PREFIXES`` list, and the log says
so), and anything else is an error that names the tensor.

With a ParallelConfig, each rank loads its shard (k3trt/parallel/shard.py says which slice of each
tensor): the slice is cut from the memory-mapped tensor before it is converted, so only its bytes
are read; another EP rank's experts are marked consumed without reading them. Quantized (fp8 /
mxfp4) weights are dequantized whole before the cut; K3's mxfp4 tensors are per-expert, so EP
still reads only its own.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from k3trt.config import ModelConfig
from k3trt.model.checkpoint_io import CheckpointReader
from k3trt.model.quant import WEIGHT_SUFFIXES, load_linear_weight, quantize_for_checkpoint
from k3trt.parallel.config import ParallelConfig
from k3trt.parallel.shard import WHOLE, Part, ShardError, param_part

log = logging.getLogger(__name__)

# Until vision is supported, these parts of a real K3 checkpoint are skipped (and logged).
SKIP_PREFIXES = ("vision_tower.", "multi_modal_projector.", "mm_projector.")


def checkpoint_prefix(cfg: ModelConfig) -> str:
    """kimi_k3 nests the language model under ``language_model.``; a bare text checkpoint does not."""
    return "language_model." if cfg.model_type == "kimi_k3" else ""


@dataclass(frozen=True)
class Rule:
    """One model parameter assembled from several checkpoint tensors."""
    model: str                                   # regex over the model parameter name
    ckpt: tuple[str, ...]                        # checkpoint names; {i} from the regex, {e} = expert
    combine: str                                 # "cat": along dim 0 in order; "stack": over experts
    split: Callable[[ModelConfig], list[int]] | None = None   # "cat" sizes, for writing


RULES: tuple[Rule, ...] = (
    Rule(r"model\.layers\.(?P<i>\d+)\.self_attn\.fused_qkv_a_proj\.weight",
         ("model.layers.{i}.self_attn.q_a_proj.weight", "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"),
         "cat", lambda c: [c.q_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim]),
    Rule(r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.w_gate", ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight",), "stack"),
    Rule(r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.w_up", ("model.layers.{i}.mlp.experts.{e}.up_proj.weight",), "stack"),
    Rule(r"model\.layers\.(?P<i>\d+)\.mlp\.experts\.w_down", ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",), "stack"),
)


class WeightError(ValueError):
    """A checkpoint whose tensors do not fit the model; the message names the tensor."""


def sources(param: str, cfg: ModelConfig) -> tuple[Rule | None, list[str]]:
    """The checkpoint names (without the language_model. prefix) one model parameter comes from."""
    for rule in RULES:
        m = re.fullmatch(rule.model, param)
        if m:
            if rule.combine == "stack":
                return rule, [rule.ckpt[0].format(e=e, **m.groupdict()) for e in range(cfg.num_experts)]
            return rule, [c.format(**m.groupdict()) for c in rule.ckpt]
    return None, [param]


def _is_linear(name: str, shape: torch.Size) -> bool:
    """Tensors that may be stored quantized (fp8 blocks / mxfp4): 2-D projection weights."""
    return name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name


def _read(reader: CheckpointReader, name: str, expect: torch.Size, dtype: torch.dtype, param: str,
          part: Part = WHOLE) -> torch.Tensor:
    """Checkpoint tensor `name` (of full shape `expect`), cut to `part`, as `dtype`."""
    try:
        if _is_linear(name, expect):
            t = load_linear_weight(reader, name[: -len(".weight")], out_dtype=dtype)
        else:
            t = reader.get(name)
    except KeyError:
        raise WeightError(f"checkpoint {reader.path}: missing tensor '{name}' (model parameter '{param}')") from None
    if not t.is_floating_point():
        raise WeightError(f"checkpoint {reader.path}: tensor '{name}' has dtype {t.dtype}; expected a floating type")
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
    prefix = checkpoint_prefix(cfg)
    with CheckpointReader(ckpt_dir) as reader:
        skipped = reader.skip_prefixes(SKIP_PREFIXES)
        if skipped:
            log.info("skipped %d tensors of the vision tower/projector (vision is not supported yet)", len(skipped))
        params = dict(model.named_parameters())
        for i, (pname, p) in enumerate(params.items()):
            rule, names = sources(pname, cfg)
            part = param_part(pname, pc) if pc is not None and pc.world_size > 1 else WHOLE
            if rule is None:
                t = _read(reader, prefix + names[0], part.full_shape(p.shape), p.dtype, pname, part)
            elif rule.combine == "stack":
                if part.dim not in (None, 0):
                    raise ShardError(f"'{pname}': stacked experts split only along dim 0 (experts)")
                mine = part.range(len(names))                  # this rank's experts
                for e, n in enumerate(names):
                    if e not in mine:
                        _skip(reader, prefix + n, pname)
                t = torch.stack([_read(reader, prefix + names[e], p.shape[1:], p.dtype, pname) for e in mine])
            elif part.dim is not None:
                raise ShardError(f"'{pname}' is concatenated from {names}; splitting it is not supported")
            else:
                sizes = rule.split(cfg)
                t = torch.cat([_read(reader, prefix + n, torch.Size([s, *p.shape[1:]]), p.dtype, pname)
                               for n, s in zip(names, sizes)])
            with torch.no_grad():
                p.copy_(t.to(p.device))
            if (i + 1) % 200 == 0:
                log.info("loaded %d/%d parameters", i + 1, len(params))
        left = reader.unconsumed()
        if left:
            more = f" (and {len(left) - 10} more)" if len(left) > 10 else ""
            raise WeightError(f"checkpoint {ckpt_dir}: {len(left)} unexpected tensors not used by the model: "
                              f"{', '.join(left[:10])}{more}")


def checkpoint_tensors(model: nn.Module, cfg: ModelConfig, quant: str = "none") -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint names, in checkpoint order (the inverse of
    load_weights). quant: "none"; "fp8" (block-scaled e4m3 projections, as DeepSeek-V3 ships);
    "mxfp4" (routed experts only, compressed-tensors pack-quantized, as K3 ships)."""
    if quant not in QUANT_TARGETS:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {sorted(QUANT_TARGETS)}")
    prefix, out = checkpoint_prefix(cfg), {}
    for pname, p in model.named_parameters():
        rule, names = sources(pname, cfg)
        t = p.detach()
        parts = (list(t.unbind(0)) if rule.combine == "stack" else list(t.split(rule.split(cfg)))) if rule else [t]
        for n, part in zip(names, parts):
            fmt = QUANT_TARGETS[quant](n, part.shape)
            if fmt != "none":
                out.update({prefix + k: v for k, v in quantize_for_checkpoint(n, part, fmt).items()})
            else:
                out[prefix + n] = part.contiguous()
    return out


def _fp8_target(name: str, shape) -> str:
    skip = ("embed_tokens", "lm_head", ".mlp.gate.", "_res_proj", "eh_proj")
    return "fp8" if _is_linear(name, shape) and not any(s in name for s in skip) else "none"


def _mxfp4_target(name: str, shape) -> str:
    return "mxfp4" if ".mlp.experts." in name and shape[-1] % 32 == 0 else "none"


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
