"""Typed, frozen configuration read once from a checkpoint's ``config.json``.

A K3 checkpoint has ``model_type: "kimi_k3"`` with the language model under ``text_config``; a
bare Kimi-Linear text config (``model_type: "kimi_linear"``) is a supported model too. Every field
of spec/K3_MODEL.md is here; fields the spec gives defaults for take those defaults, fields it does
not are required. Errors name the field (``text_config.hidden_size``) and the file.

Both config styles parse: the released one (``linear_attn_config``, ``first_k_dense_replace``,
``max_position_embeddings``...) and the one transformers' ``KimiLinearConfig`` writes, which spells
some fields differently (``ALIASES``), lists layer kinds as ``layer_types`` / ``mlp_layer_types``
and keeps the KDA geometry in ``linear_num_heads`` / ``linear_head_dim`` / ``linear_conv_kernel_dim``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from k3trt.vision_config import VisionConfig, VisionConfigError

REQUIRED = object()
TEXT_MODEL_TYPES = ("kimi_linear", "kimi_k3_text")
TOP_MODEL_TYPE = "kimi_k3"


# Other spellings of a field (transformers' attribute_map of KimiLinearConfig / DeepseekV3Config).
ALIASES: dict[str, str] = {
    "model_max_length": "max_position_embeddings",
    "num_local_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
}
# transformers' flat KDA geometry fields -> linear_attn_config fields
LINEAR_ALIASES: dict[str, str] = {
    "linear_num_heads": "num_heads",
    "linear_head_dim": "head_dim",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}
# Defaults that depend on the text config's model_type: Kimi-Linear's MLA layers are NoPE
# (transformers' KimiLinearModel has no rotary embedding at all).
TYPE_DEFAULTS: dict[str, dict[str, Any]] = {"kimi_linear": {"mla_use_nope": True}}
LAYER_TYPES = {"linear_attention": "kda_layers", "full_attention": "full_attn_layers"}
MLP_LAYER_TYPES = ("dense", "sparse")


class ConfigError(ValueError):
    """A config.json that is not a usable Kimi K3 config; the message names the field."""


@dataclass(frozen=True)
class LinearAttnConfig:
    """``text_config.linear_attn_config``: which layers are KDA and the KDA head geometry."""
    kda_layers: tuple[int, ...] = ()          # 1-based layer numbers
    full_attn_layers: tuple[int, ...] = ()    # 1-based layer numbers
    num_heads: int = 0
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = False         # False: low-rank g_a_proj / g_b_proj output gate
    gate_lower_bound: float | None = None     # set: g = lb * sigmoid(...); None: KimiLinear gate


@dataclass(frozen=True)
class RopeScaling:
    """DeepSeek YaRN parameters; only draft/MTP MLA layers rotate (K3 target layers are NoPE)."""
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """The language model of Kimi K3 (the ``text_config``), plus the top-level ids we use."""
    # sizes
    vocab_size: int = REQUIRED
    hidden_size: int = REQUIRED
    num_hidden_layers: int = REQUIRED
    num_attention_heads: int = REQUIRED
    intermediate_size: int = REQUIRED
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = False
    mla_use_output_gate: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # MoE
    num_experts: int = REQUIRED
    num_experts_per_token: int = REQUIRED
    num_shared_experts: int = 1
    moe_intermediate_size: int = REQUIRED
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = REQUIRED
    moe_layer_freq: int = 1
    # hybrid, residuals, MTP
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    attn_res_block_size: int | None = None
    num_nextn_predict_layers: int = 0
    # quantization (raw mapping; the weight loader interprets it)
    quantization_config: Mapping[str, Any] | None = field(default=None, compare=False)
    # top level
    model_type: str = TOP_MODEL_TYPE
    pad_token_id: int = 0
    media_placeholder_token_id: int | None = None
    # the vision tower and projector (config.json's vision_config); None: a text-only checkpoint
    vision: VisionConfig | None = None

    # ----------------------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Values per token in the latent MLA cache: [kv_c (kv_lora_rank) | k_pe (rope)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    def is_kda(self, layer: int) -> bool:
        """0-based layer index; the config lists 1-based layer numbers."""
        return (layer + 1) in self.linear_attn_config.kda_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_kda(i))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_kda(i))

    @property
    def num_attn_res_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size) if self.attn_res_block_size else 0

    # ----------------------------------------------------------------------------- parsing
    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json (is this a Hugging Face checkpoint directory?)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ModelConfig":
        if not isinstance(raw, Mapping):
            raise ConfigError("config is not a JSON object")
        model_type = raw.get("model_type")
        if model_type == TOP_MODEL_TYPE:
            text = raw.get("text_config")
            if not isinstance(text, Mapping):
                raise ConfigError("field 'text_config' is missing or not an object (model_type kimi_k3)")
            prefix = "text_config."
            top = {k: raw[k] for k in ("pad_token_id", "media_placeholder_token_id") if k in raw}
            quant = raw.get("quantization_config", text.get("quantization_config"))
        elif model_type in TEXT_MODEL_TYPES:
            text, prefix, top, quant = raw, "", {}, raw.get("quantization_config")
        else:
            raise ConfigError(f"field 'model_type' is {model_type!r}; expected {TOP_MODEL_TYPE!r} "
                              f"or one of {TEXT_MODEL_TYPES} (this is not a Kimi K3 checkpoint)")
        text = _normalise(text, prefix, text.get("model_type", model_type))
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("model_type", "quantization_config", "pad_token_id", "media_placeholder_token_id",
                          "vision"):
                continue
            if f.name in text:
                kwargs[f.name] = _convert(f.name, text[f.name], prefix)
            elif f.default is REQUIRED:
                raise ConfigError(f"required field '{prefix}{f.name}' is missing")
        cfg = cls(**kwargs, model_type=model_type, quantization_config=quant, **top)
        cfg.validate(prefix)
        if model_type == TOP_MODEL_TYPE and raw.get("vision_config") is not None:
            try:
                vision = VisionConfig.from_dict(raw["vision_config"], text_hidden_size=cfg.hidden_size, top=raw)
            except VisionConfigError as e:
                raise ConfigError(str(e)) from None
            cfg = dataclasses.replace(cfg, vision=vision)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The text config as plain JSON data (round-trips through from_dict)."""
        out = dataclasses.asdict(self)
        for k in ("model_type", "pad_token_id", "media_placeholder_token_id", "quantization_config", "vision"):
            out.pop(k)
        out["linear_attn_config"]["kda_layers"] = list(self.linear_attn_config.kda_layers)
        out["linear_attn_config"]["full_attn_layers"] = list(self.linear_attn_config.full_attn_layers)
        if self.quantization_config is not None:
            out["quantization_config"] = dict(self.quantization_config)
        return out

    def validate(self, prefix: str = "") -> None:
        """Consistency checks; each failure names the field."""
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"field '{prefix}{name}' {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "num_experts", "num_experts_per_token", "moe_intermediate_size", "moe_layer_freq"):
            need(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        need(self.qk_rope_head_dim >= 0 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             f"must be a non-negative even number, got {self.qk_rope_head_dim}")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "must be positive or null")
        need(self.hidden_act in ACTIVATIONS, "hidden_act", f"is {self.hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        if self.hidden_act == "situ":
            need(self.activation_situ_beta is not None and self.activation_situ_beta > 0,
                 "activation_situ_beta", "must be a positive number when hidden_act is 'situ'")
        need(self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
             f"({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})")
        need(self.num_experts % self.num_expert_group == 0, "num_expert_group",
             f"({self.num_expert_group}) does not divide num_experts ({self.num_experts})")
        need(1 <= self.topk_group <= self.num_expert_group, "topk_group",
             f"({self.topk_group}) must be in 1..num_expert_group ({self.num_expert_group})")
        need(self.moe_router_activation_func in ROUTER_ACTIVATIONS, "moe_router_activation_func",
             f"is {self.moe_router_activation_func!r}; supported: {ROUTER_ACTIVATIONS}")
        need(self.topk_method in TOPK_METHODS, "topk_method", f"is {self.topk_method!r}; supported: {TOPK_METHODS}")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"({self.first_k_dense_replace}) must be in 0..num_hidden_layers")
        need(self.routed_expert_hidden_size is None or self.routed_expert_hidden_size > 0,
             "routed_expert_hidden_size", "must be positive or null")
        need(self.attn_res_block_size is None or self.attn_res_block_size > 0, "attn_res_block_size",
             "must be positive or null")
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        la, n = self.linear_attn_config, self.num_hidden_layers
        kda, full = set(la.kda_layers), set(la.full_attn_layers)
        need(all(1 <= i <= n for i in kda | full), "linear_attn_config",
             f"lists a layer outside 1..{n} (layer numbers are 1-based)")
        need(not (kda & full), "linear_attn_config", f"lists layers {sorted(kda & full)} as both KDA and full attention")
        if full:
            need(kda | full == set(range(1, n + 1)), "linear_attn_config",
                 f"leaves layers {sorted(set(range(1, n + 1)) - kda - full)} neither KDA nor full attention")
        if kda:
            need(la.num_heads > 0 and la.head_dim > 0, "linear_attn_config.num_heads",
                 "and head_dim must be positive when kda_layers is non-empty")
            need(la.short_conv_kernel_size >= 1, "linear_attn_config.short_conv_kernel_size", "must be >= 1")
        if self.rope_scaling is not None and not self.mla_use_nope:
            need(self.rope_scaling.rope_type in ("default", "yarn", "deepseek_yarn"), "rope_scaling.rope_type",
                 f"is {self.rope_scaling.rope_type!r}; supported: default, yarn, deepseek_yarn")


