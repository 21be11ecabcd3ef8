"""kda_restore: the Triton kernel (kda_restore_triton.py) against the torch reference.

CPU (CI): the kernel under Triton's interpreter against ``kda_restore_reference``, and the CPU
path (the reference) against the same rollback written per layer. GPU (``-m gpu``): K3's state
rows (64 heads of 128 × 128 fp32, conv windows in bf16) at batch 1 and 32, through the dispatcher,
and capture / replay in a CUDA graph. The restored slots start as NaN: every element of their rows
must be written; the other slots must keep their bits. A copy is exact in every dtype.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch
from triton_interp import run_interpreted

from k3trt.plugins import kda_restore as op

F32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class Case:
    L: int
    slots: int
    max_q: int
    row: tuple[int, ...]
    B: int
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"L{self.L}-s{self.slots}-q{self.max_q}-{'x'.join(map(str, self.row))}-B{self.B}-{self.dtype}"


def make(case: Case, seed: int, device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device).manual_seed(seed)
    state = torch.randn(case.L, case.slots, *case.row, generator=g, device=device).to(case.dtype)
    step = torch.randn(case.L, case.slots, case.max_q, *case.row, generator=g, device=device).to(case.dtype)
    slots = torch.randperm(case.slots, generator=g, device=device)[:case.B]
    positions = torch.randint(0, case.max_q, (case.B,), generator=g, device=device)
    state[:, slots] = float("nan")          # what the restore must overwrite entirely
    return state, step, slots, positions


def expected(state, step, slots, positions) -> torch.Tensor:
    want = state.clone()
    for b in range(slots.numel()):          # one sequence and one layer at a time: the plain rule
        for layer in range(state.shape[0]):
            want[layer, slots[b]] = step[layer, slots[b], positions[b]]
    return want


def check(case: Case, seed: int, device, restore) -> None:
    state, step, slots, positions = make(case, seed, device)
    want = expected(state, step, slots, positions)
    restore(state, step, slots, positions)
    assert not state[:, slots].isnan().any(), f"{case}: restored rows left unwritten"
    # bitwise: a copy is exact, and the slots no sequence restores keep their bits
    assert torch.equal(state.view(torch.uint8), want.view(torch.uint8)), f"{case}: rows differ"


CPU_CASES = [Case(3, 5, 4, (2, 4, 4), 3, F32), Case(2, 6, 3, (24, 3), 6, BF16), Case(1, 2, 2, (4097,), 1, F32),
             Case(4, 9, 5, (3, 8, 8), 4, F32)]


def interpreter_main() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: the launcher on CPU tensors vs the plain rule."""
    from k3trt.plugins import kda_restore_triton  # noqa: PLC0415 (optional: triton)
    for i, case in enumerate(CPU_CASES):
        check(case, i, "cpu", kda_restore_triton.kda_restore_fwd)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    run_interpreted("test_kda_restore")


@pytest.mark.parametrize("chunk", [1 << 62, 1])       # every layer in one group; one layer a group
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_reference_is_the_plain_rule(monkeypatch, case, chunk):
    monkeypatch.setattr(op, "RESTORE_CHUNK_BYTES", chunk)
    check(case, 7, "cpu", op.kda_restore)


def test_unsupported_calls_say_why():
    s, st = torch.zeros(2, 3, 4), torch.zeros(2, 3, 2, 4)
    i = torch.zeros(1, dtype=torch.int64)
    assert op.kda_restore_unsupported(s, st, i, i) is None
    assert "shapes" in op.kda_restore_unsupported(s, st[:, :2], i, i)
    assert "dtypes" in op.kda_restore_unsupported(s, st.to(BF16), i, i)
    assert "non-contiguous" in op.kda_restore_unsupported(s.transpose(0, 1), st.transpose(0, 1), i, i)
    assert "positions" in op.kda_restore_unsupported(s, st, i, i.int())


# ----------------------------------------------------------------------------- GPU
K3_STATE, K3_CONV = (64, 128, 128), (3 * 64 * 128, 3)
GPU_CASES = [Case(L, slots, 4, row, B, dtype) for L, slots, B in ((6, 4, 1), (2, 36, 32), (3, 20, 17))
             for row, dtype in ((K3_STATE, F32), (K3_CONV, BF16))] \
    + [Case(16, 36, 4, K3_STATE, 8, F32)]      # step states of 2.4e9 elements: offsets past int32


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.gpu
def test_gpu_kernel_matches_the_plain_rule(case):
    check(case, case.B, "cuda", op.kda_restore)


@pytest.mark.gpu
def test_gpu_graph_capture_and_replay():
    case = Case(4, 12, 4, K3_STATE, 8, F32)
    state, step, slots, positions = make(case, 0, "cuda")
    op.kda_restore(state, step, slots, positions)         # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.kda_restore(state, step, slots, positions)
    state2, step2, slots2, positions2 = make(case, 1, "cuda")
    for dst, src in ((state, state2), (step, step2), (slots, slots2), (positions, positions2)):
        dst.copy_(src)
    want = expected(state2, step2, slots2, positions2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(state.view(torch.uint8), want.view(torch.uint8))
