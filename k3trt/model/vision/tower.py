"""MoonViT: patch embedding, pre-norm transformer blocks with 2-D RoPE attention over each image's
own patches, a final LayerNorm. Module and parameter names are the published checkpoint's
(``vision_tower.encoder.blocks.{b}.wqkv`` ...), so the loader's vision rule is the identity.

Images of different sizes share one call: attention is block-diagonal by image, in one of three
ways (``ATTENTION``): "varlen", torch's variable-length flash attention over all images at once
(CUDA, bf16/fp16); "sdpa", SDPA per image (flash on a GPU too, a launch per image and layer);
"masked", one SDPA over all rows under a same-image mask (static shapes: the exported
per-capacity graphs). "auto" takes varlen where torch offers it, else sdpa.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from k3trt.model.vision.embed import PatchEmbed
from k3trt.model.vision.geometry import VisionBatch
from k3trt.model.vision.rope import apply_rope, rope_angles
from k3trt.vision_config import VisionConfig

try:                    # torch >= 2.10 on CUDA: flash attention over packed variable-length sequences
    from torch.nn.attention.varlen import varlen_attn
except ImportError:     # older torch: SDPA per image
    varlen_attn = None

ACT = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


def _masked(q: Tensor, k: Tensor, v: Tensor, batch: VisionBatch) -> Tensor:
    same = batch.segment[:, None] == batch.segment[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=same[None, None])
    return out[0].transpose(0, 1)


def _per_image(q: Tensor, k: Tensor, v: Tensor, batch: VisionBatch) -> Tensor:
    outs, start = [], 0
    for n in batch.lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None],
                                           v[sl].transpose(0, 1)[None])
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def _varlen(q: Tensor, k: Tensor, v: Tensor, batch: VisionBatch) -> Tensor:
    cu = batch.cu_seqlens.to(device=q.device, dtype=torch.int32)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, batch.max_len, batch.max_len)


ATTENTION = {"masked": _masked, "sdpa": _per_image, "varlen": _varlen}


def attention_mode(mode: str, x: Tensor) -> str:
    """`mode` with "auto" resolved for activations `x`; a ValueError for an unknown or unusable one."""
    fast = varlen_attn is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
    resolved = ("varlen" if fast else "sdpa") if mode == "auto" else mode
    if resolved not in ATTENTION:
        raise ValueError(f"vision attention {mode!r}: choose auto, {', '.join(ATTENTION)}")
    if resolved == "varlen" and not fast:
        raise ValueError("vision attention 'varlen' needs torch.nn.attention.varlen and CUDA bf16/fp16 activations")
    return resolved


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc1(self.act(self.fc0(x)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.norm0 = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.norm1 = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.wqkv = nn.Linear(h, 3 * h)
        self.wo = nn.Linear(h, h)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: VisionBatch, attention: str) -> Tensor:
        q, k, v = self.wqkv(self.norm0(x)).unflatten(-1, (3, self.heads, self.head_dim)).unbind(1)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        x = x + self.wo(ATTENTION[attention](q, k, v, batch).flatten(1))
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, x: Tensor, batch: VisionBatch, attention: str) -> Tensor:
        rope = rope_angles(batch.rope_pos, self.cfg.head_dim, self.cfg.rope_theta)
        for block in self.blocks:
            x = block(x, rope, batch, attention)
        return self.final_layernorm(x)


class MoonViT(nn.Module):
    """pixel_values [P, 3, p, p] -> [P, hidden]: one row per patch, in input order."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, pixel_values: Tensor, batch: VisionBatch, attention: str = "auto") -> Tensor:
        x = self.patch_embed(pixel_values, batch)
        return self.encoder(x, batch, attention_mode(attention, x))
