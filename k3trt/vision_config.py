"""``VisionConfig``: the MoonViT vision tower and projector of a K3 checkpoint, frozen, read once.

K3's vision tower is Kimi K2.5's. Two spellings of its ``vision_config`` parse to the same
object: the released one (``vt_hidden_size``, ``init_pos_emb_height``, the projector's
``mm_hidden_size`` / ``projector_ln_eps`` inside ``vision_config``) and the one transformers'
``kimi_k25`` writes (``hidden_size``, ``pos_emb_height``, ``rope_parameters``, the projector's
``projection_hidden_size`` / ``projection_layer_norm_eps`` at the top level). Defaults are the
published MoonViT sizes; the preprocessing fields are the released image processor's.
Errors name the field (``vision_config.vt_hidden_size``).

Beside ``k3trt/config.py`` (not under ``model/``) because ``ModelConfig`` carries it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

# released name -> field name
ALIASES: dict[str, str] = {
    "vt_hidden_size": "hidden_size",
    "vt_intermediate_size": "intermediate_size",
    "vt_num_hidden_layers": "num_hidden_layers",
    "vt_num_attention_heads": "num_attention_heads",
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
    "mm_hidden_size": "projection_hidden_size",
    "projector_ln_eps": "projection_layer_norm_eps",
}
# transformers' kimi_k25 keeps the projector fields at the top level of config.json
TOP_FIELDS = ("projection_hidden_size", "projection_layer_norm_eps")
# released fields that name a variant: the one value each that this implementation computes
VARIANTS: dict[str, str] = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool",
                            "mm_projector_type": "patchmerger", "video_attn_type": "spatial_temporal"}
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


class VisionConfigError(ValueError):
    """A ``vision_config`` this implementation cannot run; the message names the field."""


@dataclass(frozen=True)
class VisionConfig:
    """MoonViT + patch-merger projector. Shapes: a patch is [3, patch_size, patch_size]; the tower
    runs hidden_size wide; merge_kernel_size (kh, kw) patches become one token of
    kh·kw·hidden_size, projected to text_hidden_size."""
    text_hidden_size: int                        # the projector's output: the language model's hidden
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    hidden_act: str = "gelu_pytorch_tanh"        # the tower's MLP
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5                       # the tower's LayerNorms
    projection_hidden_size: int | None = None    # the projector's pre-norm width (= hidden_size)
    projection_layer_norm_eps: float = 1e-5
    projector_hidden_act: str = "gelu"
    # the released image processor
    max_patches: int = 16384                     # patches per image before the merge
    max_patches_per_side: int = 512
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if self.projection_hidden_size is None:
            object.__setattr__(self, "projection_hidden_size", self.hidden_size)
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def merged_size(self) -> int:
        """Width of a merged token (the projector's input)."""
        return self.hidden_size * self.merge_area

    def validate(self, prefix: str = "vision_config.") -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise VisionConfigError(f"field '{prefix}{name}' {msg}")

        for name in ("text_hidden_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "patch_size", "pos_emb_height", "pos_emb_width", "pos_emb_time",
                     "max_patches", "max_patches_per_side"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive integer, got {v!r}")
        need(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads",
             f"({self.num_attention_heads}) must divide hidden_size ({self.hidden_size})")
        need(self.head_dim % 4 == 0, "hidden_size",
             f"gives head_dim {self.head_dim}; the 2-D RoPE needs a multiple of 4")
        need(len(self.merge_kernel_size) == 2 and all(isinstance(k, int) and k > 0 for k in self.merge_kernel_size),
             "merge_kernel_size", f"must be two positive integers, got {self.merge_kernel_size!r}")
        need(self.hidden_act in ACTIVATIONS, "hidden_act", f"is {self.hidden_act!r}; supported: {ACTIVATIONS}")
        need(self.projector_hidden_act in ACTIVATIONS, "projector_hidden_act",
             f"is {self.projector_hidden_act!r}; supported: {ACTIVATIONS}")
        need(self.projection_hidden_size == self.hidden_size, "mm_hidden_size",
             f"({self.projection_hidden_size}) must equal the tower's hidden size ({self.hidden_size}): "
             "the projector normalises each patch before the merge")
        need(len(self.image_mean) == 3 and len(self.image_std) == 3 and all(s > 0 for s in self.image_std),
             "image_mean", "and image_std must list 3 values (std positive)")

    @classmethod
    def from_dict(cls, vc: Mapping[str, Any], *, text_hidden_size: int,
                  top: Mapping[str, Any] | None = None) -> "VisionConfig":
        """From config.json's ``vision_config`` (`vc`); `top` is the whole config.json (for
        transformers' top-level projector fields); `text_hidden_size` the language model's hidden."""
        prefix = "vision_config."
        if not isinstance(vc, Mapping):
            raise VisionConfigError(f"field '{prefix[:-1]}' must be an object")
        raw: dict[str, Any] = {k: v for k, v in (top or {}).items() if k in TOP_FIELDS}
        for key, value in vc.items():
            name = ALIASES.get(key, key)
            if name in raw and key != name and raw[name] != value:
                raise VisionConfigError(f"fields '{prefix}{key}' ({value!r}) and '{name}' ({raw[name]!r}) disagree")
            raw[name] = value
        for key, want in VARIANTS.items():
            if key in vc and vc[key] != want:
                raise VisionConfigError(f"field '{prefix}{key}' is {vc[key]!r}; only {want!r} (Kimi K2.5 / K3's "
                                        "MoonViT) is supported")
        rope = vc.get("rope_parameters")
        if isinstance(rope, Mapping) and "rope_theta" in rope:
            raw.setdefault("rope_theta", rope["rope_theta"])
        got = raw.get("text_hidden_size", text_hidden_size)
        if got != text_hidden_size:
            raise VisionConfigError(f"field '{prefix}text_hidden_size' ({got}) is not the text model's hidden_size "
                                    f"({text_hidden_size})")
        raw["text_hidden_size"] = text_hidden_size
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        for name in ("merge_kernel_size", "image_mean", "image_std"):
            if name in kwargs:
                if not isinstance(kwargs[name], (list, tuple)):
                    raise VisionConfigError(f"field '{prefix}{name}' must be a list, got {kwargs[name]!r}")
                kwargs[name] = tuple(kwargs[name])
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise VisionConfigError(f"field '{prefix[:-1]}' is malformed ({e})") from None
