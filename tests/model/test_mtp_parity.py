"""k3trt's MTP layer against DeepSeek-V3's published definition of a multi-token-prediction module,
and the runtime feeding it the hidden state K3's production code feeds it (after the final norm).

transformers' DeepseekV3 has no MTP module, so the reference is written here from DeepSeek-V3's
definition: h' = eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)]), one decoder layer (transformers'
DeepseekV3DecoderLayer: MLA with RoPE / YaRN, MoE with the noaux_tc router and a shared expert,
weights copied from k3trt's layer), then shared_head.norm and the shared lm_head. Given the same
input hidden states k3trt's MTP logits must match in fp32, for a prompt, decode steps through its
cache and a 4-row (absorbed-MLA) step.
"""

import pytest
import torch
import torch.nn.functional as F
from model_utils import BLOCK, num_blocks, step_ctx
from runtime_utils import prompts

from k3trt.config import ModelConfig
from k3trt.model.context import ModelCache
from k3trt.model.loader import build_model
from k3trt.model.weights import init_random_
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.testing import rel_norm_error

transformers = pytest.importorskip("transformers", minversion="5")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402 (after the importorskip)
    DeepseekV3DecoderLayer,
    DeepseekV3RotaryEmbedding,
)

REL = 1e-4
EPS = 1e-6
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
VARIANTS = {"q_lora-yarn": {"q_lora_rank": 24, "rope_scaling": YARN}, "no_q_lora-default_rope": {"q_lora_rank": None}}
SIZES = {"vocab_size": 160, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 32,
         "num_experts_per_token": 2, "routed_scaling_factor": 2.446, "rope_theta": 10000.0,
         "max_position_embeddings": 4096}


def k3trt_config(variant: dict) -> ModelConfig:
    """One MLA target layer (dense) and one MTP layer; routing grouped like DeepSeek-V3's."""
    return ModelConfig.from_dict(dict(
        SIZES, model_type="kimi_linear", num_hidden_layers=1, num_experts=8, num_shared_experts=1,
        num_expert_group=4, topk_group=2, first_k_dense_replace=1, hidden_act="silu", rms_norm_eps=EPS,
        linear_attn_config={"kda_layers": [], "full_attn_layers": [1]}, num_nextn_predict_layers=1, **variant))


def hf_config(cfg: ModelConfig):
    rs = cfg.rope_scaling
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if rs is not None:
        rope.update(rope_type="yarn", factor=rs.factor, original_max_position_embeddings=rs.original_max_position_embeddings,
                    beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=2, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, n_shared_experts=cfg.num_shared_experts,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token, n_group=cfg.num_expert_group,
        topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=True,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, first_k_dense_replace=1,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
        rope_interleave=True, attn_implementation="eager")


