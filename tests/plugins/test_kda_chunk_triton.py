"""k3trt::kda_chunked on CUDA: the Triton kernel (kda_chunk_triton.py) against the torch body
(``kda_chunked_reference``) and the fp64 oracle (``kda_reference_loop``).

CPU (CI): the kernel under Triton's interpreter (a subprocess with TRITON_INTERPRET=1, which must be
set before triton is imported), fp32 and fp16 inputs (the interpreter rounds to bf16 inexactly):
empty, one-token, partial-chunk and multi-chunk sequences, batched and unbatched, several column
blocks, zero and random states, decays from weak to -8 per token, the -5 gate floor, near-resets
followed by almost no decay, and -inf (a hard reset of a channel). The fallback and argument
checks run without a kernel.
GPU (``-m gpu``, on the H200): K3 sizes (H = 96, dk = dv = 128, T in {64, 2048}, bf16 and fp32
inputs) against the torch body, every column block, the unbatched form, the fallback, dispatch
through the op once it is registered, and capture / replay in a CUDA graph.

Every input is a strided view (q, k, v column slices of one packed buffer, as the model splits its
projection; g, beta and the state non-contiguous), and the kernel writes into NaN-filled output
buffers, so an element it never writes fails the NaN-mask check.
Run the GPU part with ``pytest -m gpu tests/plugins/test_kda_chunk_triton.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from triton_interp import run_interpreted

from k3trt.plugins import dispatch, kda_ref
from k3trt.plugins import kda as ops
from k3trt.testing import assert_close

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# kernel vs torch body: both fp32, only chunking (16 vs the body's chunk) and summation order differ
KERNEL_TOL = dict(dtype=F32, atol=2e-6, rtol=2e-5, rel_norm=2e-6)
# fp32 against the fp64 oracle: the budget test_kda.py holds the torch body to
ORACLE_TOL = dict(dtype=F32)
# A 16-bit o from two fp32 computations may round to neighbouring values: one ulp, relative 2^-7
# (bf16) or 2^-10 (fp16) of the value.
O16_TOL = {BF16: dict(dtype=F32, atol=1e-6, rtol=2 ** -7, rel_norm=1e-3),
           F16: dict(dtype=F32, atol=1e-6, rtol=2 ** -10, rel_norm=1e-4)}
# at K3 sizes the state carries rounding across up to 128 chunks of 16
GPU_STATE_TOL = dict(dtype=F32, atol=1e-4, rtol=1e-4, rel_norm=2e-5)
GPU_O32_TOL = dict(dtype=F32, atol=1e-5, rtol=1e-4, rel_norm=2e-5)


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


# ----------------------------------------------------------------------------- cases
DECAYS = ("mild", "weak", "strong", "k3", "floor", "reset", "hard")


@dataclass(frozen=True)
class ChunkCase:
    T: int
    B: int | None = 1            # None: the unbatched [T, H, ...] form
    H: int = 2
    dk: int = 16
    dv: int = 16
    decay: str = "mild"          # one of DECAYS (see make_inputs)
    random_state: bool = True
    dtype: torch.dtype = F32     # of q, k, v (and so of o)
    block_v: int | None = None   # None: the launcher's choice

    def __str__(self) -> str:
        return (f"T{self.T}-B{self.B if self.B is not None else 'none'}-H{self.H}-dk{self.dk}-dv{self.dv}-"
                f"{self.decay}-{'state' if self.random_state else 'zero'}-{str(self.dtype).split('.')[-1]}"
                f"{'' if self.block_v is None else f'-bv{self.block_v}'}")


def make_inputs(case: ChunkCase, seed: int = 0, device: str | torch.device = "cpu") -> tuple:
    """(q, k, v, g, beta, state, scale) for `case`, every tensor a strided view made on `device`.
    Decays per token and channel: mild U[-1, 0], weak U[-0.05, 0], strong U[-8, 0], k3 the model's
    -5 * sigmoid(N(0, 1)), floor -5 everywhere but some undecayed channels of head 0, reset -1e-3
    with -60 on the first 3 and last 2 tokens of every 16 (near-resets, then spans of almost no
    decay that a G_t - G_i form would round at ~1e-5), hard as reset plus -inf on a few (token,
    channel) pairs."""
    gen = torch.Generator().manual_seed(seed)
    lead = (case.T,) if case.B is None else (case.B, case.T)
    H, dk, dv = case.H, case.dk, case.dv
    packed = torch.empty(*lead, H, 2 * dk + dv + 3)
    packed[..., :dk] = F.normalize(torch.randn(*lead, H, dk, generator=gen), dim=-1)
    packed[..., dk:2 * dk] = F.normalize(torch.randn(*lead, H, dk, generator=gen), dim=-1)
    packed[..., 2 * dk:2 * dk + dv] = torch.randn(*lead, H, dv, generator=gen)
    u = torch.rand(*lead, H, dk, generator=gen)
    if case.decay == "mild":
        g = -u
    elif case.decay == "weak":
        g = -0.05 * u
    elif case.decay == "strong":
        g = -8.0 * u
    elif case.decay == "k3":
        g = -5.0 * torch.sigmoid(torch.randn(u.shape, generator=gen))
    elif case.decay == "floor":
        g = torch.full_like(u, -5.0)
        g[..., 0, : dk // 4] = 0.0
    elif case.decay in ("reset", "hard"):
        g = torch.full_like(u, -1e-3)
        t = torch.arange(case.T)
        g[..., (t + 2) % 16 < 5, :, :] = -60.0
        if case.decay == "hard":
            g[..., t % 11 == 5, 0, : dk // 2] = float("-inf")
    else:
        raise ValueError(f"decay must be one of {DECAYS}, got {case.decay!r}")
    beta = torch.rand(*lead, H + 1, generator=gen)
    state = torch.randn(*lead[:-1], H, dv, dk, generator=gen) if case.random_state else \
        torch.zeros(*lead[:-1], H, dv, dk)
    packed = packed.to(case.dtype).to(device)
    q, k, v = packed[..., :dk], packed[..., dk:2 * dk], packed[..., 2 * dk:2 * dk + dv]
    g_wide = torch.cat([g, torch.zeros(*g.shape[:-1], 1)], -1).to(device)
    return (q, k, v, g_wide[..., :dk], beta.to(device)[..., :H], state.to(device).transpose(-1, -2),
            case.dk ** -0.5)


def oracle(q, k, v, g, beta, state, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """kda_reference_loop (fp64, one sequence at a time) over the batched or unbatched form."""
    if q.dim() == 3:
        o, final, _ = ops.kda_reference_loop(q, k, v, g, beta, state, scale)
        return o, final
    outs = [ops.kda_reference_loop(*(t[b] for t in (q, k, v, g, beta, state)), scale) for b in range(q.shape[0])]
    return torch.stack([o for o, _, _ in outs]), torch.stack([f for _, f, _ in outs])


def check_case(case: ChunkCase, seed: int, device, chunk_size: int, with_oracle: bool,
               o_tol: dict | None = None, state_tol: dict = KERNEL_TOL) -> None:
    """The kernel, writing into NaN-filled buffers, against the torch body (and the oracle)."""
    from k3trt.plugins import kda_chunk_triton as kt  # noqa: PLC0415 (optional: triton)
    args = make_inputs(case, seed, device)
    v, state = args[2], args[5]
    out = (torch.full(v.shape, float("nan"), dtype=v.dtype, device=v.device),
           torch.full(state.shape, float("nan"), device=state.device))
    o, final = kt.kda_chunked_fwd(*args, chunk_size, block_v=case.block_v, out=out)
    assert o is out[0] and final is out[1]
    assert o.dtype == case.dtype and final.dtype == F32
    assert not torch.isnan(o).any() and not torch.isnan(final).any(), "an output element was not written"
    ro, rfinal = kda_ref.kda_chunked_reference(*args, chunk_size)
    if o_tol is None:
        o_tol = KERNEL_TOL if case.dtype == F32 else O16_TOL[case.dtype]
    assert_close(o.float(), ro.float(), name="o vs torch body", **o_tol)
    assert_close(final, rfinal, name="final state vs torch body", **state_tol)
    if with_oracle:
        xo, xfinal = oracle(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in args))
        assert_close(o.float().cpu(), xo.float() if case.dtype == F32 else xo.to(case.dtype).float(),
                     name="o vs oracle", **(ORACLE_TOL if case.dtype == F32 else O16_TOL[case.dtype]))
        assert_close(final, xfinal, name="final state vs oracle", **ORACLE_TOL)


# ----------------------------------------------------------------------------- CPU: the kernel, interpreted
# (case, the op's chunk_size given to both the kernel (ignored) and the torch body)
INTERPRETER_CASES = (
    [(ChunkCase(T, decay="strong"), 32) for T in (1, 5, 16, 37, 70)]
    + [(ChunkCase(T, B=2, dk=32, dv=32, decay="weak", random_state=False), 64) for T in (1, 5, 16, 37, 70)]
    + [(ChunkCase(0, B=2), 32),
       (ChunkCase(37, B=2, dv=32, decay="mild", block_v=16), 16),
       (ChunkCase(70, B=None, dk=32, dv=16, decay="strong"), 32),
       (ChunkCase(37, decay="reset"), 32),
       (ChunkCase(37, B=None, dk=32, decay="hard"), 64),
       (ChunkCase(40, decay="floor"), 64),
       (ChunkCase(21, B=2, dk=32, dv=32, decay="k3", random_state=False, block_v=16), 32),
       (ChunkCase(20, dk=64, dv=64, decay="k3"), 32),
       (ChunkCase(37, dtype=F16), 32)]
)


def interpreter_main() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: every INTERPRETER_CASES case on the CPU."""
    for n, (case, chunk) in enumerate(INTERPRETER_CASES):
        start = time.perf_counter()
        try:
            check_case(case, seed=n, device="cpu", chunk_size=chunk, with_oracle=True)
        except AssertionError as e:
            raise AssertionError(f"case {case} (chunk_size {chunk}): {e}") from e
        print(f"{case}: {time.perf_counter() - start:.2f} s", file=sys.stderr)


