"""k3trt::short_conv_slots and k3trt::kda_prep: the KDA layer's front (conv over cache slots; q/k
norm, decay, beta) as two ops, and their Triton kernels.

CPU (CI): the ops' torch bodies against independent oracles (``k3trt::short_conv`` row by row with
explicit gathers; the spec's q/k norm, decay and beta written out again); opcheck; argument errors;
the Triton kernels under Triton's interpreter (a subprocess with TRITON_INTERPRET=1, which must be
set before triton is imported) against the torch bodies. The interpreter's fp32 -> bf16 casts may be
inexact (see test_cache_write_triton.py), so there the inputs are bf16-exact and fp32 caches differ
from bf16 values only below half an ulp: every cache value compares bit for bit, only bf16 y
loosely; rounding of arbitrary values is checked on the GPU.
GPU (``-m gpu``, on the H200): K3 sizes (96 heads of 128) in bf16 against the torch bodies, the
fallback, and capture / replay of both ops in a CUDA graph with new inputs.

Every conv case fills the caches with traps: fresh rows' slots and every slot no row owns hold NaN
(unowned ones must keep their bits), step_conv is NaN wherever the call must not write, and with
B >= 2 padding rows (fresh) share a trash slot whose contents are don't-care.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interp import run_interpreted

from k3trt.plugins import kda_front as front
from k3trt.plugins import kda_front_ref as front_ref
from k3trt.testing import assert_close, same_bits

F32, BF16 = torch.float32, torch.bfloat16
K = 4
# kernel vs torch body in fp32: only exp / division rounding and the order of the D-long sums differ
KERNEL_TOL = dict(dtype=F32, atol=1e-5, rtol=1e-5, rel_norm=1e-6)
# on the GPU tl.exp / tl.rsqrt are the hardware approximations (a few ulp)
GPU_TOL = dict(KERNEL_TOL, rel_norm=1e-5)


# ----------------------------------------------------------------------------- conv cases
@dataclass(frozen=True)
class ConvCase:
    B: int                            # rows, padding included
    n: int                            # positions per row
    H: int = 2
    D: int = 16
    save: bool = True
    fresh: str = "some"               # which real rows start fresh: none | some | all
    dtype: torch.dtype = F32          # of x and weight
    cache_dtype: torch.dtype = F32    # of conv_cache and step_conv
    exact: bool = True                # values whose bf16 casts the interpreter gets right (module doc)

    @property
    def C(self) -> int:
        return 3 * self.H * self.D

    @property
    def padding(self) -> int:
        """Trailing padding rows (fresh, all on one trash slot): 0 for B = 1, 2 for B = 5."""
        return (self.B + 1) // 3

    @property
    def real(self) -> int:
        return self.B - self.padding

    def __str__(self) -> str:
        name = lambda d: str(d).split(".")[-1]  # noqa: E731
        return (f"B{self.B}-n{self.n}-C{self.C}-{'save' if self.save else 'nosave'}-fresh_{self.fresh}-"
                f"{name(self.dtype)}-cache_{name(self.cache_dtype)}{'' if self.exact else '-inexact'}")


@dataclass
class ConvInputs:
    args: tuple                       # the op's arguments, in order
    real_slots: torch.Tensor          # slots of the real rows (distinct)
    untouched: torch.Tensor           # slots no row owns: must keep their bits


def make_conv_inputs(case: ConvCase, seed: int = 0, device: str | torch.device = "cpu") -> ConvInputs:
    """x a row-strided view of a wider buffer. case.exact: values the interpreter casts right (module
    doc); else arbitrary ones, which round where the torch body's casts do (through x's dtype)."""
    gen = torch.Generator().manual_seed(seed)
    B, n, C = case.B, case.n, case.C
    draw = (lambda t, dt: t.to(BF16).to(dt)) if case.exact else (lambda t, dt: t.to(dt))  # noqa: E731
    x = draw(torch.randn(B, n, C + 8, generator=gen), case.dtype).to(device)[..., :C]
    weight = draw(torch.randn(C, 1, K, generator=gen) * 0.5, case.dtype)

    num_slots = B + 3
    perm = torch.randperm(num_slots, generator=gen)
    real, trash, untouched = perm[:case.real], perm[-1], perm[case.real:-1]
    slots = torch.cat([real, trash.repeat(case.padding)])
    fresh = torch.zeros(B, dtype=torch.bool)
    fresh[case.real:] = True
    fresh[:case.real] = {"none": False, "all": True}.get(case.fresh, torch.arange(case.real) % 2 == 0)
    cache = draw(torch.randn(num_slots, C, K - 1, generator=gen), case.cache_dtype)
    if case.exact and case.cache_dtype == F32:
        # low bits under half a bf16 ulp, which round-to-nearest and the interpreter's truncation
        # both drop: the window's cast through bf16 x shows even interpreted
        low = torch.randint(1, 0x8000, cache.shape, generator=gen, dtype=torch.int32)
        cache.view(torch.int32).bitwise_or_(low)
    cache[slots[fresh]] = float("nan")        # a fresh row must not read its slot
    cache[untouched] = float("nan")           # unowned: kept bit for bit
    cache[untouched[-1]] = 3.0
    step = torch.full((num_slots, n + 1, C, K - 1), float("nan"), dtype=case.cache_dtype, device=device) \
        if case.save else torch.empty(0, dtype=case.cache_dtype, device=device)
    to = lambda t: t.to(device)  # noqa: E731
    return ConvInputs((x, to(weight), to(cache), to(slots), to(fresh), step, case.save), real, untouched)


def clone_caches(args: tuple) -> tuple:
    """args with fresh copies of the two mutated caches (positions 2 and 5)."""
    a = list(args)
    a[2], a[5] = a[2].clone(), a[5].clone()
    return tuple(a)


def check_conv(y, args, ref_y, ref_args, before, inp: ConvInputs, case: ConvCase, tol: dict) -> None:
    """y and the mutated caches in `args` against a reference run; `before`: the caches before
    either run. Real rows' y within `tol`, every cache value bit for bit."""
    R, n = case.real, case.n
    cache, step, ref_cache, ref_step = args[2], args[5], ref_args[2], ref_args[5]
    real, untouched = inp.real_slots.to(cache.device), inp.untouched.to(cache.device)
    assert y.shape == (case.B, n, case.C) and y.dtype == case.dtype and y.is_contiguous()
    assert_close(y[:R], ref_y[:R], name="y (real rows)", **tol)
    assert torch.isfinite(y[R:]).all(), "padding rows start fresh: their outputs are finite"
    assert same_bits(cache[real], ref_cache[real]), "final window of the real slots"
    assert same_bits(cache[untouched], before[0][untouched]), "a slot no row owns was written"
    if case.save:
        assert same_bits(step[real, :n], ref_step[real, :n]), "window after each position"
        assert same_bits(step[real, n:], before[1][real, n:]), "step windows past n were written"
        assert same_bits(step[untouched], before[1][untouched]), "step windows of an unowned slot"
    else:
        assert step.numel() == 0


