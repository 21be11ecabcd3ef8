"""Multi-head latent attention (MLA): K3's NoPE target layers and RoPE/YaRN draft and MTP layers.

Two forms that must agree:
  naive     per sequence: expand the cached latent rows through kv_b_proj into per-head K and V,
            causal softmax. Used for prefill chunks.
  absorbed  q_lat = q_nope · W_UK (128 → kv_lora per head); every head attends to the one shared
            latent row [kv_c | k_pe] (MQA over 576 values in K3) through ``k3trt::mla_verify``;
            out = out_lat · W_UV. Used for decode (Q = 1) and verification (Q = K+1).
New tokens are written to the paged cache first (``k3trt::mla_cache_write``), so both forms read
the same (possibly fp8) values.

Tensor parallel: each rank holds num_attention_heads / tp heads (q_b_proj, kv_b_proj, g_proj
column-parallel, o_proj row-parallel + all-reduce). Decode context parallel (dcp > 1): the cache
holds this rank's tokens only (the step's slot_mapping is -1 for other ranks' tokens, its
block_table addresses the local pages) and every step takes the absorbed form, merged across the
DCP group by k3trt.parallel.attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3trt.config import ModelConfig, RopeScaling
from k3trt.model.context import StepContext
from k3trt.model.layers import RMSNorm
from k3trt.parallel.attention import dcp_mla_attention
from k3trt.parallel.comm import SINGLE, Comm
from k3trt.plugins.cache_write import read_cache_rows

# Uniform steps of at most this many tokens per sequence take the absorbed (fused) path: the
# verification widths (K+1 <= 8). Longer uniform chunks are prefill, where the naive form is cheaper.
ABSORBED_MAX_Q = 8


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float, rs: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin magnitude scale (DeepSeek YaRN when rope_type is yarn)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if rs is None or rs.rope_type == "default" or rs.factor <= 1:
        return inv.float(), 1.0

    def corr_dim(rot: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(rs.beta_fast)), 0)
    high = min(math.ceil(corr_dim(rs.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = inv / rs.factor * (1 - extrapolate) + inv * extrapolate
    return inv.float(), yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mag: float) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last dim; x is [T, ..., dim]."""
    ang = positions.float()[:, None] * inv_freq.to(positions.device)[None]            # [T, dim/2]
    shape = (ang.shape[0],) + (1,) * (x.dim() - 2) + (ang.shape[1],)
    cos, sin = (torch.cos(ang) * mag).view(shape), (torch.sin(ang) * mag).view(shape)
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, *, use_rope: bool | None = None, comm: Comm = SINGLE):
        super().__init__()
        self.cfg, self.comm = cfg, comm
        self.use_rope = (not cfg.mla_use_nope) if use_rope is None else use_rope
        h, H = cfg.hidden_size, cfg.num_attention_heads // comm.pc.tp      # this rank's heads
        self.num_heads, self.nope, self.rope, self.v_dim = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            # checkpoint: q_a_proj and kv_a_proj_with_mqa, fused here into one GEMM (layout.py)
            self.fused_qkv_a_proj = nn.Linear(h, cfg.q_lora_rank + kv_a, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, H * cfg.qk_head_dim, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(h, kv_a, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        if cfg.mla_use_output_gate:
            self.g_proj = nn.Linear(h, H * cfg.v_head_dim, bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, h, bias=False)
        self.softmax_scale = cfg.softmax_scale
        if self.use_rope:
            inv, self.rope_mag = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
            self.register_buffer("inv_freq", inv, persistent=False)
            rs = cfg.rope_scaling
            if rs is not None and rs.rope_type != "default" and rs.mscale_all_dim:
                self.softmax_scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2

    # ------------------------------------------------------------------------------ projections
    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, hidden] -> q_nope [T,H,nope], q_pe [T,H,rope], kv_c [T,R] (normed), k_pe [T,rope]."""
        if hasattr(self, "fused_qkv_a_proj"):
            q_a, kv_a = self.fused_qkv_a_proj(x).split([self.cfg.q_lora_rank, self.kv_lora + self.rope], -1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q = q.view(-1, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], -1)
        kv_c, k_pe = kv_a.split([self.kv_lora, self.rope], -1)
        kv_c = self.kv_a_layernorm(kv_c)
        if self.use_rope:
            q_pe = apply_rope(q_pe, positions, self.inv_freq, self.rope_mag)
            k_pe = apply_rope(k_pe, positions, self.inv_freq, self.rope_mag)
        return q_nope, q_pe, kv_c, k_pe

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, nope, R], W_UV [H, v, R]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope:]

    # ------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor, kv_scale: float = 1.0,
                *, absorbed: bool | None = None) -> torch.Tensor:
        positions = ctx.positions(x.device) if self.use_rope else None     # NoPE layers need none
        q_nope, q_pe, kv_c, k_pe = self.project(x, positions)
        torch.ops.k3trt.mla_cache_write(kv_c, k_pe, kv_cache, ctx.slot_mapping, kv_scale)
        dcp = self.comm.pc.dcp > 1
        if absorbed is None:
            absorbed = dcp or (ctx.uniform_q is not None and ctx.uniform_q <= ABSORBED_MAX_Q)
        elif dcp and not absorbed:
            raise ValueError("MLA: the naive form needs the whole cache; under DCP use the absorbed form")
        attend = self._absorbed if absorbed else self._naive
        out = attend(q_nope, q_pe, ctx, kv_cache, kv_scale)                      # [T, H, v]
        if hasattr(self, "g_proj"):
            out = out * torch.sigmoid(self.g_proj(x).view_as(out).float()).to(out.dtype)
        return self.comm.all_reduce(self.o_proj(out.flatten(1)), "tp")

    def _absorbed(self, q_nope, q_pe, ctx: StepContext, kv_cache, kv_scale) -> torch.Tensor:
        w_uk, w_uv = self.w_uk_uv()
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q = torch.cat([q_lat, q_pe], dim=-1)
        if self.comm.pc.dcp > 1:
            out_lat = dcp_mla_attention(q, ctx, kv_cache, self.softmax_scale, kv_scale, self.kv_lora, self.comm)
            return torch.einsum("thr,hvr->thv", out_lat, w_uv)
        out_lat, _ = torch.ops.k3trt.mla_verify(
            q, kv_cache, ctx.block_table, ctx.seq_lens(q.device), ctx.uniform_q,
            self.softmax_scale, kv_scale, self.kv_lora)
        return torch.einsum("thr,hvr->thv", out_lat.to(q.dtype), w_uv)

    def _naive(self, q_nope, q_pe, ctx: StepContext, kv_cache, kv_scale) -> torch.Tensor:
        bs, outs = kv_cache.shape[1], []
        for i, (c, n) in enumerate(zip(ctx.ctx_lens, ctx.q_lens)):
            t0 = sum(ctx.q_lens[:i])
            L = c + n
            pos = torch.arange(L, device=kv_cache.device)
            slots = ctx.block_table[i, pos // bs].long() * bs + pos % bs
            rows = read_cache_rows(kv_cache, slots, kv_scale, q_nope.dtype)            # [L, R+rope]
            kv = self.kv_b_proj(rows[:, : self.kv_lora]).view(L, self.num_heads, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], -1)
            k = torch.cat([k_nope, rows[:, None, self.kv_lora:].expand(L, self.num_heads, self.rope)], -1)
            q = torch.cat([q_nope[t0:t0 + n], q_pe[t0:t0 + n]], -1)                      # [n, H, qk]
            mask = torch.arange(L, device=q.device)[None, :] <= (c + torch.arange(n, device=q.device))[:, None]
            o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                               v.transpose(0, 1).float(), attn_mask=mask,
                                               scale=self.softmax_scale)
            outs.append(o.transpose(0, 1).to(q_nope.dtype))
        return torch.cat(outs) if outs else q_nope.new_zeros(0, self.num_heads, self.v_dim)
