"""Tiny random transformers Kimi-Linear models, saved with save_pretrained: the published layout
as transformers writes it, and the parity oracle."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers", minversion="5")


def hf_config(*, q_lora: bool = True, grouped: bool = True, layers: int = 4, vocab_size: int = 160):
    """KDA and MLA layers alternating, a dense first layer, MoE with a shared expert."""
    return transformers.KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=24 if q_lora else None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4 if grouped else 1,
        topk_group=2 if grouped else 1, routed_scaling_factor=2.446,
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)


def hf_model(seed: int = 0, **kw):
    """A random KimiLinearForCausalLM in fp32, eval mode. Norm weights and router biases are
    perturbed so that a test can tell whether each was applied."""
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(hf_config(**kw)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def save(model, out) -> None:
    model.save_pretrained(out)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of one sequence, fp32, without a cache."""
    with torch.no_grad():
        return model(ids[None], use_cache=False).logits[0].float()
