"""Random-weight model presets: the K3 config.json each one writes.

tiny    hybrid (MLA + KDA), MoE, AttnRes, first layer dense, one MTP layer; a short prompt's forward
        takes well under a second on 2 CPU cores. For CI.
small   a few hundred MB, for CPU end-to-end tests that need more than tiny.
medium  K3's real per-layer dimensions with few layers and experts, for GPU benchmarks.
spec    K3's real per-layer dimensions, 8 layers (3 KDA : 1 MLA) and 8 experts top-2, for the
        speculation benchmark (benchmarks/spec_speedup.py), which runs them 93 deep, K3's depth, each
        layer reading one of these 8 layers' weights (benchmarks/deep_model.py), so the one MTP
        layer is K3's share of a step; top-2 of 8 makes a 4-row verify touch ~2.7x the experts of
        a decode row (K3's top-16 of 896: ~3.9x). ~9.3B parameters, ~19 GB in bf16.
"""

from __future__ import annotations

from typing import Any

# Per-preset overrides of the text config; everything else comes from K3_DEFAULTS.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
        q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        routed_expert_hidden_size=64, num_expert_group=2, topk_group=1,
        linear_attn_config=dict(kda_layers=[1, 2, 4], full_attn_layers=[3], num_heads=2, head_dim=32,
                                short_conv_kernel_size=4, use_full_rank_gate=True),
        attn_res_block_size=2, num_nextn_predict_layers=1, max_position_embeddings=4096,
    ),
    "small": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1536,
        q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        num_experts=32, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=256,
        routed_expert_hidden_size=384, num_expert_group=4, topk_group=2,
        linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], num_heads=8,
                                head_dim=64, short_conv_kernel_size=4, use_full_rank_gate=True),
        attn_res_block_size=3, num_nextn_predict_layers=1, max_position_embeddings=16384,
    ),
    "medium": dict(
        hidden_size=7168, num_hidden_layers=4, num_attention_heads=96, intermediate_size=18432,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=32, num_experts_per_token=16, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, num_expert_group=1, topk_group=1,
        linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=96, head_dim=128,
                                short_conv_kernel_size=4, use_full_rank_gate=True),
        attn_res_block_size=2, num_nextn_predict_layers=1, max_position_embeddings=131072,
    ),
    "spec": dict(
        hidden_size=7168, num_hidden_layers=8, num_attention_heads=96, intermediate_size=18432,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=8, num_experts_per_token=2, num_shared_experts=2, moe_intermediate_size=3072,
        routed_expert_hidden_size=3584, num_expert_group=1, topk_group=1,
        linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8],
                                num_heads=96, head_dim=128, short_conv_kernel_size=4, use_full_rank_gate=True),
        attn_res_block_size=2, num_nextn_predict_layers=1, max_position_embeddings=131072,
    ),
}

# What K3 itself sets (spec/K3_MODEL.md), shared by every preset.
K3_DEFAULTS: dict[str, Any] = dict(
    model_type="kimi_linear", rms_norm_eps=1e-6, tie_word_embeddings=False,
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    mla_use_nope=True, mla_use_output_gate=True, rope_theta=50000.0,
    moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=2.5,
    use_grouped_topk=True, topk_method="noaux_tc", first_k_dense_replace=1, moe_layer_freq=1,
    latent_moe_use_norm=True,
)


# Each preset's MoonViT (vision_config in the released spelling): tiny for CI; small a few layers;
# medium the published per-layer sizes (Kimi K2.5 / K3: 1152 wide, 16 heads, 4304 MLP, 64×64
# position table) with few layers; spec a tiny tower (its benchmark is text-only and needs the
# memory for layers). The projector maps to the preset's text hidden size.
VISION_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=2,
                 init_pos_emb_height=4, init_pos_emb_width=4),
    "small": dict(vt_hidden_size=256, vt_intermediate_size=768, vt_num_attention_heads=4, vt_num_hidden_layers=4,
                  init_pos_emb_height=16, init_pos_emb_width=16),
    "medium": dict(vt_hidden_size=1152, vt_intermediate_size=4304, vt_num_attention_heads=16, vt_num_hidden_layers=4,
                   init_pos_emb_height=64, init_pos_emb_width=64),
    "spec": dict(vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=2,
                 init_pos_emb_height=4, init_pos_emb_width=4),
}
VISION_DEFAULTS: dict[str, Any] = dict(
    model_type="kimi_k25_vision", patch_size=14, init_pos_emb_time=4, merge_kernel_size=[2, 2],
    pos_emb_type="divided_fixed", merge_type="sd2_tpool", video_attn_type="spatial_temporal",
    mm_projector_type="patchmerger", projector_hidden_act="gelu", projector_ln_eps=1e-5)


def vision_preset(name: str, text_hidden_size: int) -> dict[str, Any]:
    vc = {**VISION_DEFAULTS, **VISION_PRESETS[name]}
    return {**vc, "mm_hidden_size": vc["vt_hidden_size"], "text_hidden_size": text_hidden_size}


def preset_config(name: str, vocab_size: int, *, pad_token_id: int = 0) -> dict[str, Any]:
    """The full K3 config.json (model_type kimi_k3, text under text_config) for a preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    text = {**K3_DEFAULTS, **PRESETS[name], "vocab_size": vocab_size}
    text["linear_attn_config"] = {**text["linear_attn_config"], "gate_lower_bound": -5.0}
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": vision_preset(name, text["hidden_size"]),
        "media_placeholder_token_id": 163605,
        "pad_token_id": pad_token_id,
        "torch_dtype": "bfloat16",
    }
