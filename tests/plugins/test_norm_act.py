"""k3trt::rms_norm, k3trt::gated_act, k3trt::kda_out_gate (norm_act.py) and their Triton kernels
(norm_act_triton.py), against the plain-torch references the model uses.

CPU (CI): the ops' bodies equal the references bit for bit; opcheck; the errors name the problem;
the CUDA kernels are registered without importing triton; the fallback warns once. The kernels
themselves under Triton's interpreter (a subprocess with TRITON_INTERPRET=1): a product of widths
(powers of two and not, the looped two-pass path forced with a small block), row counts and
strided layouts, fp32 (tight) and bf16 (within a bf16 step: the interpreter's fp32 -> bf16 casts
need not round as the GPU does), into NaN-poisoned output buffers.
GPU (``-m gpu``, on the H200): K3 sizes through torch.ops.k3trt.* (no fallback), the reference
computed on the GPU the same way; capture / replay in a CUDA graph with new input values.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from triton_interp import run_interpreted

from k3trt.plugins import dispatch, norm_act_ref
from k3trt.plugins import norm_act as na
from k3trt.testing import TOLERANCES, assert_close

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS = 1e-6
SITU_BETA = 4.0


def tol(dtype: torch.dtype) -> dict:
    """Kernel vs reference: fp32 to the sums' reordering; bf16 / fp16 to one step of the output
    dtype at O(1) values (the two round fp32 values that differ in the last bits)."""
    if dtype == F32:
        return {"dtype": F32}
    return {"dtype": dtype, "atol": 1e-2, "rtol": 1.6e-2, "rel_norm": TOLERANCES[dtype]["rel_norm"]}


def name(d: torch.dtype) -> str:
    return str(d).split(".")[-1]


# ----------------------------------------------------------------------------- cases
# Row layouts: "contiguous"; "column_slice" (columns 8..8+N of a wider tensor: one row stride);
# "row_gaps" (every other index of each leading dim: with two leading dims, two row strides);
# gated_act's "halves" (gate and up the two halves of one [..., 2I] projection).
def make_rows(gen: torch.Generator, lead: tuple[int, ...], width: int, layout: str, dtype: torch.dtype,
              device, scale: float = 1.0, row_scales: bool = False) -> torch.Tensor:
    """A [*lead, width] tensor ~ N(0, scale²) in `layout`, the view made on `device` (moving a
    view would copy it dense). row_scales: each row times e^N(0, 4) (the norm must undo it)."""
    gaps = layout == "row_gaps"
    shape = (*(2 * d if gaps else d for d in lead), width + (24 if layout == "column_slice" else 0))
    base = torch.randn(*shape, generator=gen) * scale
    if row_scales:
        base = base * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=gen))
    base = base.to(dtype).to(device)
    if layout == "column_slice":
        return base[..., 8:8 + width]
    if gaps:
        return base[tuple(slice(None, None, 2) for _ in lead)]
    assert layout == "contiguous", layout
    return base


@dataclass(frozen=True)
class NormCase:
    lead: tuple[int, ...]            # x's leading dims
    N: int
    dtype: torch.dtype
    layout: str = "contiguous"
    block: int | None = None         # launcher's column block (None: its own; smaller than N: two passes)

    def __str__(self) -> str:
        lead = "x".join(map(str, self.lead)) or "1d"
        return f"{lead}-N{self.N}-{name(self.dtype)}-{self.layout}{f'-b{self.block}' if self.block else ''}"

    def inputs(self, seed: int, device="cpu") -> tuple:
        gen = torch.Generator().manual_seed(seed)
        x = make_rows(gen, self.lead, self.N, self.layout, self.dtype, device, row_scales=True)
        w = (1 + 0.5 * torch.randn(self.N, generator=gen)).to(self.dtype).to(device)
        return x, w, EPS


@dataclass(frozen=True)
class ActCase:
    lead: tuple[int, ...]
    I: int
    kind: str
    dtype: torch.dtype
    linear_beta: float = 25.0        # 0.0: no clamp on up
    layout: str = "halves"

    def __str__(self) -> str:
        lb = f"-lb{self.linear_beta:g}" if self.kind == "situ" else ""
        return f"{'x'.join(map(str, self.lead))}-I{self.I}-{self.kind}{lb}-{name(self.dtype)}-{self.layout}"

    def inputs(self, seed: int, device="cpu") -> tuple:
        """Values to ~±30 (·3 and a -40..40 ramp in the first row), so tanh saturates and the
        silu exp over/underflows; up values reach past linear_beta."""
        gen = torch.Generator().manual_seed(seed)
        if self.layout == "halves":
            both = torch.randn(*self.lead, 2 * self.I, generator=gen) * 3
            both.view(-1, 2 * self.I)[0] = torch.linspace(-40, 40, 2 * self.I)
            both = both.to(self.dtype).to(device)
            gate, up = both[..., :self.I], both[..., self.I:]
        else:
            gate = make_rows(gen, self.lead, self.I, self.layout, self.dtype, device, scale=3)
            up = make_rows(gen, self.lead, self.I, self.layout, self.dtype, device, scale=10)
        return gate, up, self.kind, SITU_BETA, self.linear_beta


@dataclass(frozen=True)
class GateCase:
    T: int
    H: int
    D: int
    dtype: torch.dtype               # gate's (and the output's); o is fp32
    o_layout: str = "contiguous"     # or "heads_first": o a [H, T, D] buffer transposed
    block: int | None = None

    def __str__(self) -> str:
        return (f"T{self.T}-H{self.H}-D{self.D}-{name(self.dtype)}-{self.o_layout}"
                f"{f'-b{self.block}' if self.block else ''}")

    def inputs(self, seed: int, device="cpu") -> tuple:
        """o ~ N(0, 1) with per-row scales; gate columns 16.. of a wider projection output."""
        gen = torch.Generator().manual_seed(seed)
        T, H, D = self.T, self.H, self.D
        o = torch.randn(H, T, D, generator=gen) * torch.exp(2 * torch.randn(H, T, 1, generator=gen))
        o = o.to(device)
        o = o.transpose(0, 1) if self.o_layout == "heads_first" else o.transpose(0, 1).contiguous()
        gate = (torch.randn(T, H * D + 16, generator=gen) * 4).to(self.dtype).to(device)[:, 16:]
        w = (1 + 0.5 * torch.randn(D, generator=gen)).to(device)
        return o, gate, w, EPS


REFERENCES = {NormCase: na.rms_norm_reference, ActCase: na.gated_act_reference, GateCase: na.kda_out_gate_reference}


def check(case, args: tuple, y: torch.Tensor) -> None:
    """y (contiguous, no NaN left from a poisoned buffer) against the reference on args."""
    want = REFERENCES[type(case)](*args)
    assert y.is_contiguous(), f"{case}: output strides {y.stride()}"
    assert y.dtype == want.dtype, f"{case}: dtype {y.dtype} != {want.dtype}"
    assert not torch.isnan(y).any(), f"{case}: NaN in the output (unwritten elements?)"
    assert_close(y, want, name=str(case), **tol(case.dtype))


# ----------------------------------------------------------------------------- CPU: the ops' bodies
CPU_CASES = [NormCase(lead, 96, dt, layout) for lead, dt, layout in itertools.product(
    ((5,), (3, 4)), (F32, BF16, F16), ("contiguous", "column_slice", "row_gaps"))]
CPU_CASES += [ActCase((5,), 96, kind, dt, lb, layout) for (kind, lb), dt, layout in itertools.product(
    (("silu", 0.0), ("situ", 25.0), ("situ", 0.0)), (F32, BF16, F16), ("halves", "row_gaps"))]
CPU_CASES += [GateCase(3, 2, 32, dt, layout)
              for dt, layout in itertools.product((F32, BF16), ("contiguous", "heads_first"))]
OPS = {NormCase: "rms_norm", ActCase: "gated_act", GateCase: "kda_out_gate"}


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_cpu_op_is_the_reference(case):
    args = case.inputs(seed=1)
    y = getattr(torch.ops.k3trt, OPS[type(case)])(*args)
    want = REFERENCES[type(case)](*args)
    assert y.is_contiguous()
    assert torch.equal(y, want), f"{case}: the op's CPU body differs from the reference"


def test_cpu_rms_norm_of_a_permuted_input_is_contiguous():
    x = torch.randn(6, 4, 32).transpose(0, 1)
    y = torch.ops.k3trt.rms_norm(x, torch.ones(32), EPS)
    assert y.is_contiguous() and torch.equal(y, na.rms_norm_reference(x, torch.ones(32), EPS))


def test_gated_act_reference_dispatches_on_kind():
    gate, up = torch.randn(2, 3, 16).unbind(0)
    assert torch.equal(na.gated_act_reference(gate, up, "silu", 0.0, 0.0), na.silu_mul_reference(gate, up))
    assert torch.equal(na.gated_act_reference(gate, up, "situ", 4.0, 25.0), na.situ_mul_reference(gate, up, 4.0, 25.0))


@pytest.mark.parametrize("op,args", [
    (na.rms_norm, (torch.randn(3, 40)[:, 4:36], torch.randn(32), EPS)),
    (na.rms_norm, (torch.randn(2, 3, 16, dtype=BF16), torch.randn(16), EPS)),
    (na.gated_act, (*torch.randn(4, 48).split(24, -1), "silu", 0.0, 0.0)),
    (na.gated_act, (*torch.randn(4, 48, dtype=BF16).split(24, -1), "situ", 4.0, 25.0)),
    (na.kda_out_gate, (torch.randn(3, 2, 16), torch.randn(3, 32, dtype=BF16), torch.randn(16), EPS)),
], ids=["rms_norm-strided", "rms_norm-bf16", "silu", "situ-bf16", "kda_out_gate"])
def test_opcheck(op, args):
    """Schema, fake implementation (shape, dtype, strides) and tracing agree with the real op."""
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("call,match", [
    (lambda: torch.ops.k3trt.rms_norm(torch.randn(3, 8), torch.randn(7), EPS), r"weight must be \[8\]"),
    (lambda: torch.ops.k3trt.gated_act(torch.randn(3, 8), torch.randn(3, 9), "silu", 0.0, 0.0), r"up \(3, 9\)"),
    (lambda: torch.ops.k3trt.gated_act(torch.randn(3, 8), torch.randn(3, 8), "gelu", 0.0, 0.0), "unknown kind 'gelu'"),
    (lambda: na.gated_act_reference(torch.randn(3, 8), torch.randn(3, 8), "relu2", 0.0, 0.0), "unknown kind 'relu2'"),
    (lambda: torch.ops.k3trt.gated_act(torch.randn(3, 8), torch.randn(3, 8), "situ", 0.0, 0.0), "nonzero beta"),
    (lambda: torch.ops.k3trt.kda_out_gate(torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), EPS), r"o must be"),
    (lambda: torch.ops.k3trt.kda_out_gate(torch.randn(3, 2, 16), torch.randn(3, 16), torch.randn(16), EPS),
     r"gate must be \[T, H\*D\] = \[3, 32\]"),
    (lambda: torch.ops.k3trt.kda_out_gate(torch.randn(3, 2, 16), torch.randn(3, 32), torch.randn(32), EPS),
     r"weight must be \[D\] = \[16\]"),
], ids=["rms-weight", "act-shapes", "act-kind", "reference-kind", "situ-beta", "kda-o", "kda-gate", "kda-weight"])
def test_errors_name_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_row_layout():
    """Leading dims fold to one or two row strides; three that cannot fold are the fallback's."""
    assert norm_act_ref.row_layout(torch.empty(16)) == (1, 0, 0)
    assert norm_act_ref.row_layout(torch.empty(5, 7, 16)) == (35, 0, 16)
    assert norm_act_ref.row_layout(torch.empty(5, 7, 40)[..., 8:24]) == (35, 0, 40)
    assert norm_act_ref.row_layout(torch.empty(10, 14, 16)[::2, ::2]) == (7, 2 * 14 * 16, 32)
    assert norm_act_ref.row_layout(torch.empty(7, 5, 16).transpose(0, 1)) == (7, 16, 80)
    assert norm_act_ref.row_layout(torch.empty(5, 1, 7, 16)[:, :, ::2]) == (4, 7 * 16, 32)
    x3 = torch.empty(4, 6, 8, 16)[::2, ::2, ::2]
    assert norm_act_ref.row_layout(x3) is None
    assert "more than two strides" in norm_act_ref.rms_norm_unsupported(x3, torch.empty(16))
    assert "dtype torch.float64" in norm_act_ref.rms_norm_unsupported(torch.empty(3, 16, dtype=torch.float64), torch.empty(16))
    assert "last-dim stride" in norm_act_ref.gated_act_unsupported(torch.empty(16, 3).t(), torch.empty(3, 16))
    assert norm_act_ref.kda_out_gate_unsupported(torch.empty(2, 3, 8), torch.empty(2, 24, dtype=BF16), torch.empty(8)) is None