@needs_triton
def test_triton_kernel_under_interpreter():
    """The kernel's own code on the CPU (Triton's interpreter): chunk edges, strides, column blocks,
    masks and the stable exponents, against the torch body and the fp64 oracle."""
    run_interpreted("test_kda_chunk_triton", timeout=600)


# ----------------------------------------------------------------------------- CPU: no kernel launched
@needs_triton
def test_fallback_off_cuda_logs_once(caplog):
    """Off CUDA (and for any unsupported call) the op's CUDA registration is the torch body, with one
    warning."""
    dispatch.log_fallback.cache_clear()
    args = make_inputs(ChunkCase(20), 1)
    with caplog.at_level(logging.WARNING, logger="k3trt"):
        for _ in range(2):
            o, final = ops._kda_chunked_cuda(*args, 32)
    ro, rfinal = kda_ref.kda_chunked_reference(*args, 32)
    assert torch.equal(o, ro) and torch.equal(final, rfinal)
    warnings = [r for r in caplog.records if "kda_chunked" in r.getMessage()]
    assert len(warnings) == 1 and "not on CUDA" in warnings[0].getMessage()


@needs_triton
def test_unsupported_reasons():
    q, k, v, g, beta, state, _ = make_inputs(ChunkCase(3, dk=16, dv=16), 0)
    assert "not on CUDA" in kda_ref.kda_chunked_unsupported(q, k, v, g, beta, state)
    small = make_inputs(ChunkCase(3, dk=8, dv=16), 0)
    assert "dk=8" in kda_ref.kda_chunked_unsupported(*small[:6])
    assert "q torch.float64" in kda_ref.kda_chunked_unsupported(q.double(), k, v, g, beta, state)


