"""k3trt::kda_recurrent_slots: the in-place KDA recurrence over cache slots, and its Triton kernel.

CPU (CI): the op's torch body against the fp64 oracle (kda_reference_loop); opcheck; the Triton
kernel itself under Triton's interpreter (a subprocess with TRITON_INTERPRET=1, which must be set
before triton is imported) against the torch body.
GPU (``-m gpu``, on the H200): the kernel at K3 sizes against the torch body, dispatch through
the op, the fallback, and capture / replay in a CUDA graph.

Every case fills the caches with traps: fresh rows' slots and every slot no row owns hold NaN or
random values that must stay bit for bit, the per-position state cache is NaN wherever the step
must not write, and several padding rows share one trash slot (fresh, results don't-care).
Run the GPU part with ``pytest -m gpu tests/plugins/test_kda_triton.py``.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interp import run_interpreted

from k3trt.plugins import kda as ops
from k3trt.plugins import kda_ref
from k3trt.testing import assert_close, bits, same_bits

F32 = torch.float32
# kernel vs torch body: both fp32, only the order of the dk-long sums differs
KERNEL_TOL = dict(dtype=F32, atol=1e-4, rtol=1e-4, rel_norm=1e-5)


# ----------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class SlotsCase:
    B: int                     # rows, padding included
    n: int                     # positions per row
    H: int = 2
    dk: int = 16
    dv: int = 16
    save: bool = True
    dtype: torch.dtype = F32   # of q, k, v

    @property
    def padding(self) -> int:
        """Trailing padding rows (fresh, all on one trash slot): 0 for B <= 2."""
        return (self.B + 1) // 4

    @property
    def real(self) -> int:
        return self.B - self.padding

    def __str__(self) -> str:
        return (f"B{self.B}-n{self.n}-H{self.H}-dk{self.dk}-dv{self.dv}-"
                f"{'save' if self.save else 'nosave'}-{str(self.dtype).split('.')[-1]}")


@dataclass
class SlotsInputs:
    args: tuple                # the op's arguments, in order
    real_slots: torch.Tensor   # slots of the real rows (distinct)
    untouched: torch.Tensor    # slots no row owns: must keep their bits


def make_inputs(case: SlotsCase, seed: int = 0, device: str | torch.device = "cpu") -> SlotsInputs:
    """The op's arguments for `case`: q, k, v strided views of one packed buffer (as the model's
    projections are), beta a strided view, states ~N(0, 0.25), decays in [-1, 0]."""
    gen = torch.Generator().manual_seed(seed)
    B, n, H, dk, dv = case.B, case.n, case.H, case.dk, case.dv
    packed = torch.empty(B, n, H, 2 * dk + dv)
    packed[..., :dk] = F.normalize(torch.randn(B, n, H, dk, generator=gen), dim=-1)
    packed[..., dk:2 * dk] = F.normalize(torch.randn(B, n, H, dk, generator=gen), dim=-1)
    packed[..., 2 * dk:] = torch.randn(B, n, H, dv, generator=gen)
    packed = packed.to(case.dtype)
    q, k, v = packed[..., :dk], packed[..., dk:2 * dk], packed[..., 2 * dk:]
    g = -torch.rand(B, n, H, dk, generator=gen)
    beta = torch.rand(B, n, H + 1, generator=gen)[..., :H]

    num_slots = B + 3
    perm = torch.randperm(num_slots, generator=gen)
    real, trash, untouched = perm[:case.real], perm[-1], perm[case.real:-1]
    slots = torch.cat([real, trash.repeat(case.padding)])
    fresh = torch.zeros(B, dtype=torch.bool)
    fresh[case.real:] = True
    if case.real >= 2:          # keep one real row of a one-row batch on its stored state
        fresh[0:case.real:3] = True
    state = torch.randn(num_slots, H, dk, dv, generator=gen) * 0.5
    state[slots[fresh]] = float("nan")      # a fresh row must not read its slot
    state[untouched[0]] = float("nan")      # untouched: NaN and random values, kept bit for bit
    # made on the device: at K3 sizes it is the largest tensor here
    step = torch.full((num_slots, n + 1, H, dk, dv), float("nan"), device=device) if case.save else \
        torch.empty(0, device=device)
    to = lambda t: t.to(device)  # noqa: E731
    args = (to(q), to(k), to(v), to(g), to(beta), to(state), to(slots), to(fresh), to(step),
            dk ** -0.5, case.save)
    return SlotsInputs(args, real, untouched)


def clone_caches(args: tuple) -> tuple:
    """args with fresh copies of the two mutated caches (positions 5 and 8)."""
    a = list(args)
    a[5], a[8] = a[5].clone(), a[8].clone()
    return tuple(a)


def check_against(o, args, ref_o, ref_args, before, inp: SlotsInputs, case: SlotsCase, tol: dict) -> None:
    """o and the mutated caches in `args` against a reference run (`ref_*`); `before`: the caches
    before either run. Real rows within `tol`; unowned slots and unwritten positions bitwise."""
    R, n = case.real, case.n
    state, step, ref_state, ref_step = args[5], args[8], ref_args[5], ref_args[8]
    real, untouched = inp.real_slots.to(state.device), inp.untouched.to(state.device)
    assert o.shape == (case.B, n, case.H, case.dv) and o.dtype == F32
    assert_close(o[:R], ref_o[:R], name="o (real rows)", **tol)
    assert torch.isfinite(o[R:]).all(), "padding rows start fresh: their outputs are finite"
    assert_close(state[real], ref_state[real], name="final state of the real slots", **tol)
    assert torch.equal(bits(state[untouched]), bits(before[0][untouched])), "a slot no row owns was written"
    if case.save:
        assert_close(step[real, :n], ref_step[real, :n], name="state after each position", **tol)
        assert torch.equal(bits(step[real, n:]), bits(before[1][real, n:])), "step states past n were written"
        assert torch.equal(bits(step[untouched]), bits(before[1][untouched])), "step states of an unowned slot"
    else:
        assert step.numel() == 0


def run_and_check(case: SlotsCase, seed: int, device, kernel, reference, tol: dict) -> None:
    """kernel(*args) and reference(*args) on copies of the same inputs, then check_against."""
    inp = make_inputs(case, seed, device)
    before = (inp.args[5].clone(), inp.args[8].clone())
    args, ref_args = clone_caches(inp.args), clone_caches(inp.args)
    o = kernel(*args)
    ref_o = reference(*ref_args)
    check_against(o, args, ref_o, ref_args, before, inp, case, tol)


# ----------------------------------------------------------------------------- CPU: torch body vs oracle
CPU_CASES = [SlotsCase(B, n, save=save, dtype=dt)
             for B, n, save, dt in itertools.product((1, 5), (1, 4, 7), (True, False), (F32, torch.bfloat16))]


def _oracle(q, k, v, g, beta, state, slots, fresh, step, scale, save):
    """kda_reference_loop row by row (fp64), writing the caches as the op should."""
    o = torch.empty(*v.shape, dtype=F32)
    for b in range(q.shape[0]):
        s = int(slots[b])
        s0 = torch.zeros_like(state[s]) if fresh[b] else state[s]
        ob, final, states = ops.kda_reference_loop(q[b], k[b], v[b], g[b], beta[b], s0, scale)
        o[b], state[s] = ob, final
        if save:
            step[s, :q.shape[1]] = states
    return o


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_torch_body_matches_oracle(case):
    run_and_check(case, seed=case.n, device="cpu", kernel=torch.ops.k3trt.kda_recurrent_slots,
                  reference=_oracle, tol=dict(dtype=F32))


def test_no_save_leaves_a_given_step_cache_alone():
    inp = make_inputs(SlotsCase(4, 3, save=True))
    args = list(clone_caches(inp.args))
    args[-1] = False
    before = args[8].clone()
    torch.ops.k3trt.kda_recurrent_slots(*args)
    assert torch.equal(bits(args[8]), bits(before))


def test_validation_names_the_problem():
    inp = make_inputs(SlotsCase(2, 4))
    args = list(clone_caches(inp.args))
    args[8] = args[8][:, :3]                     # max_q 3 < n = 4
    with pytest.raises(ValueError, match="max_q >= 4"):
        torch.ops.k3trt.kda_recurrent_slots(*args)
    args = list(clone_caches(inp.args))
    args[6] = args[6].int().float()
    with pytest.raises(ValueError, match="slots must be int64"):
        torch.ops.k3trt.kda_recurrent_slots(*args)


def test_opcheck():
    """Schema (the two mutated caches), fake implementation and tracing agree with the real op."""
    inp = make_inputs(SlotsCase(2, 3, dtype=torch.bfloat16))
    args = list(clone_caches(inp.args))
    args[5] = torch.nan_to_num(args[5])         # opcheck compares runs; NaN != NaN
    args[8] = torch.zeros_like(args[8])
    torch.library.opcheck(ops.kda_recurrent_slots, tuple(args))


def test_fake_shape():
    inp = make_inputs(SlotsCase(3, 4, dv=32))
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inp.args]
        o = torch.ops.k3trt.kda_recurrent_slots(*args)
        assert o.shape == (3, 4, 2, 32) and o.dtype == F32


def test_cuda_kernel_is_registered_without_importing_triton():
    code = ("import sys, torch, k3trt.plugins\n"
            "assert torch._C._dispatch_has_kernel_for_dispatch_key('k3trt::kda_recurrent_slots', 'CUDA')\n"
            "assert torch._C._dispatch_has_kernel_for_dispatch_key('k3trt::mla_cache_write', 'CUDA')\n"
            "assert 'triton' not in sys.modules, 'importing k3trt.plugins imported triton'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- CPU: the kernel, interpreted
# (case, BV): dk = 16 with the whole dv = 32 in one column block, dk = 32 with two blocks of 16
INTERPRETER_CASES = [(SlotsCase(B, n, dk=dk, dv=32, save=save, dtype=dt), 512 // dk)
                     for (B, n), dk, save, dt in itertools.product(((1, 1), (4, 4), (5, 7)), (16, 32), (True, False),
                                                                   (F32, torch.bfloat16))]


def interpreter_main() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: kda_triton's launcher on CPU tensors against the
    torch body, every INTERPRETER_CASES case."""
    from k3trt.plugins import kda_triton  # noqa: PLC0415 (optional: triton)
    for case, bv in INTERPRETER_CASES:
        def kernel(*a, bv=bv):
            return kda_triton.kda_recurrent_slots_fwd(*a, block_v=bv)
        try:
            run_and_check(case, 1, "cpu", kernel, kda_ref.kda_recurrent_slots_reference, KERNEL_TOL)
        except AssertionError as e:
            raise AssertionError(f"case {case} BV={bv}: {e}") from e
    # a slot outside the cache is neither read nor written (the torch body would raise): the caches
    # are the first 5 slots of larger buffers, whose rest must keep its bits
    inp = make_inputs(SlotsCase(2, 2), 0)
    args = list(clone_caches(inp.args))
    backing = [torch.randn(200, *args[i].shape[1:]) for i in (5, 8)]
    for j, i in enumerate((5, 8)):
        backing[j][:5] = args[i]
        args[i] = backing[j][:5]
    args[6] = torch.tensor([1, 100])
    args[7] = torch.tensor([False, False])
    before = [b.clone() for b in backing]
    o = kda_triton.kda_recurrent_slots_fwd(*args)
    keep = torch.arange(200) != 1
    assert torch.equal(bits(backing[0][keep]), bits(before[0][keep])), "out-of-range slot: state written"
    assert torch.equal(bits(backing[1][keep]), bits(before[1][keep])), "out-of-range slot: step state written"
    zero = list(clone_caches(inp.args))
    zero[6], zero[7] = torch.tensor([1, 1]), torch.tensor([False, True])
    ref = kda_ref.kda_recurrent_slots_reference(*zero)
    assert_close(o[1], ref[1], name="out-of-range slot: o from a zero state", **KERNEL_TOL)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    """The kernel's own code on the CPU (Triton's interpreter), against the torch body: the column
    blocks, strides, masks of fresh / unowned / out-of-range slots and the per-position stores."""
    run_interpreted("test_kda_triton")


