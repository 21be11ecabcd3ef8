"""k3trt::attn_res: the fused AttnRes read (op in plugins/attn_res.py, kernel in attn_res_triton.py).

CPU (CI): the op (its torch body) against ``attn_res_reference`` and the model's own
``k3trt.model.attn_res.attn_res`` (the spec until the model calls the op), alone and chained as
DecoderLayer.forward_attn_res chains it; opcheck; validation; the Triton kernel under Triton's
interpreter (a subprocess with TRITON_INTERPRET=1). The interpreter casts fp32 -> bf16 by
truncation, not round-to-nearest-even, so its bf16 cases are held to 1 ulp of ``cast_oracle`` (the
reference's math with truncating casts; with ``Tensor.to`` it is the reference, bit for bit): that
checks the kernel rounds where the reference rounds. Its fp32 cases differ from the torch body only
in the order of the sums.
GPU (``-m gpu``, on the H200): K3 rows (H = 7168) through the op, large source counts, the fallback,
and capture / replay in a CUDA graph.

Every case poisons blocks: it is a strided view into a NaN-filled buffer, the write slot holds NaN
before the call (written, never read), and every slot past num_blocks is NaN (never read, never
written). All of it must keep its bits, and no NaN may reach the outputs.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_interp import run_interpreted

from k3trt.model import k3
from k3trt.model.attn_res import attn_res as model_attn_res
from k3trt.plugins import attn_res as ops
from k3trt.plugins import attn_res_ref, dispatch
from k3trt.plugins.attn_res import attn_res_reference
from k3trt.testing import assert_close, bits

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS = 1e-6
TIGHT = dict(dtype=F32)                                            # fp32: only the sums' order differs
BF16_TOL = dict(dtype=BF16)                                        # ~1 bf16 ulp on O(1) values
F16_TOL = dict(dtype=F16, atol=4e-3, rtol=4e-3)                    # ~1 fp16 ulp on O(1) values
ONE_BF16_ULP = dict(dtype=BF16, atol=1e-6, rtol=2 ** -7, rel_norm=4e-3)  # vs the truncating oracle


# ----------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class ResCase:
    T: int
    H: int
    num_blocks: int
    write_idx: int = -1          # -1: no write
    delta: bool = True
    out_norm: bool = True
    dtype: torch.dtype = F32

    @property
    def NB(self) -> int:
        """blocks' slots: two past the last one the call touches, so some are never touched."""
        return max(self.num_blocks, self.write_idx) + 2

    def __str__(self) -> str:
        return (f"T{self.T}-H{self.H}-nb{self.num_blocks}-w{self.write_idx}-{'d' if self.delta else 'nod'}-"
                f"{'norm' if self.out_norm else 'nonorm'}-{str(self.dtype).split('.')[-1]}")


@dataclass
class ResInputs:
    args: tuple                  # the op's arguments, in order
    backing: torch.Tensor        # the NaN-filled buffer blocks is a view of


def blocks_view(backing: torch.Tensor, case: ResCase) -> torch.Tensor:
    """blocks [T, NB, H]: a view into backing [T + 1, NB + 1, H + 2] (strides of neither)."""
    return backing[:case.T, :case.NB, 1:case.H + 1]


def make_inputs(case: ResCase, seed: int = 0, device: str | torch.device = "cpu") -> ResInputs:
    """The op's arguments: prefix a column slice of a wider buffer, real blocks at growing scales,
    NaN everywhere in blocks the call must not read, O(1) logits (so the softmax is not flat)."""
    gen = torch.Generator().manual_seed(seed)
    T, H, nb, dt = case.T, case.H, case.num_blocks, case.dtype
    dev = lambda x: x.to(device=device, dtype=dt)  # noqa: E731  (move whole buffers, then slice)
    prefix = dev(torch.randn(T, H + 6, generator=gen))[:, 3:H + 3]
    delta = dev(torch.randn(T, H, generator=gen) * 0.5) if case.delta else None
    backing = dev(torch.full((T + 1, case.NB + 1, H + 2), float("nan")))
    blocks = blocks_view(backing, case)
    scales = torch.arange(1, nb + 1, dtype=F32)[None, :, None]
    blocks[:, :nb] = dev(torch.randn(T, nb, H, generator=gen) * scales)
    if case.write_idx >= 0:
        blocks[:, case.write_idx] = float("nan")                 # written before it is read
    w_norm = dev(1 + 0.1 * torch.randn(H, generator=gen))
    w_q = dev(torch.randn(1, H, generator=gen) * 2 / H ** 0.5)
    out_norm = dev(1 + 0.1 * torch.randn(H, generator=gen)) if case.out_norm else None
    return ResInputs((prefix, delta, blocks, w_norm, w_q, out_norm, nb, case.write_idx, EPS), backing)