@needs_triton
def test_validation_names_the_argument():
    from k3trt.plugins import kda_chunk_triton as kt  # noqa: PLC0415 (optional: triton)
    q, k, v, g, beta, state, scale = make_inputs(ChunkCase(5, dv=32), 0)
    with pytest.raises(ValueError, match="k has shape"):
        kt.kda_chunked_fwd(q, k[:, :4], v, g, beta, state, scale, 32)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        kt.kda_chunked_fwd(q, k, v, g, beta, state, scale, 0)
    with pytest.raises(ValueError, match="block_v 24"):
        kt.kda_chunked_fwd(q, k, v, g, beta, state, scale, 32, block_v=24)
    bad = (torch.empty(v.shape, dtype=v.dtype), torch.empty(state.shape, dtype=F16))
    with pytest.raises(ValueError, match=r"out\[1\]"):
        kt.kda_chunked_fwd(q, k, v, g, beta, state, scale, 32, out=bad)


@needs_triton
def test_pick_block_v():
    from k3trt.plugins.kda_chunk_triton import pick_block_v  # noqa: PLC0415 (optional: triton)
    assert pick_block_v(1, 96, 128, 128, 132) == (64, 8)       # K3 prefill, one sequence
    assert pick_block_v(8, 96, 128, 128, 132) == (64, 8)       # the register budget caps it
    assert pick_block_v(1, 12, 128, 128, 132) == (16, 4)       # a TP-sharded layer: every SM busy
    assert pick_block_v(4, 96, 256, 256, 132)[0] == 32
    assert pick_block_v(1, 2, 16, 32, 1) == (32, 4)