# ----------------------------------------------------------------------------- GPU
# (case, BV): every case with the launcher's own choice of BV, a few with the other column blocks
GPU_CASES = [(SlotsCase(B, n, H=H, dk=128, dv=128, save=save, dtype=dt), None)
             for H, B, n, save, dt in itertools.product((96, 12), (1, 3, 32), (1, 4), (True, False),
                                                         (torch.bfloat16, F32))]
GPU_CASES += [(SlotsCase(B, 4, H=96, dk=128, dv=128, dtype=torch.bfloat16), bv)
              for B, bv in itertools.product((3, 32), (16, 32, 64, 128))]


@pytest.mark.parametrize("case,bv", GPU_CASES, ids=lambda x: str(x) if x is not None else "auto")
@pytest.mark.gpu
def test_gpu_kernel_matches_torch_body(case, bv):
    from k3trt.plugins import kda_triton  # noqa: PLC0415 (optional: triton)
    run_and_check(case, case.B + case.n, "cuda",
                  lambda *a: kda_triton.kda_recurrent_slots_fwd(*a, block_v=bv),
                  kda_ref.kda_recurrent_slots_reference, KERNEL_TOL)


@pytest.mark.gpu
def test_gpu_op_dispatches_to_the_kernel():
    """At K3 sizes the op takes the kernel (no fallback) and equals a direct launch bit for bit."""
    from k3trt.plugins import kda_triton  # noqa: PLC0415 (optional: triton)
    case = SlotsCase(8, 4, H=96, dk=128, dv=128, dtype=torch.bfloat16)
    inp = make_inputs(case, 3, "cuda")
    a = inp.args
    assert kda_ref.kda_recurrent_slots_unsupported(a[0], a[2], a[5], a[8], True) is None
    args, direct = clone_caches(a), clone_caches(a)
    o = torch.ops.k3trt.kda_recurrent_slots(*args)
    od = kda_triton.kda_recurrent_slots_fwd(*direct)
    real = inp.real_slots.cuda()            # (the trash slot's winner among its rows may differ)
    # bit for bit (NaN-poisoned rows too)
    assert same_bits(o[:case.real], od[:case.real])
    assert same_bits(args[5][real], direct[5][real]) and same_bits(args[8][real], direct[8][real])