def with_blocks(args: tuple, blocks: torch.Tensor) -> tuple:
    return args[:2] + (blocks,) + args[3:]


def truncate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype), except that fp32 -> bf16 drops the low 16 bits (as Triton's interpreter casts)."""
    if dtype != BF16:
        return x.to(dtype)
    return (x.float().contiguous().view(torch.int32) & -65536).view(F32).to(BF16)


def cast_oracle(prefix, delta, blocks, w_norm, w_q, out_norm, num_blocks, write_idx, eps, cast=truncate):
    """attn_res_reference's math with every rounding to the model dtype done by cast(x, dtype)."""
    dt = prefix.dtype

    def norm(x, w):
        xf = x.float()
        return cast(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float(), dt)

    prefix = cast(prefix.float() + delta.float(), dt) if delta is not None else prefix.clone()
    if write_idx >= 0:
        blocks[:, write_idx] = prefix
    sources = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1)
    alpha = (norm(sources, w_norm).float() * w_q.float()[0]).sum(-1).softmax(-1)
    mixed = cast((alpha[..., None] * sources.float()).sum(1), dt)
    return (norm(mixed, out_norm) if out_norm is not None else mixed), prefix


def run_and_check(case: ResCase, seed: int, device, fn, tol: dict, exact_prefix: bool = True,
                  reference=attn_res_reference) -> None:
    """fn(*args) against `reference` on a copy of the same inputs: outputs within `tol`
    (new_prefix bit for bit when `exact_prefix`), blocks' backing buffer bit for bit."""
    inp = make_inputs(case, seed, device)
    before = inp.backing.clone()
    ref_backing = inp.backing.clone()
    want_out, want_prefix = reference(*with_blocks(inp.args, blocks_view(ref_backing, case)))
    out, new_prefix = fn(*inp.args)
    shape = (case.T, case.H)
    for name, t in (("out", out), ("new_prefix", new_prefix)):
        assert t.shape == shape and t.dtype == case.dtype, f"{name}: {t.dtype} {tuple(t.shape)}"
        assert not t.isnan().any(), f"{name}: NaN (a poisoned slot was read)"
    assert out.data_ptr() != new_prefix.data_ptr() and new_prefix.data_ptr() != inp.args[0].data_ptr()
    if exact_prefix:
        assert torch.equal(bits(new_prefix), bits(want_prefix)), "new_prefix differs"
    else:
        assert_close(new_prefix, want_prefix, name="new_prefix", **tol)
    assert_close(out, want_out, name="out", **tol)
    expected = before.clone()
    if case.write_idx >= 0:
        blocks_view(expected, case)[:, case.write_idx] = new_prefix
    changed = (bits(inp.backing) != bits(expected)).nonzero()
    assert not len(changed), f"blocks' buffer: {len(changed)} elements changed, first at {changed[0].tolist()}"


# ----------------------------------------------------------------------------- CPU: the op
# the brief's Cartesian product: delta, write, out_norm, num_blocks, H, T, dtype
PRODUCT = [ResCase(T, H, nb, nb if write else -1, d, norm, dt)
           for d, write, norm, nb, H, T, dt in itertools.product(
               (False, True), (False, True), (False, True), (0, 1, 3), (64, 200), (1, 5), (F32, BF16))]