def hf_mtp_layer(model, cfg: ModelConfig):
    """transformers' decoder layer (index 1: MoE) holding the weights of k3trt's MTP layer 0."""
    hc = hf_config(cfg)
    layer = DeepseekV3DecoderLayer(hc, layer_idx=1).float().eval()
    src = model.model.layers[cfg.num_hidden_layers]
    w = {n: p.detach() for n, p in src.named_parameters()}
    out = {}
    if cfg.q_lora_rank:
        out["self_attn.q_a_proj.weight"], out["self_attn.kv_a_proj_with_mqa.weight"] = \
            w.pop("self_attn.fused_qkv_a_proj.weight").split([cfg.q_lora_rank, cfg.mla_cache_dim])
    out["mlp.experts.gate_up_proj"] = torch.cat([w.pop("mlp.experts.w_gate"), w.pop("mlp.experts.w_up")], 1)
    out["mlp.experts.down_proj"] = w.pop("mlp.experts.w_down")
    for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        w.pop(n)                                   # the MTP wrapper: applied by the reference itself
    out.update(w)                                  # every other name is the same on both sides
    state = layer.state_dict()
    assert set(out) == set(state), set(out) ^ set(state)
    layer.load_state_dict(out, strict=True)
    return layer, DeepseekV3RotaryEmbedding(hc)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def reference_mtp_logits(model, cfg, prev_hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP module over one sequence: position t combines h_t and embed(x_{t+1})."""
    layer, rotary = hf_mtp_layer(model, cfg)
    mtp = model.model.layers[cfg.num_hidden_layers]
    T = len(next_ids)
    emb = F.embedding(next_ids, model.model.embed_tokens.weight)
    x = F.linear(torch.cat([rms(emb, mtp.enorm.weight), rms(prev_hidden, mtp.hnorm.weight)], -1), mtp.eh_proj.weight)
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        h = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rotary(x[None], pos))[0]
    return F.linear(rms(h, mtp.shared_head.norm.weight), model.lm_head.weight)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def mtp_model(request):
    cfg = k3trt_config(VARIANTS[request.param])
    model = build_model(cfg, dtype=torch.float32)
    init_random_(model, 11)
    return cfg, model.eval()


def test_mtp_logits_match_deepseek_v3_reference(mtp_model):
    cfg, model = mtp_model
    g = torch.Generator().manual_seed(4)
    T = 16
    prev = torch.randn(T, cfg.hidden_size, generator=g)          # the target's hidden states h_0..h_15
    nxt = torch.randint(0, cfg.vocab_size, (T,), generator=g)    # x_1..x_16
    ref = reference_mtp_logits(model, cfg, prev, nxt)
    L = cfg.num_hidden_layers
    cache = ModelCache.allocate(cfg, num_blocks=num_blocks(1), block_size=BLOCK, num_slots=1, max_q=4,
                                layers=range(L, L + 1))
    got, done = [], 0
    with torch.no_grad():
        for q in (9, 1, 1, 1, 4):                                # a prompt, decode steps, a 4-row step
            _, logits = model.mtp(0, prev[done:done + q], nxt[done:done + q], step_ctx([q], [done]), cache)
            got.append(logits)
            done += q
    got = torch.cat(got)
    for name, sl in (("prompt", slice(0, 9)), ("decode", slice(9, 12)), ("4-row", slice(12, 16))):
        err = rel_norm_error(got[sl], ref[sl])
        assert err <= REL, (name, err)


def test_reference_sees_every_mtp_weight(mtp_model):
    """The comparison is not vacuous: perturbing hnorm (the hidden state's norm) or the shared
    head's norm moves the reference."""
    cfg, model = mtp_model
    prev, nxt = torch.randn(5, cfg.hidden_size), torch.arange(1, 6)
    base = reference_mtp_logits(model, cfg, prev, nxt)
    mtp = model.model.layers[cfg.num_hidden_layers]
    for norm in (mtp.hnorm, mtp.shared_head.norm):
        with torch.no_grad():
            norm.weight.mul_(1.5)
            moved = reference_mtp_logits(model, cfg, prev, nxt)
            norm.weight.div_(1.5)
        assert rel_norm_error(moved, base) > 1e-3


def test_runtime_feeds_mtp_the_final_normed_hidden_state(engine):
    """K3's production code (the vLLM fork: the target's forward ends with the final norm; the MTP
    layer's hnorm reads that) and DeepSeek-V3's modeling code feed the MTP layer the target's hidden
    state AFTER the final norm. Every row of every first MTP step, through the runtime (prefill
    chunks and verify steps), must equal model.norm of the target's forward output at its position,
    and differ from the un-normed output."""
    llm = LLM(engine, verify_checksums=False, speculative="mtp", spec_tokens=2)
    drafter, model = llm.spec.drafter, llm.session.model
    cfg = model.cfg
    layer = model.model.layers[cfg.num_hidden_layers]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    first = {"step": False}
    propose, forward = drafter.propose, layer.forward

    def spy_propose(*a, **kw):
        first["step"] = True
        return propose(*a, **kw)

    def spy_forward(emb, prev_hidden, ctx, cache):
        if first["step"]:              # step 0 of a proposal: true target rows only
            seen.append((ctx.positions(prev_hidden.device).clone(), prev_hidden.clone()))
            first["step"] = False
        return forward(emb, prev_hidden, ctx, cache)

    drafter.propose, layer.forward = spy_propose, spy_forward
    try:
        (prompt,) = prompts(8, [13])
        out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    finally:
        del layer.forward
    assert len(seen) > 1 and out.stats["drafted_tokens"] > 0
    hist = prompt + out.token_ids
    cache = ModelCache.allocate(cfg, num_blocks=num_blocks(1), block_size=BLOCK, num_slots=1,
                                layers=range(cfg.num_hidden_layers))
    with torch.no_grad():
        pre = model(torch.tensor(hist), step_ctx([len(hist)], [0]), cache)
        post = model.model.norm(pre)
    for positions, h in seen:
        # the final norm moves the tiny model's hiddens by ~9%; step shapes, by fp32 rounding only
        assert rel_norm_error(h, post[positions]) <= 1e-5, positions
        assert rel_norm_error(h, pre[positions]) > 1e-2
