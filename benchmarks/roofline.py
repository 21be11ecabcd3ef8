"""The roofline of one forward of the model: the bytes it must move (weights it touches, caches it
reads and writes) over the copy bandwidth, or its flops over the GEMM rate, whichever is larger.
benchmarks/e2e.py judges every step it times against it.

    python benchmarks/roofline.py --sizes '{"dense_params": 100, ...}' --seqs 1 --q 1 --ctx 9 \
        --copy-gbps 1 --gemm-tflops 1e-3          # prints the roofline of that step as JSON
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from k3trt.config import ModelConfig


@dataclass(frozen=True)
class Sizes:
    """What one forward reads, from the model's parameters (main layers only; no MTP layer)."""
    dense_params: int        # everything but routed experts and the embedding (lm_head included)
    dense_bytes: int
    embed_row_bytes: int
    expert_params: int       # one routed expert of one MoE layer
    expert_bytes: int
    moe_layers: int
    num_experts: int
    top_k: int
    mla_layers: int
    kda_layers: int
    heads: int
    mla_row_bytes: int       # one token's MLA cache row
    mla_score_dim: int       # kv_lora + rope: the absorbed score dot product
    kv_lora: int
    qk_head_dim: int         # prefill's naive attention
    v_head_dim: int
    kda_heads: int
    kda_dim: int
    kda_state_bytes: int     # one sequence's fp32 state of one KDA layer (+ conv window)

    @classmethod
    def of(cls, model: torch.nn.Module, kv_dtype: torch.dtype) -> Sizes:
        cfg: ModelConfig = model.cfg
        dense_p = dense_b = exp_p = exp_b = 0
        for name, p in model.named_parameters():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= cfg.num_hidden_layers:
                continue                                   # MTP layers: not in a plain step
            if name.endswith("embed_tokens.weight"):
                continue
            if ".mlp.experts." in name:
                exp_p += p.numel() // cfg.num_experts
                exp_b += p.numel() * p.element_size() // cfg.num_experts
            else:
                dense_p += p.numel()
                dense_b += p.numel() * p.element_size()
        moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
        la, itemsize = cfg.linear_attn_config, torch.empty(0, dtype=kv_dtype).element_size()
        act = next(model.parameters()).element_size()
        conv = 3 * la.num_heads * la.head_dim * (la.short_conv_kernel_size - 1) * act
        return cls(dense_p, dense_b, cfg.hidden_size * act, exp_p // max(moe, 1), exp_b // max(moe, 1), moe,
                   cfg.num_experts, cfg.num_experts_per_token, len(cfg.mla_layers), len(cfg.kda_layers),
                   cfg.num_attention_heads, cfg.mla_cache_dim * itemsize, cfg.mla_cache_dim, cfg.kv_lora_rank,
                   cfg.qk_head_dim, cfg.v_head_dim, la.num_heads, la.head_dim,
                   la.num_heads * la.head_dim * la.head_dim * 4 + conv)


def roofline(sz: Sizes, *, seqs: int, q: int, ctx: float, copy_gbps: float, gemm_tflops: float,
             save_states: bool = False, prefill: bool = False) -> dict:
    """The floor of one forward over `seqs` sequences of `q` new tokens each after `ctx` cached ones.

    bytes: every weight the step touches, read once: the non-expert weights (lm_head included; of the
      embedding only the T rows looked up) and, per MoE layer, the distinct experts the T = seqs·q
      tokens route to, expected under uniform routing: E·(1 − (1 − k/E)^T) (k at T = 1, all E by
      T ≈ 8 for 16 of 32); plus the caches: each sequence's MLA rows read (ctx + q, per MLA layer)
      and its q rows written, each sequence's KDA state (fp32) and conv window read and written
      once per KDA layer (q more states written when a verify step saves them for rollback).
    flops: 2 · (non-expert + k experts' params) per token, plus attention: decode/verify absorbed
      MLA (2·H·(ctx+q)·(kv_lora + rope + kv_lora) per token), naive causal MLA for a prefill
      (2·H·(ctx + q/2)·(qk_head_dim + v_head_dim) per token), KDA's recurrence (≈ 8·H·dk·dv per token).
    time: max(bytes / copy bandwidth, flops / GEMM rate); both ceilings measured in the same run.
    """
    T = seqs * q
    experts = sz.num_experts * (1 - (1 - sz.top_k / sz.num_experts) ** T)
    weights = sz.dense_bytes + T * sz.embed_row_bytes + sz.moe_layers * experts * sz.expert_bytes
    kv = sz.mla_layers * seqs * ((ctx + q) * sz.mla_row_bytes + q * sz.mla_row_bytes) \
        + sz.kda_layers * seqs * sz.kda_state_bytes * (2 + (q if save_states else 0))
    nbytes = weights + kv
    span = ctx + (q / 2 if prefill else q)
    attn = sz.mla_layers * 2 * sz.heads * span * ((sz.qk_head_dim + sz.v_head_dim) if prefill
                                                  else (sz.mla_score_dim + sz.kv_lora))
    flops = T * (2 * (sz.dense_params + sz.moe_layers * sz.top_k * sz.expert_params) + attn
                 + sz.kda_layers * 8 * sz.kda_heads * sz.kda_dim ** 2)
    t_bytes, t_flops = nbytes / (copy_gbps * 1e9), flops / (gemm_tflops * 1e12)
    return {"bytes": int(nbytes), "weight_bytes": int(weights), "cache_bytes": int(kv), "flops": int(flops),
            "experts_per_moe_layer": round(experts, 2), "bytes_ms": round(t_bytes * 1e3, 4),
            "flops_ms": round(t_flops * 1e3, 4), "roofline_ms": round(max(t_bytes, t_flops) * 1e3, 4),
            "bound": "memory" if t_bytes >= t_flops else "compute"}



def with_roofline(row: dict, sz: Sizes, ceil: dict, *, seqs: int, q: int, ctx: float, **kw) -> dict:
    r = roofline(sz, seqs=seqs, q=q, ctx=ctx, copy_gbps=ceil["copy_gbps"], gemm_tflops=ceil["gemm_tflops"], **kw)
    row["roofline"] = r
    if row.get("step_ms"):
        row["ratio"] = round(row["step_ms"] / r["roofline_ms"], 3)
    return row



def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", required=True, help="JSON object with every Sizes field")
    ap.add_argument("--seqs", type=int, required=True)
    ap.add_argument("--q", type=int, required=True)
    ap.add_argument("--ctx", type=float, required=True)
    ap.add_argument("--copy-gbps", type=float, required=True)
    ap.add_argument("--gemm-tflops", type=float, required=True)
    ap.add_argument("--save-states", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    a = ap.parse_args(argv)
    r = roofline(Sizes(**json.loads(a.sizes)), seqs=a.seqs, q=a.q, ctx=a.ctx, copy_gbps=a.copy_gbps,
                 gemm_tflops=a.gemm_tflops, save_states=a.save_states, prefill=a.prefill)
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