# ----------------------------------------------------------------------------- GPU
GPU_CASES = [ChunkCase(T, B=B, H=96, dk=128, dv=128, decay=decay, dtype=dt)
             for T, B, decay, dt in ((64, 1, "k3", BF16), (64, 2, "strong", BF16), (100, 1, "reset", BF16), (100, 1, "hard", F32),
                                     (2048, 1, "k3", BF16), (2048, 1, "weak", BF16), (2048, 2, "k3", BF16),
                                     (2048, 1, "k3", F32), (2048, 1, "weak", F32))]
GPU_CASES += [ChunkCase(64, B=None, H=96, dk=128, dv=128, decay="k3", dtype=BF16)]
GPU_CASES += [ChunkCase(100, B=2, H=96, dk=128, dv=128, decay="k3", dtype=BF16, block_v=bv) for bv in (16, 32, 64, 128)]


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.gpu
def test_gpu_kernel_matches_torch_body(case):
    o_tol = GPU_O32_TOL if case.dtype == F32 else O16_TOL[case.dtype]
    check_case(case, seed=case.T, device="cuda", chunk_size=32, with_oracle=False, o_tol=o_tol,
               state_tol=GPU_STATE_TOL)


@pytest.mark.gpu
def test_gpu_fallback_for_small_heads(caplog):
    """dk = dv = 8 is not the kernel's: the op's CUDA registration is the torch body, with a warning."""
    dispatch.log_fallback.cache_clear()
    args = make_inputs(ChunkCase(40, dk=8, dv=8), 0, "cuda")
    with caplog.at_level(logging.WARNING, logger="k3trt"):
        o, final = ops._kda_chunked_cuda(*args, 32)
    ro, rfinal = kda_ref.kda_chunked_reference(*args, 32)
    assert torch.equal(o, ro) and torch.equal(final, rfinal)
    assert any("dk=8" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_gpu_op_dispatches_to_the_kernel():
    """The op on CUDA tensors is the kernel, bit for bit."""
    from k3trt.plugins import kda_chunk_triton as kt  # noqa: PLC0415 (optional: triton)
    args = make_inputs(ChunkCase(300, B=2, H=96, dk=128, dv=128, decay="k3", dtype=BF16), 5, "cuda")
    o, final = torch.ops.k3trt.kda_chunked(*args, 32)
    ko, kfinal = kt.kda_chunked_fwd(*args, 32)
    assert torch.equal(o, ko) and torch.equal(final, kfinal)


@pytest.mark.gpu
def test_gpu_graph_capture_and_replay():
    """Capture the launcher (under inference_mode, as runtime/graphs.py does), copy a second call's
    inputs into the static buffers, replay: equal to running that call eagerly, bit for bit."""
    case = ChunkCase(200, B=2, H=96, dk=128, dv=128, decay="k3", dtype=BF16)
    static = make_inputs(case, 10, "cuda")
    nxt = make_inputs(case, 11, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        ops._kda_chunked_cuda(*static, 32)                     # compiles the kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        o_static, final_static = ops._kda_chunked_cuda(*static, 32)

    for dst, src in zip(static[:6], nxt[:6]):
        dst.copy_(src)                # q, k, v are views of one buffer: copy_ writes through them
    o_eager, final_eager = ops._kda_chunked_cuda(*nxt, 32)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o_static, o_eager), "replay != eager (o)"
    assert torch.equal(final_static, final_eager), "replay != eager (final state)"
    ro, rfinal = kda_ref.kda_chunked_reference(*nxt, 32)
    assert_close(o_static.float(), ro.float(), name="replayed o vs torch body", **O16_TOL[BF16])
    assert_close(final_static, rfinal, name="replayed state vs torch body", **GPU_STATE_TOL)
