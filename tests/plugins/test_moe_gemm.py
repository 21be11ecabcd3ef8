"""k3trt::moe_gemm: the routed experts' grouped GEMM for few rows per expert.

CPU (CI): the op's torch body against per-expert fp64 matmuls; the Triton kernel under Triton's
interpreter (a subprocess with TRITON_INTERPRET=1) in fp32 and fp16 (the interpreter's bf16 dot
is not faithful); the model's Experts with the kernel's layout (fused gate|up) against the loop.
GPU (``-m gpu``): bf16 at K3's expert sizes against torch._grouped_mm, rows past the last group
untouched checks, and capture / replay in a CUDA graph.
Output buffers are NaN where no expert writes: the comparisons cover only rows < offs[-1].
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton_interp import needs_triton, run_interpreted

from k3trt.config import ModelConfig
from k3trt.model.moe import Experts
from k3trt.model.presets import preset_config
from k3trt.plugins import moe_gemm as ops
from k3trt.testing import assert_close


def make(P: int, E: int, N: int, K: int, dtype, seed: int, foreign: int = 0, device="cpu"):
    """x [P, K], w [E, N, K], offs: P - foreign rows spread over random experts (some empty),
    then `foreign` rows that belong to no expert here."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(P, K, generator=g).to(dtype)
    w = (torch.randn(E, N, K, generator=g) / K ** 0.5).to(dtype)
    own = P - foreign
    counts = torch.multinomial(torch.ones(E), own, replacement=True, generator=g).bincount(minlength=E) if own \
        else torch.zeros(E, dtype=torch.long)
    offs = counts.cumsum(0).to(torch.int32)
    return x.to(device), w.to(device), offs.to(device)


def oracle(x, w, offs, src=None, dst=None, out_rows=None) -> torch.Tensor:
    P = src.shape[0] if src is not None else x.shape[0]
    src = src.cpu() if src is not None else torch.arange(P)
    dst = dst.cpu() if dst is not None else torch.arange(P)
    y, start = torch.zeros(out_rows or P, w.shape[1], dtype=torch.float64), 0
    for e, end in enumerate(offs.tolist()):
        y[dst[start:end]] = x.double().cpu()[src[start:end]] @ w[e].double().cpu().t()
        start = end
    return y


def permuted(P: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) as the MoE uses them: pair p reads token src[p] of T, writes row dst[p] (a
    permutation of the P pairs)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, T, (P,), generator=g), torch.randperm(P, generator=g)


@pytest.mark.parametrize("P,E,foreign", [(1, 4, 0), (9, 4, 0), (40, 6, 5), (0, 3, 0)])
def test_op_body_matches_oracle(P, E, foreign):
    x, w, offs = make(P, E, 24, 40, torch.float32, P, foreign)
    y = torch.ops.k3trt.moe_gemm(x, w, offs)
    n = int(offs[-1])
    assert_close(y[:n], oracle(x, w, offs)[:n].float(), dtype=torch.float32)


def test_op_body_gathers_and_scatters():
    x, w, offs = make(30, 4, 24, 40, torch.float32, 7, foreign=4)
    src, dst = permuted(30, 30, 7)
    xt = x[:9]                                     # 9 tokens, 30 (token, choice) pairs
    src = src % 9
    y = torch.full((30, 24), float("nan"))
    y = torch.ops.k3trt.moe_gemm(xt, w, offs, src, dst, 30)
    n = int(offs[-1])
    want = oracle(xt, w, offs, src, dst, 30)
    assert_close(y[dst[:n]], want[dst[:n]].float(), dtype=torch.float32)


def test_op_checks_its_arguments():
    x, w, offs = make(4, 3, 8, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="offs must be int32"):
        torch.ops.k3trt.moe_gemm(x, w, offs.long())
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.k3trt.moe_gemm(x[:, :8], w, offs)
    with pytest.raises(ValueError, match="bfloat16"):
        torch.ops.k3trt.moe_gemm(x, w.bfloat16(), offs)
    with pytest.raises(ValueError, match="src_rows must be int64"):
        torch.ops.k3trt.moe_gemm(x, w, offs, offs)


def test_opcheck():
    x, w, offs = make(6, 3, 8, 16, torch.float32, 1)
    torch.library.opcheck(torch.ops.k3trt.moe_gemm.default, (x, w, offs))


