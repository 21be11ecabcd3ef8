"""k3trt::mla_cache_write on CUDA: the Triton kernel (cache_write_triton.py) against the torch body.

CPU (CI): the kernel under Triton's interpreter (a subprocess with TRITON_INTERPRET=1) against
``mla_cache_write_reference``. The interpreter emulates fp32 -> bf16 / fp8 casts inexactly (it
truncates, or rounds without carrying into the exponent), so its cases use values the cache dtype
holds exactly after the scaling (x / kv_scale with a power-of-two scale): they check addressing,
masks, scaling and saturation; rounding is checked on the GPU.
GPU (``-m gpu``, on the H200): K3 rows (512 + 64) with bf16 / fp32 inputs into bf16, fp32 and fp8
caches, rounding included, and capture / replay of the op in a CUDA graph (the torch body reads
slot_mapping back to the host, so the capture only succeeds on the kernel path).

Every case prefills the cache with NaN (fp8: the 0x7F NaN code): rows no token writes, and the
rows of negative (padding) or out-of-range slots, must keep their bits.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass

import pytest
import torch
from triton_interp import run_interpreted

from k3trt.plugins.cache_write import mla_cache_write_reference
from k3trt.testing import bits

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
F32 = torch.float32


@dataclass(frozen=True)
class WriteCase:
    T: int                       # tokens
    R: int                       # kv_c width
    P: int                       # k_pe width
    cache_dtype: torch.dtype
    in_dtype: torch.dtype
    kv_scale: float = 1.0
    blocks: int = 4
    block_size: int = 16
    exact: bool = False          # only values the cache holds exactly (for the interpreter)

    def __str__(self) -> str:
        name = lambda d: str(d).split(".")[-1]  # noqa: E731
        return (f"T{self.T}-{self.R}+{self.P}-{name(self.in_dtype)}to{name(self.cache_dtype)}"
                f"-s{self.kv_scale:g}{'-exact' if self.exact else ''}")


def make_inputs(case: WriteCase, seed: int = 0, device: str | torch.device = "cpu"):
    """(kv_c, k_pe, cache, slot_mapping, kv_scale): kv_c and k_pe strided column slices of one
    projection output (as the model's latent projection is split), about a quarter of the slots
    negative (padding) and one past the cache; a few rows scaled past the fp8 range."""
    gen = torch.Generator().manual_seed(seed)
    T, R, P = case.T, case.R, case.P
    x = torch.randn(T, R + P + 8, generator=gen) * 4
    x[::5] *= 300                                  # saturates fp8 (448 · kv_scale) in some rows
    if case.exact:
        # x / kv_scale (kv_scale a power of two) held exactly by the cache and input dtypes, or past
        # the fp8 range (saturating to exactly 448) and held by bf16: nothing to round
        store = case.cache_dtype if case.cache_dtype != F32 else case.in_dtype
        y = x / case.kv_scale
        y = torch.where(y.abs() <= 448, y.to(store).float(), y.to(BF16).float())
        y[y.abs() < 2 ** -6] = 1.0                 # no fp8 subnormals
        x = y * case.kv_scale
    proj = x.to(case.in_dtype)
    kv_c, k_pe = proj[:, :R], proj[:, R + 8:]
    rows = case.blocks * case.block_size
    slots = torch.randperm(rows, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < 0.25] = -1
    if T >= 3:
        slots[1] = rows + 7                        # past the cache: skipped by the kernel
    cache = torch.full((case.blocks, case.block_size, R + P), float("nan")).to(case.cache_dtype)
    if case.cache_dtype == FP8:
        cache.view(torch.uint8).fill_(0x7F)        # e4m3fn NaN
    return kv_c.to(device), k_pe.to(device), cache.to(device), slots.to(device), case.kv_scale


def reference(kv_c, k_pe, cache, slots, kv_scale):
    """The op's torch body on the in-range slots (it raises on the others)."""
    rows = cache.shape[0] * cache.shape[1]
    keep = slots < rows
    mla_cache_write_reference(kv_c[keep], k_pe[keep], cache, slots[keep], kv_scale)


def check(got: torch.Tensor, want: torch.Tensor, ulps: int = 0) -> None:
    """Bitwise equal; with `ulps` > 0 (fp8 on the GPU), equal codes but for at most `ulps` steps of
    the same sign, on at most 0.1% of the elements (a rounding-mode difference, not a bug)."""
    a, b = bits(got).int(), bits(want).int()
    if ulps == 0 or torch.equal(a, b):
        bad = (a != b).nonzero()
        assert not len(bad), f"{len(bad)} elements differ, first at {bad[0].tolist()}: " \
                             f"{got[tuple(bad[0])].float().item()} != {want[tuple(bad[0])].float().item()}"
        return
    sign_a, sign_b, mag_a, mag_b = a & 0x80, b & 0x80, a & 0x7F, b & 0x7F
    near = ((sign_a == sign_b) | (mag_a == 0) & (mag_b == 0)) & ((mag_a - mag_b).abs() <= ulps)
    assert near.all(), f"fp8 codes differ by more than {ulps} step(s) at {(~near).nonzero()[0].tolist()}"
    frac = (a != b).float().mean().item()
    assert frac <= 1e-3, f"{frac:.2%} of the fp8 codes differ by one step (rounding mode?)"


def run_and_check(case: WriteCase, seed: int, device, write, ulps: int = 0) -> None:
    kv_c, k_pe, cache, slots, scale = make_inputs(case, seed, device)
    want = cache.clone()
    reference(kv_c, k_pe, want, slots, scale)
    write(kv_c, k_pe, cache, slots, scale)
    check(cache, want, ulps)


# ----------------------------------------------------------------------------- CPU: the kernel, interpreted
INTERPRETER_CASES = [WriteCase(T, R, P, cd, ind, scale, exact=True)
                     for T, (R, P), (cd, ind, scale) in itertools.product(
                         (1, 5, 13), ((32, 16), (160, 32)),
                         ((BF16, BF16, 1.0), (BF16, F32, 1.0), (F32, BF16, 1.0), (FP8, BF16, 0.5), (FP8, F32, 4.0)))]


def interpreter_main() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: the launcher on CPU tensors vs the torch body."""
    from k3trt.plugins import cache_write_triton  # noqa: PLC0415 (optional: triton)
    for case in INTERPRETER_CASES:
        try:
            run_and_check(case, case.T, "cpu", cache_write_triton.mla_cache_write_fwd)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {e}") from e


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    run_interpreted("test_cache_write_triton")


def test_cpu_op_is_the_torch_body():
    """On the CPU the op still runs its torch body (and raises on a slot past the cache)."""
    kv_c, k_pe, cache, slots, scale = make_inputs(WriteCase(6, 32, 16, BF16, BF16), 1)
    slots[1] = 3
    want = cache.clone()
    reference(kv_c, k_pe, want, slots, scale)
    torch.ops.k3trt.mla_cache_write(kv_c, k_pe, cache, slots, scale)
    check(cache, want)
    with pytest.raises(IndexError, match="past the cache"):
        torch.ops.k3trt.mla_cache_write(kv_c, k_pe, cache, torch.full_like(slots, 64), scale)


# ----------------------------------------------------------------------------- GPU
GPU_CASES = [WriteCase(T, 512, 64, cd, ind, scale, blocks=40, block_size=64)
             for T, (cd, ind, scale) in itertools.product(
                 (1, 7, 64, 300),
                 ((BF16, BF16, 1.0), (BF16, F32, 1.0), (F32, BF16, 1.0), (FP8, BF16, 1.0), (FP8, BF16, 0.0173),
                  (FP8, F32, 0.5)))]


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.gpu
def test_gpu_op_matches_torch_body(case):
    """Through the op (so through the registered CUDA kernel); rounding included."""
    run_and_check(case, case.T, "cuda", torch.ops.k3trt.mla_cache_write, ulps=1 if case.cache_dtype == FP8 else 0)


@pytest.mark.parametrize("cache_dtype", [BF16, FP8])
@pytest.mark.gpu
def test_gpu_graph_capture_and_replay(cache_dtype):
    """Capture the op with static inputs, copy a second step's tokens and slots in, replay."""
    case = WriteCase(48, 512, 64, cache_dtype, BF16, 0.25 if cache_dtype == FP8 else 1.0, blocks=40, block_size=64)
    kv_c, k_pe, cache, slots, scale = make_inputs(case, 0, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        torch.ops.k3trt.mla_cache_write(kv_c, k_pe, cache, slots, scale)   # compiles before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        torch.ops.k3trt.mla_cache_write(kv_c, k_pe, cache, slots, scale)

    kv_c2, k_pe2, cache2, slots2, _ = make_inputs(case, 1, "cuda")
    kv_c.copy_(kv_c2)
    k_pe.copy_(k_pe2)
    slots.copy_(slots2)
    cache.copy_(cache2)
    want = cache2.clone()
    reference(kv_c2, k_pe2, want, slots2, scale)
    graph.replay()
    torch.cuda.synchronize()
    check(cache, want, ulps=1 if cache_dtype == FP8 else 0)
