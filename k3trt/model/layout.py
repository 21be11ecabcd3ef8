"""The published checkpoint layout: which checkpoint tensors make each model parameter, as data.

Names follow what Moonshot publishes and what transformers' ``models/kimi_linear`` writes and
reads (its ``conversion_mapping.py`` maps these names to its own modules); spec/K3_MODEL.md lists
them. The model's parameter names equal the checkpoint's (below ``language_model.`` in a kimi_k3
checkpoint) except where a rule of ``RULES`` says otherwise:

- MLA ``q_a_proj`` and ``kv_a_proj_with_mqa`` are one fused parameter in the model;
- MoE layers are ``block_sparse_moe`` (router ``gate``, ``shared_experts``, the latent
  projections), routed experts one tensor each, ``experts.{e}.w1 / w3 / w2`` (gate / up / down),
  stacked in the model; dense layers are ``mlp.{gate,up,down}_proj``;
- KDA ``A_log`` is stored [1, 1, H, 1]; the 1-D form is read too;
- the vision tower and projector (``model.vision``, k3trt/model/vision/) keep their published names
  (``vision_tower.*``, ``mm_projector.*``) at the checkpoint's top level, beside ``language_model.``.

``also`` lists other spellings that are read but never written: transformers' ``save_pretrained``
writes a dense layer under ``block_sparse_moe.`` (its conversion renames every ``mlp.`` back).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from k3trt.config import ModelConfig
from k3trt.vision_config import VisionConfig

# A kimi_k3 checkpoint nests the language model under this prefix; a bare Kimi-Linear one does not.
K3_PREFIX = "language_model."
# Other spellings of a K3 checkpoint's prefixes (the serving code maps them the same way).
PREFIX_ALIASES: tuple[tuple[str, str], ...] = (("language_model.layers.", "language_model.model.layers."),)

_LAYER = r"model\.layers\.(?P<i>\d+)\."
_MOE_PARTS = r"(gate|shared_experts|routed_expert_down_proj|routed_expert_up_proj|routed_expert_norm)"


@dataclass(frozen=True)
class Rule:
    """One model parameter's checkpoint tensors."""
    model: str                                   # regex over the model parameter name
    ckpt: tuple[str, ...]                        # published names; {i}... from the regex, {e} = expert
    combine: str = "one"                         # "one"; "cat": along dim 0 in order; "stack": experts
    split: Callable[[ModelConfig], list[int]] | None = None    # "cat" sizes, for writing
    also: tuple[str, ...] = ()                   # other spellings of a "one" tensor, read only
    stored: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None   # published shape of a param shape
    root: bool = False                           # names at the checkpoint's top level (no K3_PREFIX)