@pytest.mark.parametrize("kernel_path", [False, True])
def test_experts_fused_gate_up_matches_loop(kernel_path, monkeypatch):
    """Experts after fuse_() (gate|up in one [E, 2I, W] weight) equals the per-expert loop, on
    torch's grouped GEMM and on the kernel path (moe_gemm with gather / scatter, then moe_combine;
    their CPU bodies here), with another EP rank's ids (== E) among the choices."""
    monkeypatch.setattr(ops, "use_kernel", lambda pairs, experts, x: kernel_path)
    cfg = ModelConfig.from_dict(preset_config("tiny", 256))
    ex = Experts(cfg, 64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    x = torch.randn(5, 64, generator=g)
    ids = torch.randint(0, cfg.num_experts + 1, (5, cfg.num_experts_per_token), generator=g)
    w = torch.rand(5, cfg.num_experts_per_token, generator=g)
    want = ex._loop(x, ids, w)
    assert ex.fuse_()
    assert_close(ex._grouped(x, ids, w), want, dtype=torch.float32)


# ----------------------------------------------------------------------------- interpreter
INTERPRETER_CASES = [(P, E, N, K, dt, foreign) for (P, E, N, K, foreign), dt in itertools.product(
    [(1, 4, 48, 64, 0), (20, 4, 40, 96, 3), (37, 5, 64, 200, 0), (0, 3, 16, 32, 0)], ["float32", "float16"])]


def interpreter_main() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: the launcher on CPU tensors vs the oracle."""
    from k3trt.plugins.moe_gemm_triton import moe_gemm_fwd  # noqa: PLC0415 (optional: triton)
    for i, (P, E, N, K, dt, foreign) in enumerate(INTERPRETER_CASES):
        dtype = getattr(torch, dt)
        x, w, offs = make(P, E, N, K, dtype, i, foreign)
        n = int(offs[-1])
        for config in (None, (16, 32, 32, 4, 2)):
            y = moe_gemm_fwd(x, w, offs, config=config)
            assert_close(y[:n].float(), oracle(x, w, offs)[:n].float(), dtype=dtype, name=f"case {i} {config}")
        # gather from 1 + P // 3 tokens, scatter to a permutation, into NaN-free fresh rows
        src, dst = permuted(P, 1 + P // 3, i)
        xt = x[: 1 + P // 3]
        y = moe_gemm_fwd(xt, w, offs, src, dst, P, config=(16, 32, 32, 4, 2))
        want = oracle(xt, w, offs, src, dst, P)
        assert_close(y[dst[:n]].float(), want[dst[:n]].float(), dtype=dtype, name=f"case {i} gather/scatter")
    print("ok", len(INTERPRETER_CASES))


@needs_triton
def test_kernel_under_interpreter():
    assert "ok" in run_interpreted("test_moe_gemm")


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("P,N,K", [(16, 6144, 3584), (16, 3584, 3072), (256, 6144, 3584), (512, 3584, 3072)])
def test_kernel_matches_grouped_mm_on_gpu(P, N, K):
    from k3trt.plugins.moe_gemm_triton import moe_gemm_fwd  # noqa: PLC0415 (optional: triton)
    x, w, offs = make(P, 32, N, K, torch.bfloat16, P, foreign=P // 8, device="cuda")
    want = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    n = int(offs[-1])
    y = moe_gemm_fwd(x, w, offs)
    assert not torch.isnan(y[:n]).any()
    assert_close(y[:n], want[:n], dtype=torch.bfloat16, name="moe_gemm vs grouped_mm")
    # through the op, captured and replayed with new inputs
    graph, xs = torch.cuda.CUDAGraph(), x.clone()
    torch.ops.k3trt.moe_gemm(xs, w, offs)
    with torch.cuda.graph(graph):
        out = torch.ops.k3trt.moe_gemm(xs, w, offs)
    xs.copy_(torch.randn_like(xs))
    graph.replay()
    # the MoE's form: gather 1 + P // 16 tokens, scatter back to (token, choice) order
    src, dst = (t.cuda() for t in permuted(P, 1 + P // 16, P))
    got = torch.ops.k3trt.moe_gemm(x[: 1 + P // 16], w, offs, src, dst, P)
    ref = torch._grouped_mm(x[src], w.transpose(1, 2), offs=offs)
    assert_close(got[dst[:n]], ref[:n], dtype=torch.bfloat16, name="gather/scatter")
    assert_close(out[:n], torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)[:n], dtype=torch.bfloat16,
                 name="replay")
