"""A differentiable whole-sequence forward over a K3ForCausalLM's own parameters, for training a
small model here (benchmarks/train_draft.py). The runtime's forward reads and writes caches through
k3trt ops that have no backward; this one runs the same math on batches of equal-length sequences
from position 0 with the ops' plain-torch references (plugins/*_ref.py), so the trained weights
mean the same thing to the runtime (tests/benchmarks/test_train_forward.py compares the two).

    hidden = forward(model, ids)                      # ids [B, T] -> [B·T, hidden] before the final norm
    logits = model.lm_head(norm(hidden, model.model.norm))
    mtp_logits = mtp(model, hidden, ids)              # [B·(T-1), V]: position i predicts ids[:, i + 2]
    skip = early_exit(...)                            # hidden after the first N layers (layer-skip drafts)

Under bf16 autocast the routing and the KDA recurrence stay in fp32, as the runtime runs them.
Differences from the runtime, all numerically neutral: MoE experts run densely (every expert on
every row, weighted by the routing's sparse combine weights), attention through SDPA with a causal
mask, KDA in its chunked reference form from a zero state, the short conv from an empty window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3trt.config import ModelConfig
from k3trt.model.k3 import DecoderLayer, K3ForCausalLM
from k3trt.model.kda import KDA, PREFILL_CHUNK
from k3trt.model.layers import GatedMLP
from k3trt.model.mla import MLA, apply_rope
from k3trt.model.moe import MoE, route
from k3trt.plugins.attn_res_ref import attn_res_reference
from k3trt.plugins.kda_front_ref import kda_prep_reference
from k3trt.plugins.kda_ref import kda_chunked_reference, short_conv_reference
from k3trt.plugins.moe_route_ref import moe_route_reference
from k3trt.plugins.norm_act_ref import ACTIVATIONS, rms_norm_reference


def norm(x: torch.Tensor, module) -> torch.Tensor:
    return rms_norm_reference(x, module.weight, module.eps)


def act(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return ACTIVATIONS[cfg.hidden_act](gate, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


def mlp(cfg: ModelConfig, m: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return m.down_proj(act(cfg, m.gate_proj(x), m.up_proj(x)))


def moe(cfg: ModelConfig, m: MoE, x: torch.Tensor) -> torch.Tensor:
    """x [N, hidden]: the latent MoE with every expert run densely."""
    with torch.autocast(x.device.type, enabled=False):      # fp32 routing, as the runtime's
        scores = x.float() @ m.gate.weight.float().t()
    if cfg.use_grouped_topk and cfg.num_expert_group > 1:      # moe.route's grouped branch is plain torch
        ids, w = route(cfg, scores, m.gate.e_score_correction_bias.float())
    else:                                                      # its other branch takes the op on CUDA
        bias = m.gate.e_score_correction_bias.float() if cfg.topk_method == "noaux_tc" else None
        ids, w = moe_route_reference(scores, bias, cfg.num_experts_per_token,
                                     cfg.moe_router_activation_func == "sigmoid", cfg.moe_renormalize,
                                     cfg.routed_scaling_factor)
    E = m.experts.w_gate.shape[0]
    combine = torch.zeros(x.shape[0], E, device=x.device, dtype=torch.float32).scatter(1, ids, w)
    lat = m.routed_expert_down_proj(x) if hasattr(m, "routed_expert_down_proj") else x
    ex = m.experts
    h = act(cfg, torch.einsum("nw,eiw->nei", lat, ex.w_gate), torch.einsum("nw,eiw->nei", lat, ex.w_up))
    y = torch.einsum("nei,ewi->new", h, ex.w_down)
    y = (y.float() * combine[..., None]).sum(1).to(x.dtype)
    if hasattr(m, "routed_expert_norm"):
        y = norm(y, m.routed_expert_norm)
    if hasattr(m, "routed_expert_up_proj"):
        y = m.routed_expert_up_proj(y)
    if hasattr(m, "shared_experts"):
        y = y + mlp(cfg, m.shared_experts, x)
    return y


def mla(a: MLA, x: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """x [B·T, hidden], causal attention within each sequence of T."""
    if hasattr(a, "fused_qkv_a_proj"):
        q_a, kv_a = a.fused_qkv_a_proj(x).split([a.cfg.q_lora_rank, a.kv_lora + a.rope], -1)
        q = a.q_b_proj(norm(q_a, a.q_a_layernorm))
    else:
        q, kv_a = a.q_proj(x), a.kv_a_proj_with_mqa(x)
    H = a.num_heads
    q_nope, q_pe = q.view(-1, H, a.nope + a.rope).split([a.nope, a.rope], -1)
    kv_c, k_pe = kv_a.split([a.kv_lora, a.rope], -1)
    kv_c = norm(kv_c, a.kv_a_layernorm)
    if a.use_rope:
        pos = torch.arange(T, device=x.device).repeat(B)
        q_pe, k_pe = apply_rope(q_pe, pos, a.inv_freq, a.rope_mag), apply_rope(k_pe, pos, a.inv_freq, a.rope_mag)
    k_nope, v = a.kv_b_proj(kv_c).view(-1, H, a.nope + a.v_dim).split([a.nope, a.v_dim], -1)
    k = torch.cat([k_nope, k_pe[:, None].expand(-1, H, a.rope)], -1)
    qq = torch.cat([q_nope, q_pe], -1)
    heads = lambda t: t.view(B, T, H, -1).transpose(1, 2)        # noqa: E731
    o = F.scaled_dot_product_attention(heads(qq), heads(k), heads(v), is_causal=True, scale=a.softmax_scale)
    o = o.transpose(1, 2).reshape(B * T, H, a.v_dim)
    if hasattr(a, "g_proj"):
        o = o * torch.sigmoid(a.g_proj(x).view_as(o).float()).to(o.dtype)
    return a.o_proj(o.flatten(1))


def kda(m: KDA, x: torch.Tensor, B: int, T: int) -> torch.Tensor:
    H, D = m.num_heads, m.head_dim
    qkv, gate, f, b = m.project(x)
    conv_w = torch.cat([m.q_conv1d.weight, m.k_conv1d.weight, m.v_conv1d.weight], 0)
    C = qkv.shape[-1]
    y, _, _ = short_conv_reference(qkv.view(B, T, C), conv_w, qkv.new_zeros(B, C, m.kernel - 1), False)
    q, k, v, g, beta = kda_prep_reference(y.reshape(B * T, C), f, b, m.dt_bias, m.A_log, H, D, m.gate_lower_bound)
    shape = (B, T, H, D)
    with torch.autocast(x.device.type, enabled=False):      # the delta rule in fp32, as the runtime's
        o, _ = kda_chunked_reference(q.view(shape), k.view(shape), v.view(shape), g.view(shape), beta.view(B, T, H),
                                     q.new_zeros(B, H, D, D), m.scale, PREFILL_CHUNK)
    o = (norm(o.reshape(B * T, H, D), m.o_norm) * torch.sigmoid(gate.float())).to(x.dtype).reshape(B * T, H * D)
    return m.o_proj(o)


def mixer(layer: DecoderLayer, x: torch.Tensor, B: int, T: int) -> torch.Tensor:
    return kda(layer.self_attn, x, B, T) if layer.is_kda else mla(layer.self_attn, x, B, T)


def ffn(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    m = layer.mlp
    return moe(layer.cfg, m, x) if isinstance(m, MoE) else mlp(layer.cfg, m, x)


def prenorm(layer: DecoderLayer, h: torch.Tensor, B: int, T: int) -> torch.Tensor:
    h = h + mixer(layer, norm(h, layer.input_layernorm), B, T)
    return h + ffn(layer, norm(h, layer.post_attention_layernorm))


def attn_res_layer(layer: DecoderLayer, prefix, hidden, blocks, B: int, T: int):
    """DecoderLayer.forward_attn_res on the references; returns (prefix, hidden)."""
    Bk, i, eps = layer.cfg.attn_res_block_size, layer.idx, layer.cfg.rms_norm_eps
    write, nprev = i % Bk == 0, -(-i // Bk)
    x, prefix = attn_res_reference(prefix, hidden, blocks, layer.self_attention_res_norm.weight,
                                   layer.self_attention_res_proj.weight, layer.input_layernorm.weight,
                                   nprev, i // Bk if write else -1, eps)
    a = mixer(layer, x, B, T)
    prefix, delta = (a, None) if write else (prefix, a)
    y, prefix = attn_res_reference(prefix, delta, blocks, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight,
                                   layer.post_attention_layernorm.weight, nprev + write, -1, eps)
    return prefix, ffn(layer, y)


def forward(model: K3ForCausalLM, ids: torch.Tensor, *, exit_after: int | None = None):
    """ids [B, T] -> hidden [B·T, hidden] after every decoder layer (before the final norm); with
    `exit_after` N also the hidden a layer-skip draft of the first N layers computes (layer_skip.py),
    as (hidden, early)."""
    cfg, m = model.cfg, model.model
    B, T = ids.shape
    h = m.embed_tokens(ids.reshape(-1))
    layers = m.layers[:cfg.num_hidden_layers]
    early = None
    if not cfg.attn_res_block_size:
        for j, layer in enumerate(layers):
            h = prenorm(layer, h, B, T)
            if j + 1 == exit_after:
                early = h
        return (h, early) if exit_after else h
    blocks = h.new_zeros(h.shape[0], cfg.num_attn_res_blocks, h.shape[1])
    prefix, hidden = h, None
    Bk, eps = cfg.attn_res_block_size, cfg.rms_norm_eps

    def mix(nblocks: int):
        out, _ = attn_res_reference(prefix, hidden, blocks, m.output_attn_res_norm.weight,
                                    m.output_attn_res_proj.weight, None, nblocks, -1, eps)
        return out
    for j, layer in enumerate(layers):
        prefix, hidden = attn_res_layer(layer, prefix, hidden, blocks, B, T)
        if j + 1 == exit_after:
            early = mix(-(-exit_after // Bk))
    out = mix(cfg.num_attn_res_blocks)
    return (out, early) if exit_after else out


def logits(model: K3ForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(norm(hidden, model.model.norm)).float()


def mtp(model: K3ForCausalLM, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """MTP layer 0 over each sequence: row i joins the target's (final-normed) hidden at i with the
    embedding of ids[:, i + 1] and predicts ids[:, i + 2]. Returns logits [B·(T-1), V] fp32."""
    cfg, m = model.cfg, model.model
    B, T = ids.shape
    layer = m.layers[cfg.num_hidden_layers]
    prev = norm(hidden, m.norm).view(B, T, -1)[:, :-1].reshape(B * (T - 1), -1)
    emb = m.embed_tokens(ids[:, 1:].reshape(-1))
    h = layer.eh_proj(torch.cat([norm(emb, layer.enorm), norm(prev, layer.hnorm)], -1))
    h = prenorm(layer, h, B, T - 1)
    return model.lm_head(norm(h, layer.shared_head.norm)).float()
