"""Each block of the model against a plain implementation written from spec/K3_MODEL.md."""


import pytest
import torch
import torch.nn.functional as F
from model_utils import BLOCK, num_blocks, step_ctx

from k3trt.config import ModelConfig
from k3trt.model.attn_res import attn_res
from k3trt.model.mla import MLA
from k3trt.model.moe import Experts, MoE, grouped_mm_ok, route
from k3trt.model.presets import preset_config
from k3trt.model.weights import init_random_
from k3trt.plugins.norm_act import situ_mul_reference as situ_mul
from k3trt.testing import assert_close


def tiny_cfg(**text):
    raw = preset_config("tiny", 256)
    raw["text_config"].update(text)
    return ModelConfig.from_dict(raw)


def mla_layer(cfg, seed, use_rope=None):
    m = MLA(cfg, use_rope=use_rope)
    init_random_(m, seed)
    return m.eval()


def dense_mla(m: MLA, x: torch.Tensor) -> torch.Tensor:
    """The naive MLA of the spec on one whole sequence, with no cache: per-head K/V from kv_b_proj."""
    T = x.shape[0]
    q_nope, q_pe, kv_c, k_pe = m.project(x, torch.arange(T))
    kv = m.kv_b_proj(kv_c).view(T, m.num_heads, m.nope + m.v_dim)
    k = torch.cat([kv[..., : m.nope], k_pe[:, None].expand(T, m.num_heads, m.rope)], -1)
    q = torch.cat([q_nope, q_pe], -1)
    scores = torch.einsum("thd,shd->hts", q, k) * m.softmax_scale
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    out = torch.einsum("hts,shv->thv", scores.softmax(-1), kv[..., m.nope:])
    if hasattr(m, "g_proj"):
        out = out * torch.sigmoid(m.g_proj(x).view_as(out))
    return m.o_proj(out.flatten(1))


@pytest.mark.parametrize("use_rope, kv_dtype", [(False, None), (True, None), (False, torch.float8_e4m3fn)])
def test_mla_naive_and_absorbed_agree_and_match_dense(use_rope, kv_dtype):
    cfg = tiny_cfg()
    torch.manual_seed(0)
    m = mla_layer(cfg, 1, use_rope)
    ctx_lens, Q = [5, 17, 33], 4                         # 33: crosses two block boundaries
    xs = [torch.randn(c + Q, cfg.hidden_size) for c in ctx_lens]
    cache = torch.full((num_blocks(3), BLOCK, cfg.mla_cache_dim), float("nan")).to(kv_dtype or torch.float32)
    scale = 0.05 if kv_dtype else 1.0
    with torch.no_grad():
        m(torch.cat([x[:c] for x, c in zip(xs, ctx_lens)]), step_ctx(ctx_lens, [0, 0, 0]), cache, scale)
        step = step_ctx([Q] * 3, ctx_lens)
        xq = torch.cat([x[c:] for x, c in zip(xs, ctx_lens)])
        absorbed = m(xq, step, cache.clone(), scale, absorbed=True)
        naive = m(xq, step, cache.clone(), scale, absorbed=False)
        assert_close(absorbed, naive, dtype=torch.float32, atol=1e-4, rtol=1e-3, name="absorbed vs naive")
        if kv_dtype is None:
            dense = torch.cat([dense_mla(m, x)[c:] for x, c in zip(xs, ctx_lens)])
            assert_close(naive, dense, dtype=torch.float32, atol=1e-4, rtol=1e-3, name="cached vs dense")


def test_mla_cache_write_skips_padding_and_quantizes():
    cache = torch.zeros(2, 16, 6, dtype=torch.float8_e4m3fn)
    kv_c, k_pe = torch.randn(3, 4), torch.randn(3, 2)
    torch.ops.k3trt.mla_cache_write(kv_c, k_pe, cache, torch.tensor([0, -1, 17]), 0.5)
    rows = cache.view(-1, 6).float() * 0.5
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 relative
    assert_close(rows[0], torch.cat([kv_c[0], k_pe[0]]), atol=1e-3, rtol=2**-4, rel_norm=2**-4, dtype=torch.float32)
    assert_close(rows[17], torch.cat([kv_c[2], k_pe[2]]), atol=1e-3, rtol=2**-4, rel_norm=2**-4, dtype=torch.float32)
    assert rows.abs().sum() == rows[0].abs().sum() + rows[17].abs().sum()
    with pytest.raises(IndexError, match="past the cache"):
        torch.ops.k3trt.mla_cache_write(kv_c, k_pe, cache, torch.tensor([0, 1, 32]), 1.0)


