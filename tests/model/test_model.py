"""The whole model: prefill-then-decode over the caches equals a full recompute; determinism."""

import torch
from model_utils import BLOCK, num_blocks, step_ctx

from k3trt.model.context import ModelCache
from k3trt.model.loader import load_model
from k3trt.testing import assert_close


def fresh_cache(cfg, num_seqs, max_q=0):
    return ModelCache.allocate(cfg, num_blocks=num_blocks(num_seqs), block_size=BLOCK, num_slots=num_seqs, max_q=max_q)


def full_logits(cfg, model, ids):
    """Logits of every position of one sequence, computed in one prefill from empty caches."""
    with torch.no_grad():
        h = model(ids, step_ctx([len(ids)], [0]), fresh_cache(cfg, 1))
        return model.logits(h)


def test_prefill_then_decode_equals_full_recompute(tiny_model):
    cfg, model = tiny_model
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (23, 40, 10)]
    cache = fresh_cache(cfg, 3)
    got = [[] for _ in seqs]
    # schedule: two chunked-prefill steps of uneven sizes, decode steps (Q=1), one 4-row step, decodes
    plan = [[10, 17, 5], [6, 12, 1], [1, 1, 1], [4, 4, 1], [1, 1, 1], [1, 5, 1]]
    done = [0, 0, 0]
    with torch.no_grad():
        for q_lens in plan:
            ctx = step_ctx(q_lens, list(done))
            ids = torch.cat([s[d:d + q] for s, d, q in zip(seqs, done, q_lens)])
            logits = model.logits(model(ids, ctx, cache))
            for i, piece in enumerate(logits.split(q_lens)):
                got[i].append(piece)
            done = [d + q for d, q in zip(done, q_lens)]
    for i, s in enumerate(seqs):
        ref = full_logits(cfg, model, s[: done[i]])
        assert_close(torch.cat(got[i]), ref, dtype=torch.float32, atol=2e-4, rtol=2e-3, name=f"sequence {i}")


def test_logits_are_deterministic_and_finite(tiny_model, tiny_ckpt):
    cfg, model = tiny_model
    ids = torch.arange(1, 20)
    a = full_logits(cfg, model, ids)
    _, again = load_model(tiny_ckpt)
    b = full_logits(cfg, again, ids)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
    assert a[-1].std() > 0.1          # random weights still give a non-degenerate distribution


def test_mtp_layer_predicts_from_hidden_and_next_token(tiny_model):
    cfg, model = tiny_model
    assert cfg.num_nextn_predict_layers == 1
    mtp_layer = model.model.layers[cfg.num_hidden_layers]
    assert mtp_layer.self_attn.use_rope            # draft/MTP MLA layers rotate
    ids = torch.arange(3, 15)
    with torch.no_grad():
        h = model(ids, step_ctx([12], [0]), fresh_cache(cfg, 1))
        cache = fresh_cache(cfg, 1)
        # MTP sees hidden[t] with token t+1: one prefill over positions 0..10, then one decode step
        _, lg_all = model.mtp(0, h[:11], ids[1:12], step_ctx([11], [0]), fresh_cache(cfg, 1))
        _, lg_a = model.mtp(0, h[:10], ids[1:11], step_ctx([10], [0]), cache)
        _, lg_b = model.mtp(0, h[10:11], ids[11:12], step_ctx([1], [10]), cache)
    assert lg_all.shape == (11, cfg.vocab_size) and torch.isfinite(lg_all).all()
    assert_close(torch.cat([lg_a, lg_b]), lg_all, dtype=torch.float32, atol=2e-4, rtol=2e-3)