def run_conv(case: ConvCase, seed: int, device, kernel, reference, tol: dict) -> None:
    inp = make_conv_inputs(case, seed, device)
    before = (inp.args[2].clone(), inp.args[5].clone())
    args, ref_args = clone_caches(inp.args), clone_caches(inp.args)
    y = kernel(*args)
    ref_y = reference(*ref_args)
    check_conv(y, args, ref_y, ref_args, before, inp, case, tol)


def conv_oracle(x, weight, cache, slots, fresh, step, save):
    """``k3trt::short_conv`` row by row, with explicit gathers and scatters."""
    ys, width = [], weight.shape[-1]
    for b in range(x.shape[0]):
        s = int(slots[b])
        window = torch.zeros(x.shape[-1], width - 1, dtype=x.dtype) if fresh[b] else cache[s].to(x.dtype)
        y, new, every = torch.ops.k3trt.short_conv(x[b], weight, window, save)
        cache[s] = new.to(cache.dtype)
        if save:
            step[s, :x.shape[1]] = every.to(step.dtype)
        ys.append(y)
    return torch.stack(ys)


# ----------------------------------------------------------------------------- prep cases
@dataclass(frozen=True)
class PrepCase:
    T: int
    H: int = 2
    D: int = 16
    lower_bound: float | None = -5.0
    dtype: torch.dtype = F32

    def __str__(self) -> str:
        return f"T{self.T}-H{self.H}-D{self.D}-lb{self.lower_bound}-{str(self.dtype).split('.')[-1]}"


