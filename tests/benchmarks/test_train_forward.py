"""benchmarks/k3_train.py's differentiable forward computes what the runtime's forward computes
(prefill of fresh sequences through the caches) on the tiny preset: the hidden states, the MTP
layer's logits, and the layer-skip draft's hidden; and gradients reach every trained parameter."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from k3trt.model.context import ModelCache
from k3trt.runtime.speculative.draft_model import SeqStep, step_context
from k3trt.runtime.speculative.layer_skip import LayerSkipModel
from k3trt.testing import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import k3_train  # noqa: E402  (benchmarks/ is not a package)

B, T, BS = 2, 40, 16


def runtime_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The runtime's prefill of each row of ids from position 0: hidden [B·T, H]."""
    cfg = model.cfg
    cache = ModelCache.allocate(cfg, num_blocks=B * 4, block_size=BS, num_slots=B, layers=range(cfg.num_hidden_layers))
    steps = [SeqStep(ids[b].tolist(), 0, list(range(b * 4, b * 4 + 4)), b) for b in range(B)]
    x, ctx = step_context(steps, BS, torch.device("cpu"))
    with torch.no_grad():
        return model(x, ctx, cache)


def test_forward_matches_runtime(tiny_model):
    cfg, model = tiny_model
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, early = k3_train.forward(model, ids, exit_after=2)
        mtp_logits = k3_train.mtp(model, hidden, ids)
    want = runtime_hidden(model, ids)
    assert_close(hidden, want, atol=2e-4, rtol=2e-4)
    assert_close(early, runtime_hidden(LayerSkipModel(model, 2), ids), atol=2e-4, rtol=2e-4)
    # the MTP layer as the runtime runs it (K3ForCausalLM.mtp over its own cache, rope positions 0..T-2)
    cache = ModelCache.allocate(cfg, num_blocks=B * 4, block_size=BS, num_slots=1,
                                layers=range(cfg.num_hidden_layers, cfg.num_hidden_layers + 1))
    steps = [SeqStep(ids[b, 1:].tolist(), 0, list(range(b * 4, b * 4 + 4)), 0) for b in range(B)]
    nxt, ctx = step_context(steps, BS, torch.device("cpu"))
    with torch.no_grad():
        prev = model.model.norm(want.view(B, T, -1)[:, :-1].reshape(B * (T - 1), -1))
        _, ref = model.mtp(0, prev, nxt, ctx, cache)
    assert_close(mtp_logits, ref, atol=5e-4, rtol=5e-4)


def test_gradients_reach_trained_parameters(tiny_model):
    cfg, model = tiny_model
    m = type(model)(cfg)
    m.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (B, 24), generator=torch.Generator().manual_seed(1))
    hidden, early = k3_train.forward(m, ids, exit_after=2)
    loss = k3_train.logits(m, hidden).logsumexp(-1).mean() + k3_train.mtp(m, hidden, ids).logsumexp(-1).mean() \
        + k3_train.logits(m, early).logsumexp(-1).mean()
    loss.backward()
    # the router's correction bias only chooses experts (no gradient, as in K3's training); the
    # vision tower is not on a text-only path
    missing = [n for n, p in m.named_parameters()
               if p.grad is None and not n.endswith("e_score_correction_bias") and not n.startswith("vision.")]
    assert not missing, missing
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
