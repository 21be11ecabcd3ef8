"""The Kimi K3 language model: embedding, hybrid decoder layers with AttnRes, final norm, lm_head,
and the MTP layers (DeepSeek-V3 style next-token-prediction heads) when the config has them.

Module names equal the checkpoint's names below ``language_model.`` except where layout.py's
rules (data) say otherwise: an MoE layer's ``mlp`` is the checkpoint's ``block_sparse_moe``, its
experts are stacked. MTP layer j is ``model.layers[num_hidden_layers + j]``, as in DeepSeek-V3.

``comm`` (k3trt/parallel) makes this one rank's shard: the mixers and MLPs split as their modules
say. lm_head is vocab-parallel: each rank holds and reads 1/tp of it per step (K3: 163840 × 7168,
2.3 GB in bf16) and the [rows, V/tp] logits are all-gathered. The embedding stays replicated: a
lookup reads only T rows, and splitting it would add an all-reduce of [T, hidden].
"""

from __future__ import annotations

import torch
from torch import nn

from k3trt.config import ModelConfig
from k3trt.model.attn_res import attn_res
from k3trt.model.context import ModelCache, StepContext
from k3trt.model.kda import KDA
from k3trt.model.layers import GatedMLP, RMSNorm
from k3trt.model.mla import MLA
from k3trt.model.moe import MoE
from k3trt.model.vision import VisionEncoder
from k3trt.parallel.comm import SINGLE, Comm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, *, mtp: bool = False, comm: Comm = SINGLE):
        super().__init__()
        self.idx, self.cfg, self.is_kda = idx, cfg, (not mtp) and cfg.is_kda(idx)
        H = cfg.hidden_size
        self.self_attn = KDA(cfg, comm) if self.is_kda else MLA(cfg, use_rope=True if mtp else None, comm=comm)
        self.mlp = MoE(cfg, comm) if (mtp or cfg.is_moe(idx)) else GatedMLP(cfg, H, cfg.intermediate_size, comm)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if cfg.attn_res_block_size and not mtp:
            self.self_attention_res_norm = RMSNorm(H, cfg.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(H, 1, bias=False)
            self.mlp_res_norm = RMSNorm(H, cfg.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(H, 1, bias=False)

    def mixer(self, x: torch.Tensor, ctx: StepContext, cache: ModelCache) -> torch.Tensor:
        if self.is_kda:
            return self.self_attn(x, ctx, cache.kda[self.idx])
        return self.self_attn(x, ctx, cache.mla[self.idx], cache.kv_scale)

    def forward_prenorm(self, h: torch.Tensor, ctx: StepContext, cache: ModelCache) -> torch.Tensor:
        """Ordinary pre-norm residual layer (no AttnRes; also the MTP layers)."""
        h = h + self.mixer(self.input_layernorm(h), ctx, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_attn_res(self, prefix, hidden, blocks, ctx: StepContext, cache: ModelCache):
        """One layer under AttnRes (spec/K3_MODEL.md); returns (prefix, hidden)."""
        B, l, eps = self.cfg.attn_res_block_size, self.idx, self.cfg.rms_norm_eps
        write, nprev = l % B == 0, -(-l // B)
        x, prefix = attn_res(prefix, hidden, blocks, self.self_attention_res_norm.weight,
                             self.self_attention_res_proj.weight, self.input_layernorm.weight,
                             nprev, l // B if write else -1, eps)
        a = self.mixer(x, ctx, cache)
        prefix, delta = (a, None) if write else (prefix, a)
        y, prefix = attn_res(prefix, delta, blocks, self.mlp_res_norm.weight, self.mlp_res_proj.weight,
                             self.post_attention_layernorm.weight, nprev + write, -1, eps)
        return prefix, self.mlp(y)


class MTPLayer(DecoderLayer):
    """Predicts token t+2 from the target's hidden state at t and the embedding of token t+1."""

    def __init__(self, cfg: ModelConfig, idx: int, comm: Comm = SINGLE):
        super().__init__(cfg, idx, mtp=True, comm=comm)
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, prev_hidden: torch.Tensor, ctx: StepContext, cache: ModelCache):
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(prev_hidden)], dim=-1))
        return self.forward_prenorm(h, ctx, cache)


class K3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm = SINGLE):
        super().__init__()
        self.cfg = cfg
        H, L = cfg.hidden_size, cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, comm=comm) for i in range(L)] +
                                    [MTPLayer(cfg, L + j, comm) for j in range(cfg.num_nextn_predict_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if cfg.attn_res_block_size:
            self.output_attn_res_norm = RMSNorm(H, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(H, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, ctx: StepContext, cache: ModelCache,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids int64 [T] -> the residual stream after the last layer (before the final norm).
        embeds: (rows int64 [N], values [N, hidden]) replacing those rows' token embeddings (the
        image embeddings at their placeholders)."""
        cfg = self.cfg
        h = self.embed_tokens(input_ids)
        if embeds is not None:
            h = h.index_copy(0, embeds[0], embeds[1].to(h.dtype))
        layers = self.layers[: cfg.num_hidden_layers]
        if not cfg.attn_res_block_size:
            for layer in layers:
                h = layer.forward_prenorm(h, ctx, cache)
            return h
        blocks = h.new_zeros(h.shape[0], cfg.num_attn_res_blocks, h.shape[1])
        prefix, hidden = h, None
        for layer in layers:
            prefix, hidden = layer.forward_attn_res(prefix, hidden, blocks, ctx, cache)
        out, _ = attn_res(prefix, hidden, blocks, self.output_attn_res_norm.weight,
                          self.output_attn_res_proj.weight, None, cfg.num_attn_res_blocks, -1, cfg.rms_norm_eps)
        return out


class K3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm = SINGLE):
        super().__init__()
        comm.pc.validate(cfg)
        self.cfg, self.comm = cfg, comm
        self.model = K3Model(cfg, comm)
        # tied weights stay replicated (the embedding is); otherwise lm_head is vocab-parallel
        self.vocab_parallel = comm.pc.tp > 1 and not cfg.tie_word_embeddings
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // (comm.pc.tp if self.vocab_parallel else 1),
                                 bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # after the text modules: their parameters (and random-init draws) come first
        self.vision = VisionEncoder(cfg.vision) if cfg.vision is not None else None

    def forward(self, input_ids: torch.Tensor, ctx: StepContext, cache: ModelCache,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] (pre-norm); `logits(hidden[rows])` gives the logits you need.
        embeds: K3Model.forward's image embeddings."""
        return self.model(input_ids, ctx, cache, embeds)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(self.model.norm(hidden)).float()

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lm_head(x)
        return self.comm.all_gather(y, "tp", dim=-1) if self.vocab_parallel else y

    def mtp(self, j: int, prev_hidden: torch.Tensor, next_ids: torch.Tensor, ctx: StepContext,
            cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer j: (its output after shared_head.norm, its logits fp32). The embedding and
        lm_head are shared. `prev_hidden` is the target's hidden after the final norm
        (``model.norm(forward(...))``) or, chained, a previous MTP step's first output, as K3's
        production code feeds it (runtime/speculative/mtp.py)."""
        layer = self.model.layers[self.cfg.num_hidden_layers + j]
        g = layer.shared_head.norm(layer(self.model.embed_tokens(next_ids), prev_hidden, ctx, cache))
        return g, self._head(g).float()