ACTIVATIONS = {"silu", "situ"}
ROUTER_ACTIVATIONS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy")


def _convert(name: str, value: Any, prefix: str) -> Any:
    """Turn one raw JSON value into the dataclass field's type."""
    if name == "linear_attn_config":
        return _sub(LinearAttnConfig, value, prefix + name, tuples=("kda_layers", "full_attn_layers"))
    if name == "rope_scaling":
        if value is None:
            return None
        value = dict(value)
        value.setdefault("rope_type", value.pop("type", "default"))
        return _sub(RopeScaling, value, prefix + name)
    if isinstance(value, (dict, list)):
        raise ConfigError(f"field '{prefix}{name}' must be a scalar, got {type(value).__name__}")
    return value


def _normalise(text: Mapping[str, Any], prefix: str, model_type: str) -> dict[str, Any]:
    """The text config in the released style: aliases renamed, transformers' layer lists turned
    into linear_attn_config / first_k_dense_replace, model-type defaults filled in."""
    out = {**TYPE_DEFAULTS.get(model_type, {}), **text}
    for alias, name in ALIASES.items():
        if alias in text:
            if name in text and text[name] != text[alias]:
                raise ConfigError(f"fields '{prefix}{alias}' ({text[alias]!r}) and '{prefix}{name}' "
                                  f"({text[name]!r}) disagree")
            out[name] = text[alias]
    la = out.get("linear_attn_config")
    if la is None or isinstance(la, Mapping):
        la = dict(la or {})
        for flat, name in LINEAR_ALIASES.items():
            if flat in text:
                la.setdefault(name, text[flat])
        types = text.get("layer_types")
        if types is not None:
            lists = _layer_lists(types, prefix)
            for name, layers in lists.items():
                if name in la and sorted(la[name]) != layers:
                    raise ConfigError(f"field '{prefix}layer_types' disagrees with "
                                      f"'{prefix}linear_attn_config.{name}' ({la[name]})")
                la[name] = layers
        if la:
            out["linear_attn_config"] = la
    mlp = text.get("mlp_layer_types")
    if mlp is not None:
        first = _first_sparse(mlp, prefix)
        if "first_k_dense_replace" in text and text["first_k_dense_replace"] != first:
            raise ConfigError(f"field '{prefix}mlp_layer_types' disagrees with "
                              f"'{prefix}first_k_dense_replace' ({text['first_k_dense_replace']})")
        out["first_k_dense_replace"] = first
        if out.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"field '{prefix}moe_layer_freq' must be 1 beside mlp_layer_types")
    return out