# the write slot among the sources (read back as the new prefix), and past them; a 9-source tile
CORNERS = [ResCase(3, 64, 3, 1), ResCase(3, 64, 1, 3, delta=False), ResCase(2, 64, 9, 4, dtype=BF16),
           ResCase(4, 200, 3, 0, out_norm=False, dtype=BF16)]


@pytest.mark.parametrize("case", PRODUCT[::5] + CORNERS + [ResCase(3, 64, 2, 2, dtype=F16)], ids=str)
def test_op_is_the_reference_and_the_model_math(case):
    """On the CPU the op runs its torch body: equal, bit for bit, to the reference and to the model's
    attn_res (which may return prefix itself; the op returns a copy)."""
    run_and_check(case, 1, "cpu", torch.ops.k3trt.attn_res, TIGHT)
    inp = make_inputs(case, 2)
    model_backing = inp.backing.clone()
    want = model_attn_res(*with_blocks(inp.args, blocks_view(model_backing, case)))
    got = torch.ops.k3trt.attn_res(*inp.args)
    for g, w in zip(got, want):
        assert torch.equal(bits(g), bits(w))
    assert torch.equal(bits(inp.backing), bits(model_backing))


@pytest.mark.parametrize("case", CORNERS + PRODUCT[::17], ids=str)
def test_cast_oracle_with_tensor_to_is_the_reference(case):
    """Anchors the interpreter's oracle: with Tensor.to as the cast it is the reference, bit for bit."""
    a, b = make_inputs(case, 3), make_inputs(case, 3)
    got = cast_oracle(*a.args, cast=lambda x, dt: x.to(dt))
    want = attn_res_reference(*b.args)
    for g, w in zip(got, want):
        assert torch.equal(bits(g), bits(w))
    assert torch.equal(bits(a.backing), bits(b.backing))