def route_loop(cfg, logits, bias):
    """Router, one token at a time, written from the spec."""
    ids, weights = [], []
    E, G = cfg.num_experts, cfg.num_expert_group
    for row in logits:
        scores = torch.sigmoid(row)
        choice = scores + bias
        per = E // G
        gscore = [sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(G)]
        groups = sorted(range(G), key=lambda g: -sum(gscore[g]))[: cfg.topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        top = sorted(allowed, key=lambda e: -choice[e].item())[: cfg.num_experts_per_token]
        w = torch.stack([scores[e] for e in top])
        ids.append(top)
        weights.append(w / w.sum() * cfg.routed_scaling_factor)
    return torch.tensor(ids), torch.stack(weights)


@pytest.mark.parametrize("groups, topk_group, k", [(1, 1, 2), (2, 1, 2), (4, 2, 3)])
def test_router_matches_loop_and_bias_only_chooses(groups, topk_group, k):
    cfg = tiny_cfg(num_experts=16, num_expert_group=groups, topk_group=topk_group, num_experts_per_token=k)
    g = torch.Generator().manual_seed(groups)
    logits, bias = torch.randn(7, 16, generator=g), 0.3 * torch.randn(16, generator=g)
    ids, w = route(cfg, logits, bias)
    ref_ids, ref_w = route_loop(cfg, logits, bias)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    order = ids.argsort(-1)
    assert_close(w.gather(1, order), ref_w.gather(1, ref_ids.argsort(-1)), dtype=torch.float32)
    # a huge bias forces expert 3 in, but its weight still comes from its raw score
    forced = bias.clone()
    forced[3] = 100.0
    ids, w = route(cfg, logits, forced)
    assert (ids == 3).any(-1).all()
    raw = torch.sigmoid(logits)
    chosen = raw.gather(1, ids)
    assert_close(w, chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling_factor, dtype=torch.float32)


def test_moe_matches_per_token_loop():
    cfg = tiny_cfg()
    moe = MoE(cfg)
    init_random_(moe, 3)
    x = torch.randn(9, cfg.hidden_size)
    with torch.no_grad():
        out = moe(x)
        ids, w = moe.gate(x)
        ref = []
        for t in range(9):
            lat = moe.routed_expert_down_proj(x[t])
            acc = torch.zeros_like(lat)
            for e, we in zip(ids[t].tolist(), w[t]):
                ex = moe.experts
                acc += we * (situ_mul(lat @ ex.w_gate[e].t(), lat @ ex.w_up[e].t(), 4.0, 25.0) @ ex.w_down[e].t())
            y = moe.routed_expert_up_proj(moe.routed_expert_norm(acc))
            ref.append(y + moe.shared_experts(x[t]))
    assert_close(out, torch.stack(ref), dtype=torch.float32)


def test_situ_formula():
    gate, up = torch.randn(100) * 10, torch.randn(100) * 40
    beta, lb = 4.0, 25.0
    ref = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (lb * torch.tanh(up / lb))
    assert_close(situ_mul(gate, up, beta, lb), ref, dtype=torch.float32)
    assert_close(situ_mul(gate, up, beta, None), beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up,
                 dtype=torch.float32)


def test_attn_res_matches_plain_softmax_mix():
    T, H, nb = 3, 8, 4
    g = torch.Generator().manual_seed(0)
    blocks, prefix, delta = torch.randn(T, nb, H, generator=g), torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    w_norm, w_q, out_norm = 1 + torch.randn(H, generator=g) * 0.1, torch.randn(1, H, generator=g), torch.rand(H, generator=g)
    b2 = blocks.clone()
    got, new_prefix = attn_res(prefix, delta, b2, w_norm, w_q, out_norm, num_blocks=2, write_idx=2, eps=1e-6)
    p = prefix + delta
    for t in range(T):
        srcs = [blocks[t, 0], blocks[t, 1], p[t]]
        logits = torch.stack([(F.rms_norm(s, (H,), w_norm, 1e-6) * w_q[0]).sum() for s in srcs])
        mixed = sum(a * s for a, s in zip(logits.softmax(0), srcs))
        assert_close(got[t], F.rms_norm(mixed, (H,), out_norm, 1e-6), dtype=torch.float32)
    assert torch.equal(b2[:, 2], p) and torch.equal(new_prefix, p)
    assert torch.equal(b2[:, [0, 1, 3]], blocks[:, [0, 1, 3]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_loop_including_foreign_ids(dtype):
    """The grouped-GEMM path (no host sync) against the per-expert loop, with ids == E (another EP
    rank's expert) that must contribute nothing and experts that get no token."""
    cfg = tiny_cfg(num_experts=8)
    ex = Experts(cfg, 64)
    init_random_(ex, 5)
    ex = ex.to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 64, generator=g).to(dtype)
    ids = torch.randint(0, 6, (11, 3), generator=g)          # experts 6, 7 get nothing
    ids[2, 1] = ids[5, 0] = 8                                  # foreign
    w = torch.rand(11, 3, generator=g)
    assert grouped_mm_ok(x, ex.w_gate, ex.w_down)
    with torch.no_grad():
        got = ex._grouped(x, ids, w)
        ref = ex._loop(x, ids, w)
    assert not got.isnan().any()
    assert_close(got, ref, dtype=dtype)