def make_prep_inputs(case: PrepCase, seed: int = 0, device: str | torch.device = "cpu") -> tuple:
    """(y, f, b, dt_bias, A_log, H, D, lower_bound): y, f and b strided column slices (as packed
    projections are); gate inputs spanning softplus's threshold and its tiny tail."""
    gen = torch.Generator().manual_seed(seed)
    T, H, D = case.T, case.H, case.D
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    y = r(T, 3 * H * D + 8)[:, 8:]
    f = r(T, H * D + 4) * 4
    f.view(-1)[:5] = torch.tensor([40.0, -40.0, 21.0, -90.0, 19.0])
    f = f[:, :H * D]
    b = (r(T, H + 1) * 3)[:, 1:]
    dt_bias, A_log = r(H * D), r(H) * 0.5
    to = lambda t: t.to(case.dtype).to(device)  # noqa: E731
    return to(y), to(f), to(b), dt_bias.to(device), A_log.to(device), H, D, case.lower_bound


def prep_oracle(y, f, b, dt_bias, A_log, H, D, lower_bound):
    """The spec's math written out again (spec/K3_MODEL.md, KDA), in fp32: q, k L2-normalised with
    eps 1e-6 under the root, v as is, g = lower_bound·sigmoid(e^A_log·(f + dt_bias)) (without a
    bound -e^A_log·softplus(f + dt_bias)), beta = sigmoid(b)."""
    q, k, v = y.float().reshape(-1, 3, H, D).unbind(1)
    norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    raw = f.float().reshape(-1, H, D) + dt_bias.float().reshape(H, D)
    a = A_log.float().exp().reshape(H, 1)
    g = lower_bound * torch.sigmoid(a * raw) if lower_bound is not None else -a * torch.nn.functional.softplus(raw)
    return norm(q), norm(k), v, g, torch.sigmoid(b.float())


def check_prep(out, ref, case: PrepCase, tol: dict) -> None:
    T, H, D = case.T, case.H, case.D
    for name, o, r, shape in zip("q k v g beta".split(), out, ref, [(T, H, D)] * 4 + [(T, H)]):
        assert o.shape == shape and o.dtype == F32 and o.is_contiguous(), f"{name}: {o.shape} {o.dtype}"
        assert_close(o, r, name=name, **tol)


# ----------------------------------------------------------------------------- CPU: torch bodies vs oracles
DTYPES = ((F32, F32), (BF16, BF16), (BF16, F32))     # (x, caches)
CPU_CONV_CASES = [ConvCase(B, n, save=save, fresh=fr, dtype=dt, cache_dtype=cdt)
                  for B, n, save, fr, (dt, cdt) in itertools.product((1, 5), (1, 4), (True, False),
                                                                     ("none", "some", "all"), DTYPES)]
CPU_CONV_CASES += [ConvCase(3, n, dtype=dt, cache_dtype=cdt, exact=False) for n, (dt, cdt) in
                   itertools.product((1, 4), ((BF16, F32), (F32, BF16)))]


@pytest.mark.parametrize("case", CPU_CONV_CASES, ids=str)
def test_conv_op_matches_oracle(case):
    run_conv(case, case.B + case.n, "cpu", torch.ops.k3trt.short_conv_slots, conv_oracle, dict(dtype=F32))


def test_conv_no_save_leaves_a_given_step_cache_alone():
    inp = make_conv_inputs(ConvCase(4, 3))
    args = list(clone_caches(inp.args))
    args[-1] = False
    before = args[5].clone()
    torch.ops.k3trt.short_conv_slots(*args)
    assert same_bits(args[5], before)