def _fake_layer(idx: int, block_size: int, H: int, dtype: torch.dtype, gen: torch.Generator) -> SimpleNamespace:
    """What DecoderLayer.forward_attn_res reads from self: cfg, idx, six weights, mixer and mlp
    (stand-ins: tanh of a random projection)."""
    norm = lambda: SimpleNamespace(weight=(1 + 0.1 * torch.randn(H, generator=gen)).to(dtype))  # noqa: E731
    proj = lambda: SimpleNamespace(weight=(torch.randn(1, H, generator=gen) * 2 / H ** 0.5).to(dtype))  # noqa: E731
    w_mix, w_mlp = (torch.randn(H, H, generator=gen) / H ** 0.5 for _ in range(2))
    return SimpleNamespace(
        cfg=SimpleNamespace(attn_res_block_size=block_size, rms_norm_eps=EPS), idx=idx,
        self_attention_res_norm=norm(), self_attention_res_proj=proj(), input_layernorm=norm(),
        mlp_res_norm=norm(), mlp_res_proj=proj(), post_attention_layernorm=norm(),
        mixer=lambda x, ctx, cache: torch.tanh(x.float() @ w_mix).to(x.dtype),
        mlp=lambda y: torch.tanh(y.float() @ w_mlp).to(y.dtype))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_chained_like_the_model(monkeypatch, dtype):
    """DecoderLayer.forward_attn_res over 7 layers (block size 3: writes at layers 0, 3, 6), then the
    model's exit read, with k3.py's attn_res swapped for the op: equal, bit for bit, to the original."""
    T, H, L, B = 4, 64, 7, 3
    NB = -(-L // B)
    gen = torch.Generator().manual_seed(0)
    layers = [_fake_layer(i, B, H, dtype, gen) for i in range(L)]
    exit_norm, exit_proj = layers[-1].mlp_res_norm.weight, layers[-1].mlp_res_proj.weight
    embed = torch.randn(T, H, generator=gen).to(dtype)

    def run(read):
        monkeypatch.setattr(k3, "attn_res", read)
        blocks = embed.new_zeros(T, NB, H)
        prefix, hidden = embed, None
        for layer in layers:
            prefix, hidden = k3.DecoderLayer.forward_attn_res(layer, prefix, hidden, blocks, None, None)
        out, _ = read(prefix, hidden, blocks, exit_norm, exit_proj, None, NB, -1, EPS)
        return out, blocks

    want_out, want_blocks = run(model_attn_res)
    got_out, got_blocks = run(torch.ops.k3trt.attn_res)
    assert torch.equal(bits(got_out), bits(want_out))
    assert torch.equal(bits(got_blocks), bits(want_blocks))
    assert not got_blocks.isnan().any() and got_blocks[:, -1].abs().sum() > 0   # every block written


def test_validation_names_the_problem():
    inp = make_inputs(ResCase(3, 64, 2, 2))
    prefix, delta, blocks, w_norm, w_q, out_norm = inp.args[:6]
    bad = [
        ("prefix", prefix[0], "prefix must be a float \\[T, H\\]"),
        ("delta", delta[:, :32], "delta must be"),
        ("blocks", blocks[:, :, :32], "blocks must be \\[T=3, NB, H=64\\]"),
        ("blocks", blocks.double(), "blocks dtype"),
        ("w_norm", w_norm[:32], "w_norm must be"),
        ("w_q", w_q[0], "w_q must be"),
        ("out_norm", out_norm[None], "out_norm must be"),
        ("num_blocks", blocks.shape[1] + 1, "num_blocks must be in \\[0, 4\\]"),
        ("num_blocks", -1, "num_blocks"),
        ("write_idx", blocks.shape[1], "write_idx must be -1 or in \\[0, 4\\)"),
        ("write_idx", -2, "write_idx"),
        ("eps", -1.0, "eps"),
    ]
    names = ("prefix", "delta", "blocks", "w_norm", "w_q", "out_norm", "num_blocks", "write_idx", "eps")
    for name, value, match in bad:
        args = dict(zip(names, inp.args)) | {name: value}
        with pytest.raises(ValueError, match=match):
            torch.ops.k3trt.attn_res(*args.values())


def test_opcheck():
    """Schema (blocks mutated, outputs new), fake implementation and tracing agree with the op."""
    for case in (ResCase(3, 64, 2, 2, dtype=BF16), ResCase(2, 64, 1, -1, delta=False, out_norm=False)):
        inp = make_inputs(case)
        blocks = torch.nan_to_num(inp.args[2])         # opcheck compares runs; NaN != NaN
        torch.library.opcheck(ops.attn_res, with_blocks(inp.args, blocks))


def test_fake_shapes():
    inp = make_inputs(ResCase(5, 64, 3, 3, dtype=BF16))
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inp.args]
        out, new_prefix = torch.ops.k3trt.attn_res(*args)
        assert out.shape == new_prefix.shape == (5, 64) and out.dtype == new_prefix.dtype == BF16