@pytest.mark.gpu
def test_gpu_fallback_for_small_heads():
    """dk = dv = 8 is not the kernel's: the op falls back to its torch body, still correct."""
    case = SlotsCase(4, 3, dk=8, dv=8)
    inp = make_inputs(case, 0, "cuda")
    assert kda_ref.kda_recurrent_slots_unsupported(inp.args[0], inp.args[2], inp.args[5], inp.args[8], True)
    run_and_check(case, 0, "cuda", torch.ops.k3trt.kda_recurrent_slots, _oracle_on_cpu, dict(dtype=F32))


def _oracle_on_cpu(*args):
    """_oracle on CPU copies, results written back to the device tensors."""
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    o = _oracle(*cpu)
    args[5].copy_(cpu[5])
    args[8].copy_(cpu[8])
    return o.to(args[0].device)


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.gpu
def test_gpu_graph_capture_and_replay(save):
    """Capture the op (under inference_mode, as runtime/graphs.py does), copy a second step's
    inputs into the static buffers, replay: equal to running that step eagerly, bit for bit."""
    case = SlotsCase(16, 4 if save else 1, H=96, dk=128, dv=128, save=save, dtype=torch.bfloat16)
    static = make_inputs(case, 10, "cuda").args
    nxt = make_inputs(case, 11, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        torch.ops.k3trt.kda_recurrent_slots(*static)         # compiles the kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        o_static = torch.ops.k3trt.kda_recurrent_slots(*static)

    for dst, src in zip(static[:9], nxt.args[:9]):
        dst.copy_(src)                # q, k, v are views of one buffer each: copy_ writes through them
    before = (static[5].clone(), static[8].clone())
    eager = clone_caches(nxt.args)
    o_eager = torch.ops.k3trt.kda_recurrent_slots(*eager)
    graph.replay()
    torch.cuda.synchronize()
    R, real = case.real, nxt.real_slots.cuda()
    assert torch.equal(o_static[:R], o_eager[:R]), "replay != eager (o)"
    assert torch.equal(static[5][real], eager[5][real]), "replay != eager (final states)"
    if save:
        assert torch.equal(static[8][real, :case.n], eager[8][real, :case.n]), "replay != eager (step states)"
    check_against(o_static, static, o_eager, eager, before, nxt, case, KERNEL_TOL)