def test_conv_reference_raises_on_a_slot_outside_the_cache():
    args = list(clone_caches(make_conv_inputs(ConvCase(2, 1)).args))
    for bad in (torch.tensor([0, 5]), torch.tensor([-1, 0])):
        args[3] = bad
        with pytest.raises(IndexError, match=r"slots must lie in \[0, 5\)"):
            torch.ops.k3trt.short_conv_slots(*args)


@pytest.mark.parametrize("pos,bad,match", [
    (0, lambda a: a[0][0], "x must be"),
    (1, lambda a: a[1].view(-1, K), "weight must be"),
    (2, lambda a: a[2][:, :, :2], "conv_cache must be"),
    (3, lambda a: a[3].float(), "slots must be int64"),
    (4, lambda a: a[4].int(), "fresh must be bool"),
    (5, lambda a: a[5][:, :3], "step_conv"),
])
def test_conv_errors_name_the_argument(pos, bad, match):
    args = list(clone_caches(make_conv_inputs(ConvCase(2, 4)).args))
    args[pos] = bad(args)
    with pytest.raises(ValueError, match=match):
        torch.ops.k3trt.short_conv_slots(*args)


def test_conv_opcheck():
    """Schema (the two mutated caches), fake implementation and tracing agree with the real op."""
    inp = make_conv_inputs(ConvCase(2, 3, dtype=BF16, cache_dtype=BF16))
    args = list(clone_caches(inp.args))
    args[2], args[5] = torch.nan_to_num(args[2]), torch.zeros_like(args[5])   # opcheck compares runs
    torch.library.opcheck(front.short_conv_slots, tuple(args))


PREP_CASES = [PrepCase(T, H, D, lb, dt) for T, (H, D), lb, dt in
              itertools.product((1, 6), ((2, 16), (3, 32)), (None, -5.0), (F32, BF16))]


@pytest.mark.parametrize("case", PREP_CASES, ids=str)
def test_prep_op_matches_model_code(case):
    args = make_prep_inputs(case, case.T)
    check_prep(torch.ops.k3trt.kda_prep(*args), prep_oracle(*args), case, dict(dtype=F32))


@pytest.mark.parametrize("pos,bad,match", [
    (0, lambda a: a[0][:, 1:], "y has shape"),
    (1, lambda a: a[1][:1], "f has shape"),
    (2, lambda a: a[2].int(), "b must be floating"),
    (3, lambda a: a[3][:-1], "dt_bias has shape"),
    (4, lambda a: a[4].view(1, -1), "A_log has shape"),
    (5, lambda a: 0, "num_heads and head_dim"),
])
def test_prep_errors_name_the_argument(pos, bad, match):
    args = list(make_prep_inputs(PrepCase(3)))
    args[pos] = bad(args)
    with pytest.raises(ValueError, match=match):
        torch.ops.k3trt.kda_prep(*args)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_prep_opcheck(lower_bound):
    torch.library.opcheck(front.kda_prep, make_prep_inputs(PrepCase(3, lower_bound=lower_bound, dtype=BF16)))


def test_fake_shapes():
    conv = make_conv_inputs(ConvCase(3, 4)).args
    prep = make_prep_inputs(PrepCase(5, 3, 32))
    with FakeTensorMode() as mode:
        fake = lambda args: [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]  # noqa: E731
        y = torch.ops.k3trt.short_conv_slots(*fake(conv))
        assert y.shape == (3, 4, 96) and y.dtype == F32
        out = torch.ops.k3trt.kda_prep(*fake(prep))
        assert [tuple(o.shape) for o in out] == [(5, 3, 32)] * 4 + [(5, 3)]
        assert all(o.dtype == F32 for o in out)