def test_cuda_kernel_is_registered_without_importing_triton():
    code = ("import sys, torch, k3trt.plugins.attn_res\n"
            "assert torch._C._dispatch_has_kernel_for_dispatch_key('k3trt::attn_res', 'CUDA')\n"
            "assert 'triton' not in sys.modules, 'importing k3trt.plugins.attn_res imported triton'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- CPU: the kernel, interpreted
def interpreter_main() -> None:
    """Runs in the TRITON_INTERPRET=1 subprocess: the launcher on CPU tensors against the torch body."""
    from k3trt.plugins import attn_res_triton  # noqa: PLC0415 (optional: triton)
    for case in PRODUCT + CORNERS:
        check = dict(tol=TIGHT) if case.dtype == F32 else dict(tol=ONE_BF16_ULP, reference=cast_oracle)
        # H = 200 in chunks of 128 (the last one 72 wide): the loops and the column masks
        bh = 128 if case.H == 200 else None
        try:
            run_and_check(case, case.T + case.H, "cpu", partial(attn_res_triton.attn_res_fwd, block_h=bh), **check)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {e}") from e


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_under_interpreter():
    """The kernel's own code on the CPU: the source tile and its masks, the write slot, the passes."""
    run_interpreted("test_attn_res_op")


# ----------------------------------------------------------------------------- GPU
K3_H = 7168
# (delta, out_norm, write): the model's three reads (layer entry at a block start, the MLP read
# after it, the exit read), an entry inside a block, and the write slot among the sources
PATTERNS = [(True, True, "next"), (False, True, "none"), (True, True, "none"), (True, False, "none"),
            (False, True, "inside")]


def _gpu_case(T: int, nb: int, dt: torch.dtype, pattern: tuple) -> ResCase:
    delta, norm, write = pattern
    w = {"next": nb, "none": -1, "inside": nb - 1}[write]
    return ResCase(T, K3_H, nb, w, delta, norm, dt)


GPU_CASES = [_gpu_case(T, nb, dt, pat)
             for T, nb, dt, pat in itertools.product((1, 8, 128, 512), (0, 2, 4), (BF16, F32), PATTERNS)
             if not (pat[2] == "inside" and nb == 0)]
GPU_CASES += [ResCase(8, K3_H, 4, 4, dtype=F16), ResCase(3, 1000, 2, -1, dtype=BF16)]
GPU_TOL = {F32: TIGHT, BF16: BF16_TOL, F16: F16_TOL}


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.gpu
def test_gpu_op_matches_reference(case):
    """Through the op (so through the registered CUDA kernel), rounding included."""
    a = make_inputs(case, 0, "cuda").args
    assert attn_res_ref.attn_res_unsupported(a[0], a[1], a[3], a[4], a[5], a[6]) is None
    run_and_check(case, case.T, "cuda", torch.ops.k3trt.attn_res, GPU_TOL[case.dtype])


@pytest.mark.parametrize("nb", [15, 29, 63])
@pytest.mark.gpu
def test_gpu_many_sources(nb):
    """The full model's ~30 sources (a 32-row tile) and the 64-source limit."""
    run_and_check(ResCase(4, K3_H, nb, -1, dtype=BF16), nb, "cuda", torch.ops.k3trt.attn_res, BF16_TOL)


@pytest.mark.gpu
def test_gpu_op_equals_direct_launch():
    """The op takes the kernel: bit for bit a direct launch."""
    from k3trt.plugins import attn_res_triton  # noqa: PLC0415 (optional: triton)
    case = ResCase(16, K3_H, 3, 3, dtype=BF16)
    a, b = make_inputs(case, 5, "cuda"), make_inputs(case, 5, "cuda")
    got = torch.ops.k3trt.attn_res(*a.args)
    direct = attn_res_triton.attn_res_fwd(*b.args)
    for g, d in zip(got, direct):
        assert torch.equal(bits(g), bits(d))
    assert torch.equal(bits(a.backing), bits(b.backing))


@pytest.mark.gpu
def test_gpu_fallback(caplog):
    """fp64 is not the kernel's: the op warns and runs its torch body, still correct."""
    case = ResCase(3, 256, 2, 2, dtype=torch.float64)
    dispatch.log_fallback.cache_clear()
    with caplog.at_level("WARNING", logger="k3trt"):
        run_and_check(case, 0, "cuda", torch.ops.k3trt.attn_res, dict(dtype=torch.float64))
    assert "does not cover" in caplog.text


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.gpu
def test_gpu_graph_capture_and_replay(dtype):
    """Capture the op (under inference_mode, as runtime/graphs.py does), copy a second step's inputs
    into the static buffers, replay: equal to running that step eagerly, bit for bit."""
    case = ResCase(32, K3_H, 3, 3, dtype=dtype)
    static, nxt = make_inputs(case, 10, "cuda"), make_inputs(case, 11, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        torch.ops.k3trt.attn_res(*static.args)               # compiles the kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        out, new_prefix = torch.ops.k3trt.attn_res(*static.args)

    for dst, src in zip(static.args[:6], nxt.args[:6]):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    static.backing.copy_(nxt.backing)
    eager = make_inputs(case, 11, "cuda")
    want_out, want_prefix = torch.ops.k3trt.attn_res(*eager.args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(want_out)), "replay != eager (out)"
    assert torch.equal(bits(new_prefix), bits(want_prefix)), "replay != eager (new_prefix)"
    assert torch.equal(bits(static.backing), bits(eager.backing)), "replay != eager (blocks)"
    ref_out, _ = attn_res_reference(*make_inputs(case, 11, "cuda").args)
    assert_close(out, ref_out, **GPU_TOL[dtype])
