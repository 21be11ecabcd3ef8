"""Fused projections (k3trt/model/fuse.py): same outputs, same parameters, shared memory."""

from __future__ import annotations

import copy

import torch

from k3trt.model.fuse import fuse_projections_
from k3trt.runtime.engine import Seq, TorchSession, make_batch
from k3trt.runtime.kv_cache import plan_cache
from k3trt.testing import assert_close


def run_steps(model, cfg, fuse: bool) -> list[torch.Tensor]:
    """Logits of a 2-sequence prefill, a decode step and a 3-row verification step."""
    plan = plan_cache(cfg, budget_bytes=16 << 20, block_size=16, max_live=2, max_model_len=64,
                      kv_dtype=torch.float32, state_dtype=torch.float32, max_q=3)
    s = TorchSession(model, cfg, plan, device="cpu", dtype=torch.float32, kv_dtype=torch.float32, max_q=3, fuse=fuse)
    g = torch.Generator().manual_seed(3)
    toks = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 20)]
    blocks = [[0, 1], [2, 3]]
    out = [s.prefill(make_batch([Seq(t, 0, b, i, 1) for i, (t, b) in enumerate(zip(toks, blocks))], 16, capacity=32))]
    out.append(s.verify(make_batch([Seq([5], 7, blocks[0], 0, 1), Seq([9], 20, blocks[1], 1, 1)], 16, capacity=2)))
    out.append(s.verify(make_batch([Seq([4, 8, 2], 8, blocks[0], 0, 3), Seq([1, 2, 3], 21, blocks[1], 1, 3)], 16,
                                   capacity=6, save_kda_states=True)))
    return out


def test_fused_model_matches_unfused_and_keeps_its_parameters(tiny_model):
    cfg, base = tiny_model
    model = copy.deepcopy(base)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projections_(model) > 0
    assert fuse_projections_(model) == 0                     # idempotent
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k

    kda = next(m for m in model.modules() if hasattr(m, "in_proj") and m.in_proj is not None)
    # the original parameters are views of the fused weight: an in-place load writes through
    assert kda.q_proj.weight.data_ptr() == kda.in_proj.data_ptr()
    with torch.no_grad():
        kda.b_proj.weight.fill_(0.25)
    assert torch.all(kda.in_proj[-kda.b_proj.weight.shape[0]:] == 0.25)
    with torch.no_grad():
        kda.b_proj.weight.copy_(base.get_submodule(_name_of(model, kda)).b_proj.weight)

    for want, got in zip(run_steps(copy.deepcopy(base), cfg, fuse=False), run_steps(model, cfg, fuse=True)):
        # one GEMM instead of several sums in another order: fp32 rounding, through the layers
        assert_close(got, want, dtype=torch.float32, atol=1e-4, rtol=1e-3, name="logits")


def _name_of(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)