def test_cuda_kernels_are_registered_without_importing_triton():
    code = ("import sys, torch, k3trt.plugins.kda_front\n"
            "for op in ('short_conv_slots', 'kda_prep'):\n"
            "    assert torch._C._dispatch_has_kernel_for_dispatch_key('k3trt::' + op, 'CUDA'), op\n"
            "assert 'triton' not in sys.modules, 'importing kda_front imported triton'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- CPU: the kernels, interpreted
# C = 96 with 64-channel blocks: the second block is partial
INTERPRETER_CONV_CASES = [ConvCase(B, n, save=save, fresh=fr, dtype=dt, cache_dtype=cdt)
                          for save, fr, n, B, (dt, cdt) in itertools.product(
                              (True, False), ("none", "some", "all"), (1, 4), (1, 3), DTYPES)]
INTERPRETER_PREP_CASES = [(PrepCase(T, H, D, lb, dt), bh) for T, (H, D, bh), lb, dt in itertools.product(
    (1, 5), ((2, 16, 1), (3, 32, 2)), (None, -5.0), (F32, BF16))]


def interpreter_main() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: kda_front_triton's launchers on CPU tensors
    against the torch bodies."""
    from k3trt.plugins import kda_front_triton as kt  # noqa: PLC0415 (optional: triton)
    for case in INTERPRETER_CONV_CASES:
        tol = KERNEL_TOL if case.dtype == F32 else dict(dtype=BF16)
        try:
            run_conv(case, case.B * case.n, "cpu", lambda *a: kt.short_conv_slots_fwd(*a, block_c=64),
                     front.short_conv_slots_reference, tol)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {e}") from e
    for case, bh in INTERPRETER_PREP_CASES:
        args = make_prep_inputs(case, case.T)
        try:
            check_prep(kt.kda_prep_fwd(*args, block_h=bh), front.kda_prep_reference(*args), case, KERNEL_TOL)
        except AssertionError as e:
            raise AssertionError(f"case {case} BH={bh}: {e}") from e

    # a slot outside the cache is neither read nor written (the torch body raises): the caches are
    # the first 5 slots of larger buffers, whose rest must keep its bits; the row runs from zeros
    inp = make_conv_inputs(ConvCase(2, 2), 0)
    args = list(clone_caches(inp.args))
    backing = [torch.randn(200, *args[i].shape[1:]) for i in (2, 5)]
    for j, i in enumerate((2, 5)):
        backing[j][:5] = args[i]
        args[i] = backing[j][:5]
    args[3], args[4] = torch.tensor([1, 100]), torch.tensor([False, False])
    before = [b.clone() for b in backing]
    y = kt.short_conv_slots_fwd(*args)
    keep = torch.arange(200) != 1
    assert same_bits(backing[0][keep], before[0][keep]), "out-of-range slot: conv_cache written"
    assert same_bits(backing[1][keep], before[1][keep]), "out-of-range slot: step_conv written"
    zero = list(clone_caches(inp.args))
    zero[3], zero[4] = torch.tensor([1, 0]), torch.tensor([False, True])
    assert_close(y[1], front.short_conv_slots_reference(*zero)[1], name="out-of-range slot: y", **KERNEL_TOL)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    """The kernels' own code on the CPU: channel / head blocks and their partial tails, strides,
    masks of fresh / unowned / out-of-range slots, per-position stores, both gate forms."""
    run_interpreted("test_kda_front")


# ----------------------------------------------------------------------------- GPU
K3 = dict(H=96, D=128)
GPU_CONV_CASES = [ConvCase(B, n, **K3, save=save, fresh="some", dtype=BF16, cache_dtype=BF16)
                  for B, n, save in itertools.product((1, 3, 32, 128), (1, 4), (True, False))]
GPU_CONV_CASES += [ConvCase(5, 4, **K3, fresh=fr, dtype=dt, cache_dtype=cdt)
                   for fr, (dt, cdt) in itertools.product(("none", "all"), DTYPES)]
# rounding on GPU: fp32 windows through bf16 x (n = 1 keeps old window values), fp32 x into a bf16 cache
GPU_CONV_CASES += [ConvCase(5, n, **K3, dtype=dt, cache_dtype=cdt, exact=False)
                   for n, (dt, cdt) in itertools.product((1, 4), ((BF16, F32), (F32, BF16)))]
GPU_PREP_CASES = [PrepCase(T, **K3, lower_bound=lb, dtype=dt)
                  for T, lb, dt in itertools.product((1, 4, 128, 512), (None, -5.0), (BF16, F32))]


@pytest.mark.parametrize("case", GPU_CONV_CASES, ids=str)
@pytest.mark.gpu
def test_gpu_conv_op_matches_torch_body(case):
    """Through the op (so the registered kernel, with no fallback at K3 sizes)."""
    a = make_conv_inputs(case, 0, "cuda").args
    assert front_ref.short_conv_slots_unsupported(a[0], a[1], a[2], a[5], case.save) is None
    tol = GPU_TOL if case.dtype == F32 else dict(dtype=BF16)
    run_conv(case, case.B + case.n, "cuda", torch.ops.k3trt.short_conv_slots, front.short_conv_slots_reference, tol)


@pytest.mark.parametrize("case", GPU_PREP_CASES, ids=str)
@pytest.mark.gpu
def test_gpu_prep_op_matches_torch_body(case):
    args = make_prep_inputs(case, case.T, "cuda")
    assert front_ref.kda_prep_unsupported(*args[:5], case.D) is None
    check_prep(torch.ops.k3trt.kda_prep(*args), front.kda_prep_reference(*args), case, GPU_TOL)


@pytest.mark.gpu
def test_gpu_conv_fallback_for_another_kernel_size(caplog):
    """K = 3 is not the kernel's: the op falls back to its torch body (one warning), still correct."""
    inp = make_conv_inputs(ConvCase(4, 3), 0, "cuda")
    args = list(clone_caches(inp.args))
    args[1], args[2], args[5] = args[1][..., :3], args[2][..., :2].contiguous(), args[5][..., :2].contiguous()
    ref = clone_caches(args)
    assert front_ref.short_conv_slots_unsupported(args[0], args[1], args[2], args[5], True)
    y = torch.ops.k3trt.short_conv_slots(*args)
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in ref]
    real = inp.real_slots
    assert_close(y[:3].cpu(), conv_oracle(*cpu)[:3], dtype=F32)
    assert same_bits(args[2].cpu()[real], cpu[2][real]) and same_bits(args[5].cpu()[real], cpu[5][real])
    assert "does not cover conv kernel size 3" in caplog.text


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.gpu
def test_gpu_graph_capture_and_replay(save):
    """Capture conv then prep (under inference_mode, as runtime/graphs.py does), copy a second
    step's inputs into the static buffers, replay: equal to that step run eagerly, bit for bit."""
    n = 4 if save else 1
    case = ConvCase(16, n, **K3, save=save, dtype=BF16, cache_dtype=BF16)
    pcase = PrepCase(16 * n, **K3, dtype=BF16)

    def step(conv_args, prep_args):
        y = torch.ops.k3trt.short_conv_slots(*conv_args)
        return y, torch.ops.k3trt.kda_prep(y.view(y.shape[0] * y.shape[1], -1), *prep_args[1:])

    static, pstatic = make_conv_inputs(case, 10, "cuda").args, make_prep_inputs(pcase, 10, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        step(static, pstatic)                               # compiles the kernels before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        y_static, out_static = step(static, pstatic)

    nxt, pnxt = make_conv_inputs(case, 11, "cuda"), make_prep_inputs(pcase, 11, "cuda")
    for dst, src in zip(static[:6] + pstatic[1:5], nxt.args[:6] + pnxt[1:5]):
        dst.copy_(src)                # strided views: copy_ writes through them
    before = (static[2].clone(), static[5].clone())
    eager = clone_caches(nxt.args)
    y_eager, out_eager = step(eager, pnxt)
    graph.replay()
    torch.cuda.synchronize()
    R, real = case.real, nxt.real_slots.cuda()
    assert torch.equal(y_static[:R], y_eager[:R]), "replay != eager (y)"
    assert same_bits(static[2][real], eager[2][real]), "replay != eager (conv_cache)"
    rows = R * n                                            # the real rows' tokens come first
    for name, o, e in zip("q k v g beta".split(), out_static, out_eager):
        assert torch.equal(o[:rows], e[:rows]), f"replay != eager ({name})"
    ref = clone_caches(nxt.args)
    check_conv(y_static, static, front.short_conv_slots_reference(*ref), ref, before, nxt, case, dict(dtype=BF16))