def _layer_lists(types: Any, prefix: str) -> dict[str, list[int]]:
    """transformers' ``layer_types`` -> {"kda_layers": [...], "full_attn_layers": [...]}, 1-based."""
    if not isinstance(types, list) or not all(t in LAYER_TYPES for t in types):
        raise ConfigError(f"field '{prefix}layer_types' must list {sorted(LAYER_TYPES)}, got {types!r}")
    return {name: [i + 1 for i, t in enumerate(types) if t == kind] for kind, name in LAYER_TYPES.items()}


def _first_sparse(types: Any, prefix: str) -> int:
    """transformers' ``mlp_layer_types`` -> first_k_dense_replace (dense layers first, then MoE)."""
    if not isinstance(types, list) or not all(t in MLP_LAYER_TYPES for t in types):
        raise ConfigError(f"field '{prefix}mlp_layer_types' must list {MLP_LAYER_TYPES}, got {types!r}")
    first = types.index("sparse") if "sparse" in types else len(types)
    if any(t != "sparse" for t in types[first:]):
        raise ConfigError(f"field '{prefix}mlp_layer_types' mixes dense layers after MoE ones ({types}); "
                          "only dense-first layouts are supported")
    return first


def _sub(cls, value: Any, where: str, tuples: tuple[str, ...] = ()):
    if not isinstance(value, Mapping):
        raise ConfigError(f"field '{where}' must be an object")
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: (tuple(int(x) for x in v) if k in tuples else v) for k, v in value.items() if k in known}
    return cls(**kwargs)