RULES: tuple[Rule, ...] = (
    Rule(_LAYER + r"self_attn\.fused_qkv_a_proj\.weight",
         ("model.layers.{i}.self_attn.q_a_proj.weight", "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"),
         "cat", split=lambda c: [c.q_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim]),
    Rule(_LAYER + r"self_attn\.A_log", ("model.layers.{i}.self_attn.A_log",), stored=lambda s: (1, 1, *s, 1)),
    Rule(_LAYER + r"mlp\.experts\.w_gate", ("model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",), "stack"),
    Rule(_LAYER + r"mlp\.experts\.w_up", ("model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",), "stack"),
    Rule(_LAYER + r"mlp\.experts\.w_down", ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",), "stack"),
    Rule(_LAYER + r"mlp\.(?P<rest>" + _MOE_PARTS + r"\..+)", ("model.layers.{i}.block_sparse_moe.{rest}",)),
    Rule(_LAYER + r"mlp\.(?P<rest>(gate|up|down)_proj\.weight)", ("model.layers.{i}.mlp.{rest}",),
         also=("model.layers.{i}.block_sparse_moe.{rest}",)),
    Rule(r"vision\.(?P<rest>(vision_tower|mm_projector)\..+)", ("{rest}",), root=True),
)

# Tensors a checkpoint may carry that duplicate a model parameter: (regex over the checkpoint name,
# the parameter duplicated). DeepSeek-V3-style MTP layers ship their own copies of the embedding and
# of lm_head; the model shares the main ones, so a copy is checked by its header (shape, and that
# it belongs to an MTP layer) and not read.
COPIES: tuple[tuple[str, str], ...] = (
    (_LAYER + r"embed_tokens\.weight", "model.embed_tokens.weight"),
    (_LAYER + r"shared_head\.head\.weight", "lm_head.weight"),
)


def checkpoint_prefix(cfg: ModelConfig) -> str:
    return K3_PREFIX if cfg.model_type == "kimi_k3" else ""


def tensor_prefix(src: "Source", cfg: ModelConfig) -> str:
    """The prefix of `src`'s checkpoint names: none for top-level parts (the vision tower)."""
    return "" if src.rule is not None and src.rule.root else checkpoint_prefix(cfg)


@dataclass(frozen=True)
class Source:
    """Where one model parameter comes from (names without the checkpoint prefix)."""
    rule: Rule | None
    names: tuple[str, ...]       # published names: one, one per "cat" part, or one per expert
    also: tuple[str, ...] = ()   # other spellings of names[0] ("one" rules)

    @property
    def combine(self) -> str:
        return self.rule.combine if self.rule else "one"

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the published layout stores a tensor of model shape `shape` in."""
        return tuple(self.rule.stored(tuple(shape))) if self.rule and self.rule.stored else tuple(shape)


def source(param: str, cfg: ModelConfig) -> Source:
    for rule in RULES:
        m = re.fullmatch(rule.model, param)
        if m:
            g = m.groupdict()
            if rule.combine == "stack":
                return Source(rule, tuple(rule.ckpt[0].format(e=e, **g) for e in range(cfg.num_experts)))
            return Source(rule, tuple(c.format(**g) for c in rule.ckpt), tuple(a.format(**g) for a in rule.also))
    return Source(None, (param,))


def copy_of(name: str, cfg: ModelConfig) -> str | None:
    """The parameter a checkpoint tensor `name` (without prefix) duplicates, if it is an MTP layer's
    copy; None otherwise."""
    for pattern, param in COPIES:
        m = re.fullmatch(pattern, name)
        if m and cfg.num_hidden_layers <= int(m["i"]) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
            return param
    return None


def template(name: str) -> str:
    """A checkpoint name with its layer and expert numbers abstracted: the rule it would follow."""
    name = re.sub(r"(?<=layers\.)\d+", "{i}", name)
    return re.sub(r"(?<=experts\.)\d+", "{e}", name)


def vision_shapes(vc: VisionConfig) -> dict[str, tuple[int, ...]]:
    """The vision tower (MoonViT, transformers' ``kimi_k25``) and projector tensors of a K3
    checkpoint under their published names and shapes: the layout written down independently of
    the model's modules (tests compare the two)."""
    h, inter, p, layers = vc.hidden_size, vc.intermediate_size, vc.patch_size, vc.num_hidden_layers
    merged = vc.merged_size
    out = {"vision_tower.patch_embed.proj.weight": (h, 3, p, p), "vision_tower.patch_embed.proj.bias": (h,),
           "vision_tower.patch_embed.pos_emb.weight": (vc.pos_emb_height, vc.pos_emb_width, h)}
    for b in range(layers):
        pre = f"vision_tower.encoder.blocks.{b}."
        for name, shape in (("norm0", (h,)), ("norm1", (h,)), ("wqkv", (3 * h, h)), ("wo", (h, h)),
                            ("mlp.fc0", (inter, h)), ("mlp.fc1", (h, inter))):
            out[pre + name + ".weight"] = shape
            out[pre + name + ".bias"] = shape[:1]
    out.update({"vision_tower.encoder.final_layernorm.weight": (h,), "vision_tower.encoder.final_layernorm.bias": (h,),
                "mm_projector.pre_norm.weight": (h,), "mm_projector.pre_norm.bias": (h,),
                "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
                "mm_projector.proj.2.weight": (vc.text_hidden_size, merged),
                "mm_projector.proj.2.bias": (vc.text_hidden_size,)})
    return out
