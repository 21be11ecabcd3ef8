"""k3trt::moe_route and k3trt::moe_combine: the MoE's routing and weighted sum as one kernel each.

CPU (CI): the op bodies against model/moe.py's router (groups off) and an explicit loop; the
Triton kernels under Triton's interpreter (TRITON_INTERPRET=1 subprocess); the whole MoE layer
through the kernels' CPU bodies. GPU (``-m gpu``): K3 sizes (896 and 32 experts, top-16), bf16,
and capture / replay. Rows of y for other ranks' experts are NaN: they must never leak.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import needs_triton, run_interpreted

from k3trt.config import ModelConfig
from k3trt.model.moe import route
from k3trt.model.presets import preset_config
from k3trt.plugins.moe_route import moe_combine_reference, moe_route_reference
from k3trt.testing import assert_close

ROUTE_CASES = [  # (T, E, k, sigmoid, renormalize, bias)
    (1, 32, 16, True, True, True), (5, 40, 3, False, False, False), (3, 8, 8, True, True, False),
    (4, 896, 16, True, True, True)]


def route_inputs(T, E, bias, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    b = 0.1 * torch.randn(E, generator=g) if bias else None
    return logits.to(device), None if b is None else b.to(device)


def combine_inputs(T, k, W, E, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E + 2, (T, k), generator=g)        # ids >= E: other ranks' experts
    w = torch.rand(T, k, generator=g)
    y = torch.randn(T * k, W, generator=g).to(dtype)
    y[(ids >= E).flatten()] = float("nan")
    return y.to(device), ids.to(device), w.to(device)


def combine_oracle(y, ids, w, E):
    T, k = ids.shape
    out = torch.zeros(T, y.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            if ids[t, j] < E:
                out[t] += w[t, j].double() * y[t * k + j].double().cpu()
    return out


@pytest.mark.parametrize("T,E,k,sigmoid,renorm,bias", ROUTE_CASES)
def test_route_matches_the_model_router(T, E, k, sigmoid, renorm, bias):
    d = preset_config("tiny", 64)
    d["text_config"].update(num_experts=E, num_experts_per_token=k, num_expert_group=1, topk_group=1,
                            moe_router_activation_func="sigmoid" if sigmoid else "softmax",
                            moe_renormalize=renorm, routed_scaling_factor=2.5)
    cfg = ModelConfig.from_dict(d)
    logits, b = route_inputs(T, E, bias, T * E)
    ids, w = torch.ops.k3trt.moe_route(logits, b, k, sigmoid, renorm, 2.5)
    want_ids, want_w = route(cfg, logits, b)
    assert torch.equal(ids, want_ids)
    assert_close(w, want_w, dtype=torch.float32)


def test_combine_matches_a_loop_and_skips_other_ranks():
    y, ids, w = combine_inputs(5, 4, 33, 6, torch.float32, 0)
    out = torch.ops.k3trt.moe_combine(y, ids, w, 6)
    assert not out.isnan().any()
    assert_close(out, combine_oracle(y, ids, w, 6).float(), dtype=torch.float32)


def test_errors_and_opcheck():
    logits, b = route_inputs(3, 8, True, 0)
    with pytest.raises(ValueError, match="logits must be fp32"):
        torch.ops.k3trt.moe_route(logits.double(), b, 2, True, True, 1.0)
    with pytest.raises(ValueError, match="k=9"):
        torch.ops.k3trt.moe_route(logits, b, 9, True, True, 1.0)
    y, ids, w = combine_inputs(3, 2, 8, 4, torch.float32, 1)
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.k3trt.moe_combine(y[1:], ids, w, 4)
    torch.library.opcheck(torch.ops.k3trt.moe_route.default, (logits, b, 3, True, True, 2.5))
    torch.library.opcheck(torch.ops.k3trt.moe_combine.default, (y.nan_to_num(), ids, w, 4))


def interpreter_main() -> None:
    from k3trt.plugins.moe_route_triton import moe_combine_fwd, moe_route_fwd  # noqa: PLC0415 (optional: triton)
    for i, (T, E, k, sigmoid, renorm, bias) in enumerate(ROUTE_CASES):
        logits, b = route_inputs(T, E, bias, i)
        ids, w = moe_route_fwd(logits, b, k, sigmoid, renorm, 2.5)
        want_ids, want_w = moe_route_reference(logits, b, k, sigmoid, renorm, 2.5)
        assert torch.equal(ids, want_ids), (i, ids, want_ids)
        assert_close(w, want_w, dtype=torch.float32, name=f"route case {i}")
    for i, (T, k, W, E) in enumerate([(1, 16, 64, 32), (4, 3, 200, 5), (2, 4, 1500, 3)]):
        for dtype in (torch.float32, torch.float16):
            y, ids, w = combine_inputs(T, k, W, E, dtype, i)
            out = moe_combine_fwd(y, ids, w, E)
            assert not out.isnan().any()
            assert_close(out.float(), moe_combine_reference(y, ids, w, E).float(), dtype=dtype,
                         name=f"combine case {i} {dtype}")
    print("ok")


@needs_triton
def test_kernels_under_interpreter():
    assert "ok" in run_interpreted("test_moe_route")


@pytest.mark.gpu
@pytest.mark.parametrize("T,E", [(1, 32), (128, 32), (512, 896)])
def test_kernels_on_gpu(T, E):
    logits, b = route_inputs(T, E, True, T, "cuda")
    ids, w = torch.ops.k3trt.moe_route(logits, b, 16, True, True, 2.5)
    want_ids, want_w = moe_route_reference(logits, b, 16, True, True, 2.5)
    assert torch.equal(ids, want_ids)
    assert_close(w, want_w, dtype=torch.float32)
    y, cids, cw = combine_inputs(T, 16, 3584, 28, torch.bfloat16, T, "cuda")
    graph = torch.cuda.CUDAGraph()
    torch.ops.k3trt.moe_combine(y, cids, cw, 28)
    with torch.cuda.graph(graph):
        out = torch.ops.k3trt.moe_combine(y, cids, cw, 28)
    y.copy_(torch.where(y.isnan(), y, torch.randn_like(y)))
    graph.replay()
    assert not out.isnan().any()
    assert_close(out, moe_combine_reference(y, cids, cw, 28), dtype=torch.bfloat16)