def test_cuda_fallback_takes_the_reference_and_warns_once(caplog):
    """The CUDA kernels' fallback branch (reached here with fp64 CPU tensors: it returns before
    importing triton)."""
    dispatch.log_fallback.cache_clear()
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="k3trt.plugins.dispatch"):
        for _ in range(2):
            assert torch.equal(na._rms_norm_cuda(x, w, EPS), na.rms_norm_reference(x, w, EPS))
        g, u = torch.randn(2, 3, 16, dtype=torch.float64).unbind(0)
        assert torch.equal(na._gated_act_cuda(g, u, "situ", 4.0, 0.0), na.situ_mul_reference(g, u, 4.0, 0.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "rms_norm" in warnings[0] and "float64" in warnings[0], warnings


def test_cuda_kernels_are_registered_without_importing_triton():
    code = ("import sys, torch, k3trt.plugins.norm_act\n"
            "for op in ('rms_norm', 'gated_act', 'kda_out_gate'):\n"
            "    assert torch._C._dispatch_has_kernel_for_dispatch_key('k3trt::' + op, 'CUDA'), op\n"
            "assert 'triton' not in sys.modules, 'importing norm_act imported triton'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- CPU: the kernels, interpreted
INTERPRETER_CASES = [NormCase(lead, N, dt, layout, block) for lead, (N, block), dt, layout in itertools.product(
    ((), (1,), (5,), (3, 4)), ((64, None), (96, None), (200, None), (96, 32), (200, 64)), (F32, BF16),
    ("contiguous", "column_slice", "row_gaps")) if lead or layout == "contiguous"]
# wide rows: one row per program (ROWS = 1), two column blocks for the activation
INTERPRETER_CASES += [NormCase((3,), 2304, dt, "column_slice") for dt in (F32, BF16)]
INTERPRETER_CASES += [ActCase((3,), 1100, "situ", dt, 25.0, "row_gaps") for dt in (F32, BF16)]
INTERPRETER_CASES += [ActCase(lead, I, kind, dt, lb, layout) for lead, I, (kind, lb), dt, layout in itertools.product(
    ((1,), (5,), (3, 4)), (64, 200), (("silu", 0.0), ("situ", 25.0), ("situ", 0.0)), (F32, BF16),
    ("halves", "row_gaps"))]
INTERPRETER_CASES += [GateCase(T, H, D, dt, layout, block) for T, H, (D, block), dt, layout in itertools.product(
    (1, 4), (1, 3), ((16, None), (96, None), (128, None), (96, 32)), (F32, BF16), ("contiguous", "heads_first"))]


def launchers() -> dict:
    """case type -> the Triton launcher on a case's inputs, writing a NaN-poisoned `out`."""
    from k3trt.plugins import norm_act_triton as nt  # noqa: PLC0415 (optional: triton)

    def poisoned(shape, dtype, device):
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return {
        NormCase: lambda c, x, w, eps: nt.rms_norm_fwd(x, w, eps, out=poisoned(x.shape, x.dtype, x.device),
                                                       block=c.block),
        ActCase: lambda c, g, u, kind, b, lb: nt.gated_act_fwd(g, u, kind, b, lb,
                                                               out=poisoned(g.shape, g.dtype, g.device)),
        GateCase: lambda c, o, g, w, eps: nt.kda_out_gate_fwd(o, g, w, eps, block=c.block,
                                                              out=poisoned(g.shape, g.dtype, g.device)),
    }


def interpreter_main() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: every INTERPRETER_CASES case, launcher vs reference."""
    launch = launchers()
    for i, case in enumerate(INTERPRETER_CASES):
        args = case.inputs(seed=i)
        check(case, args, launch[type(case)](case, *args))
    from k3trt.plugins import norm_act_triton as nt  # noqa: PLC0415 (optional: triton)
    empty = nt.rms_norm_fwd(torch.empty(0, 64), torch.ones(64), EPS)
    assert empty.shape == (0, 64)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    run_interpreted("test_norm_act")


# ----------------------------------------------------------------------------- GPU
TOKENS = (1, 7, 128, 512)
GPU_CASES = [NormCase((T,), N, dt) for N, T, dt in itertools.product((7168, 3584, 1536, 512), TOKENS, (BF16, F32))]
# q/kv latents sliced out of one projection; AttnRes sources [T, S, H] with a strided middle dim
GPU_CASES += [NormCase((T,), N, BF16, "column_slice") for N, T in itertools.product((1536, 512), (1, 128))]
GPU_CASES += [NormCase((T, 5), 7168, BF16, "row_gaps") for T in (1, 128)]
GPU_CASES += [ActCase((T,), I, kind, dt, lb) for I, T, (kind, lb), dt in itertools.product(
    (3072, 18432), TOKENS, (("silu", 0.0), ("situ", 25.0), ("situ", 0.0)), (BF16, F32))]
GPU_CASES += [GateCase(T, 96, 128, dt) for T, dt in itertools.product(TOKENS, (BF16, F32))]
GPU_CASES += [GateCase(7, 96, 128, BF16, "heads_first")]
UNSUPPORTED = {NormCase: lambda x, w, eps: norm_act_ref.rms_norm_unsupported(x, w),
               ActCase: lambda g, u, *_: norm_act_ref.gated_act_unsupported(g, u),
               GateCase: lambda o, g, w, eps: norm_act_ref.kda_out_gate_unsupported(o, g, w)}


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.gpu
def test_gpu_op_matches_reference(case):
    """Through torch.ops.k3trt.* (so through the registered CUDA kernel, not its fallback)."""
    args = case.inputs(seed=GPU_CASES.index(case), device="cuda")
    assert UNSUPPORTED[type(case)](*args) is None, "K3 sizes must take the kernel"
    check(case, args, getattr(torch.ops.k3trt, OPS[type(case)])(*args))


@pytest.mark.gpu
def test_gpu_fallback_for_fp64():
    args = NormCase((3,), 64, torch.float64).inputs(0, "cuda")
    assert torch.equal(torch.ops.k3trt.rms_norm(*args), na.rms_norm_reference(*args))


@pytest.mark.parametrize("case", [NormCase((64,), 7168, BF16, "column_slice"), ActCase((64,), 3072, "situ", BF16),
                                  GateCase(64, 96, 128, BF16)], ids=str)
@pytest.mark.gpu
def test_gpu_graph_capture_and_replay(case):
    """Capture the op on static inputs, copy a second step's values into them, replay."""
    op = getattr(torch.ops.k3trt, OPS[type(case)])
    static = case.inputs(seed=0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        op(*static)                                      # compiles the kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        y = op(*static)

    nxt = case.inputs(seed=1, device="cuda")
    for dst, src in zip(static, nxt, strict=True):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)                               # writes through the strided views
    graph.replay()
    torch.cuda.synchronize()
    check(case, nxt, y)
    assert torch.equal(y, op(*nxt)), "replay != eager"
