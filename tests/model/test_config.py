import copy
import json
from pathlib import Path

import pytest

from k3trt.config import ConfigError, ModelConfig
from k3trt.model.presets import PRESETS, preset_config


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_parse_and_round_trip(preset):
    raw = preset_config(preset, 129280)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.model_type == "kimi_k3" and cfg.vocab_size == 129280
    assert cfg.mla_cache_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert len(cfg.mla_layers) >= 1 and len(cfg.kda_layers) >= 2 or preset == "medium"
    bare = {**cfg.to_dict(), "model_type": "kimi_linear"}
    again = ModelConfig.from_dict(json.loads(json.dumps(bare)))
    assert again.to_dict() == cfg.to_dict()


def test_k3_medium_has_k3_per_layer_dims():
    cfg = ModelConfig.from_dict(preset_config("medium", 163840))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (7168, 96, 1536, 512)
    assert cfg.mla_cache_dim == 576 and cfg.routed_expert_hidden_size == 3584
    assert cfg.linear_attn_config.num_heads == 96 and cfg.linear_attn_config.head_dim == 128
    assert cfg.num_experts_per_token == 16


def test_layer_kinds_follow_one_based_lists():
    cfg = ModelConfig.from_dict(preset_config("tiny", 129280))
    la = cfg.linear_attn_config
    assert [cfg.is_kda(i) for i in range(cfg.num_hidden_layers)] == \
        [(i + 1) in la.kda_layers for i in range(cfg.num_hidden_layers)]
    assert not cfg.is_moe(0) and all(cfg.is_moe(i) for i in range(1, cfg.num_hidden_layers))


def _break(mutate):
    raw = preset_config("tiny", 129280)
    mutate(raw)
    return raw


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.update(model_type="llama"), "model_type"),
    (lambda r: r.pop("text_config"), "text_config"),
    (lambda r: r["text_config"].pop("hidden_size"), "text_config.hidden_size"),
    (lambda r: r["text_config"].pop("num_experts"), "text_config.num_experts"),
    (lambda r: r["text_config"].update(num_experts_per_token=99), "text_config.num_experts_per_token"),
    (lambda r: r["text_config"].update(num_expert_group=3), "text_config.num_expert_group"),
    (lambda r: r["text_config"].update(topk_group=5), "text_config.topk_group"),
    (lambda r: r["text_config"].update(hidden_act="gelu"), "text_config.hidden_act"),
    (lambda r: r["text_config"].update(hidden_size=-1), "text_config.hidden_size"),
    (lambda r: r["text_config"].update(qk_rope_head_dim=3), "text_config.qk_rope_head_dim"),
    (lambda r: r["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3, 4]), "text_config.linear_attn_config"),
    (lambda r: r["text_config"]["linear_attn_config"].update(kda_layers=[1, 9]), "text_config.linear_attn_config"),
    (lambda r: r["text_config"]["linear_attn_config"].update(kda_layers=[1]), "text_config.linear_attn_config"),
    (lambda r: r["text_config"].update(linear_attn_config=[1]), "text_config.linear_attn_config"),
    (lambda r: r["text_config"].update(first_k_dense_replace=9), "text_config.first_k_dense_replace"),
])
def test_bad_configs_name_the_field(mutate, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        ModelConfig.from_dict(_break(mutate))


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        ModelConfig.from_json(tmp_path)
    bad = copy.deepcopy(preset_config("tiny", 129280))
    bad["text_config"].pop("vocab_size")
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"config.json: required field 'text_config.vocab_size'"):
        ModelConfig.from_json(tmp_path)


def test_config_is_frozen():
    cfg = ModelConfig.from_dict(preset_config("tiny", 129280))
    with pytest.raises(Exception):
        cfg.hidden_size = 3


DATA = Path(__file__).resolve().parents[1] / "data"


def test_released_kimi_linear_config_parses():
    """Kimi-Linear-48B-A3B's config.json, fields as published (model_max_length, no layer_types)."""
    cfg = ModelConfig.from_json(DATA / "kimi_linear_48b_a3b_config.json")
    assert cfg.model_type == "kimi_linear" and cfg.num_hidden_layers == 27
    assert len(cfg.kda_layers) == 20 and cfg.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert cfg.max_position_embeddings == 1048576 and cfg.mla_use_nope and cfg.q_lora_rank is None
    assert not cfg.linear_attn_config.use_full_rank_gate           # low-rank g_a_proj / g_b_proj
    assert not cfg.is_moe(0) and cfg.is_moe(1) and cfg.num_experts == 256
    # transformers reads the same file to the same layer kinds
    transformers = pytest.importorskip("transformers", minversion="5")
    raw = json.loads((DATA / "kimi_linear_48b_a3b_config.json").read_text())
    hf = transformers.KimiLinearConfig(**{k: v for k, v in raw.items() if k not in ("auto_map", "transformers_version")})
    assert [t == "linear_attention" for t in hf.layer_types] == [cfg.is_kda(i) for i in range(27)]
    assert [t == "sparse" for t in hf.mlp_layer_types] == [cfg.is_moe(i) for i in range(27)]


def _transformers_style(**over):
    """The text config as transformers' KimiLinearConfig.save_pretrained writes it."""
    raw = dict(model_type="kimi_linear", vocab_size=256, hidden_size=64, intermediate_size=96,
               moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=16,
               q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=8,
               num_experts_per_token=2, num_shared_experts=1, num_expert_group=1, topk_group=1,
               moe_renormalize=True, model_max_length=4096, linear_head_dim=16, linear_num_heads=2,
               linear_conv_kernel_dim=4, routed_scaling_factor=2.446, rms_norm_eps=1e-5, head_dim=8,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
               mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    raw.update(over)
    return raw


def test_transformers_style_config():
    cfg = ModelConfig.from_dict(_transformers_style())
    la = cfg.linear_attn_config
    assert (la.kda_layers, la.full_attn_layers) == ((1, 3), (2, 4))
    assert (la.num_heads, la.head_dim, la.short_conv_kernel_size) == (2, 16, 4)
    assert cfg.first_k_dense_replace == 1 and cfg.max_position_embeddings == 4096
    assert cfg.mla_use_nope                       # transformers' Kimi-Linear MLA never rotates
    alias = ModelConfig.from_dict(_transformers_style(num_local_experts=8, num_experts_per_tok=2, n_group=1))
    assert alias == cfg


@pytest.mark.parametrize("over, field", [
    (dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"]), "mlp_layer_types"),
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]), "layer_types"),
    (dict(model_max_length=4096, max_position_embeddings=8192), "model_max_length"),
    (dict(first_k_dense_replace=2), "mlp_layer_types"),
    (dict(linear_attn_config={"kda_layers": [1, 2]}), "layer_types"),
])
def test_transformers_style_conflicts_name_the_field(over, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        ModelConfig.from_dict(_transformers_style(**over))
