"""The transformers baseline of benchmarks/e2e.py: DeepSeek-V3 (transformers has no K3) built at the
preset's dimensions with random weights on the device, timed through ``generate``, greedy."""

from __future__ import annotations

import json
import time

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from k3trt.config import ModelConfig


def hf_config(cfg: ModelConfig):
    """DeepSeek-V3 at K3's dimensions (transformers has no K3; its experts work at the full hidden
    size, K3's latent ones at routed_expert_hidden_size, and its attention is MLA in every layer)."""
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=cfg.num_shared_experts, n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_token, n_group=cfg.num_expert_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, first_k_dense_replace=cfg.first_k_dense_replace,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, max_position_embeddings=8192,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=None)




def build(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """(the model, what the record says of it)."""
    t0 = time.perf_counter()
    hcfg = hf_config(cfg)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = DeepseekV3ForCausalLM(hcfg).eval()
    finally:
        torch.set_default_dtype(old)
    return model, {"params": sum(p.numel() for p in model.parameters()),
                   "build_s": round(time.perf_counter() - t0, 2),
                   "config": json.loads(hcfg.to_json_string(use_diff=True))}


def generate_s(model, ids: torch.Tensor, n: int) -> float:
    """Seconds for ``generate`` of exactly n new tokens after the prompts `ids`."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        if ids.is_cuda:
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n, out.shape
        return time.perf_counter() - t0


def time_generate(model, ids: torch.Tensor, n: int) -> dict:
    """One batch's row: generate(n) against generate(1), so the decode rate leaves the prefill out."""
    b = ids.shape[0]
    generate_s(model, ids[:, :16], 2)                                      # warm-up
    t1, tn = generate_s(model, ids, 1), generate_s(model, ids, n)
    dec = b * (n - 1) / (tn - t1) if tn > t1 else None
    return {"new_tokens": n, "wall_s": round(tn, 4), "tokens_per_s": round(b * n / tn, 2),
            "decode_tokens_per_s": round(dec, 2) if dec else None,
            "step_ms": round((tn - t1) * 1e3 / (n - 1), 4) if dec else None,
            "note": "tokens_per_s includes the prompt's prefill; decode_* from generate(n) - generate(1)"}
