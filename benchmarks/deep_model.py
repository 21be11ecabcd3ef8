"""A target as deep as Kimi K3 on one GPU, for timing: `layers` decoder layers (K3: 93) whose
weights are those of `distinct` built layers, reused in turn, each layer with its own KV cache and
KDA state. K3's per-layer weights (~1.9 GB a layer in bf16 at the spec preset's sizes) are ~40× an
H100's or H200's 50 MB L2, so a layer that reuses another's tensors still reads them from HBM: a
decode or verify step costs what `layers` distinct layers cost, while the weights take `distinct`
layers' memory. That puts the one MTP layer at K3's share of a step (~1/93), which 24 distinct
layers (all that fit beside batch 32's KDA states) cannot.

    cfg, model = deep_model("spec", vocab, layers=93, distinct=8, dtype=torch.bfloat16, device="cuda")
    raw, small = built_layers(...); cfg, model = deep_view(raw, small, 64)    # another depth, same tensors

Layer i reuses built layer j of the same kind (dense / MoE, KDA / MLA): layers below `distinct` are
their own; above, j cycles over the built layers after the first `period` (the preset's KDA / MLA
pattern) so the kinds line up. The MTP layer, embeddings, head and vision tower are the built ones.
"""

from __future__ import annotations

import torch
from torch import nn

from k3trt.config import ModelConfig
from k3trt.model.fuse import fuse_projections_
from k3trt.model.k3 import K3ForCausalLM
from k3trt.model.loader import build_model
from k3trt.model.presets import preset_config
from k3trt.model.weights import init_random_


def layer_kinds(text: dict, n: int) -> dict:
    """The text config at n layers, its KDA / MLA pattern repeated from the preset's (1-based lists)."""
    la, q = text["linear_attn_config"], period(text)
    kda = set(la["kda_layers"])
    kinds = [(i % q) + 1 in kda for i in range(n)]
    return {**text, "num_hidden_layers": n,
            "linear_attn_config": {**la, "kda_layers": [i + 1 for i, k in enumerate(kinds) if k],
                                   "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if not k]}}


def period(text: dict) -> int:
    """The length of the preset's KDA / MLA pattern (4 for 3 KDA : 1 MLA)."""
    L0, kda = text["num_hidden_layers"], set(text["linear_attn_config"]["kda_layers"])
    kinds = [i in kda for i in range(1, L0 + 1)]
    return next(q for q in range(1, L0 + 1) if all(kinds[i] == kinds[i % q] for i in range(L0)))


def source_layer(i: int, layers: int, distinct: int, p: int) -> int:
    """The built layer whose weights layer i reads (the MTP layer, index `layers`, maps to `distinct`)."""
    if i == layers:
        return distinct
    if i < distinct:
        return i
    return p + (i - p) % (distinct - p)


def built_layers(preset: str, vocab: int, *, distinct: int | None, dtype: torch.dtype, device: str | torch.device,
                 seed: int = 0) -> tuple[dict, K3ForCausalLM]:
    """The preset's config (as make-checkpoint writes it) and a model of `distinct` layers with
    random weights (None: the preset's own count): the tensors every deep view reads."""
    raw = preset_config(preset, vocab)
    text = raw["text_config"]
    p = period(text)
    if distinct is None:
        distinct = text["num_hidden_layers"]
    elif distinct <= p or (distinct - p) % p:
        raise ValueError(f"distinct layers {distinct} must exceed the layer pattern's period {p} by a multiple of it")
    small = build_model(deep_config(raw, distinct), dtype=dtype, device=device)
    init_random_(small, seed, device=device)
    return raw, small


def deep_config(raw: dict, layers: int) -> ModelConfig:
    return ModelConfig.from_dict({**raw, "text_config": layer_kinds(raw["text_config"], layers)})


def deep_view(raw: dict, small: K3ForCausalLM, layers: int) -> tuple[ModelConfig, K3ForCausalLM]:
    """A model of `layers` decoder layers on `small`'s tensors (module doc); no weight memory of its own."""
    text, distinct = raw["text_config"], small.cfg.num_hidden_layers
    p = period(text)
    if layers < distinct:
        raise ValueError(f"a deep view needs at least the {distinct} built layers, got {layers}")
    cfg = deep_config(raw, layers)
    if layers == distinct:
        return cfg, small
    with torch.device("meta"):
        deep = K3ForCausalLM(cfg)
    # the engine fuses projections (model/fuse.py) into new tensors: fused once here, on the built
    # layers, and shared too, each view module then holds them and has nothing left to fuse
    fuse_projections_(small)
    src = dict(small.named_modules())
    for name, mod in deep.named_modules():
        parts = name.split(".")
        if len(parts) > 2 and parts[:2] == ["model", "layers"]:
            parts[2] = str(source_layer(int(parts[2]), layers, distinct, p))
        s = src[".".join(parts)]
        if type(s) is not type(mod):
            raise AssertionError(f"{name} would reuse a {type(s).__name__} for its {type(mod).__name__}")
        for table in ("_parameters", "_buffers"):
            for key, t in getattr(mod, table).items():
                u = getattr(s, table)[key]
                if t is not None and (u is None or u.shape != t.shape):
                    raise AssertionError(f"{name}.{key}: shape {tuple(t.shape)} against the built {u and tuple(u.shape)}")
                getattr(mod, table)[key] = u
        for key, v in vars(s).items():          # what fusing set: None, or absent, before it
            if v is not None and not isinstance(v, (dict, nn.Module)) and vars(mod).get(key, None) is None:
                setattr(mod, key, v)
    left = [n for n, t in [*deep.named_parameters(), *deep.named_buffers()] if t.is_meta]
    if left:
        raise AssertionError(f"tensors left unbuilt: {left[:5]}")
    return cfg, deep.eval()


def deep_model(preset: str, vocab: int, *, layers: int, distinct: int, dtype: torch.dtype,
               device: str | torch.device, seed: int = 0) -> tuple[ModelConfig, K3ForCausalLM]:
    raw, small = built_layers(preset, vocab, distinct=distinct, dtype=dtype, device=device, seed=seed)
    return deep_view(raw, small, layers)
