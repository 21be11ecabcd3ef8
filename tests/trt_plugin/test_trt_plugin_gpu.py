"""The C++ plugin library's runtime half on a GPU, without TensorRT: every op through the harness
(creator -> build-phase queries -> serialized fields -> runtime plugin -> enqueue on torch CUDA
tensors) against its plain-torch reference on fresh random inputs, NaN-poisoned outputs, per-dtype
tolerances (k3trt.testing.TOLERANCES), at the tiny preset's and K3's per-layer shapes.

    K3TRT_TRT_INCLUDE=/path/to/tensorrt/include python -m pytest -m gpu -q tests/trt_plugin/test_trt_plugin_gpu.py

(the include dir defaults to shared/third_party/tensorrt/include beside the repository; nvcc builds
the library for sm_90a and sm_120 once, cached under ~/.cache/k3trt).
"""

from __future__ import annotations

import pytest
import torch

from k3trt.testing import assert_close
from k3trt.trt_plugin.cases import FP8, all_cases, mla_cache_write
from k3trt.trt_plugin.harness import PluginHarness

pytestmark = pytest.mark.gpu
# scores from bf16 tensor-core products (the SM90 and mma.sync kernels): lse to 1e-2, as the torch
# op's own kernel tests hold it (tests/plugins/test_mla_verify_gpu.py)
LSE_BF16_SCORES = dict(atol=1e-2, rtol=1e-3, rel_norm=1e-3)


@pytest.fixture(scope="module")
def harness():
    return PluginHarness()


def _cases(size):
    return all_cases(size, "cuda", seed={"tiny": 1, "k3": 2}[size])


def _check(harness, case, *, in_place=False):
    inputs_before = [t.clone() for t in case.inputs]
    ref = case.reference()
    got = harness.run(case.op, case.inputs, case.attrs, in_place=in_place)
    assert len(got) == len(ref), f"{case.op}: {len(got)} outputs, reference {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        name = f"{case.op}[{case.name}] output {i}"
        assert g.dtype == r.dtype and g.shape == r.shape, f"{name}: {g.dtype}{tuple(g.shape)} vs {r.dtype}{tuple(r.shape)}"
        if case.exact:
            assert torch.equal(g.view(torch.uint8), r.view(torch.uint8)), f"{name}: not bitwise equal"
        else:
            assert_close(g, r, name=name, **case.tol.get(g.dtype, {}))
    if not in_place:   # a plugin never writes its inputs unless an output aliases them
        for i, (a, b) in enumerate(zip(case.inputs, inputs_before)):
            same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else \
                torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
            assert same, f"{case.op}[{case.name}]: input {i} was modified"


@pytest.mark.parametrize("size", ["tiny", "k3"])
def test_every_op_matches_its_reference(harness, size, monkeypatch):
    """The plain kernels (MlaVerify's faster kernels: the tests below)."""
    monkeypatch.setenv("K3TRT_MLA_KERNEL", "plain")
    for case in _cases(size):
        _check(harness, case)
        torch.cuda.empty_cache()


def test_cache_write_in_place(harness):
    """With aliased I/O the cache output is the input buffer: the write lands in place."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, FP8):
        case = mla_cache_write("k3", torch.bfloat16, "cuda", gen, cache_dtype=dtype)
        ref = case.reference()
        (out,) = harness.run(case.op, case.inputs, case.attrs, in_place=True)
        assert out.data_ptr() == case.inputs[2].data_ptr()
        assert torch.equal(out.view(torch.uint8), ref[0].view(torch.uint8))


def test_aliasing_is_declared(harness):
    spec = harness.output_specs("MlaCacheWrite", [(torch.bfloat16, (4, 512)), (torch.bfloat16, (4, 64)),
                                                  (torch.bfloat16, (2, 64, 576)), (torch.int64, (4,))],
                                {"kv_scale": 1.0})
    assert spec.aliased == (2,)


# ------------------------------------------------------------------------------ MlaVerify's SM90 path
def _mla_k3(batch: int, kv_dtype, ctx: int, gen):
    """K3's MLA call (96 heads, 576 / 512, page 64, 4 rows per request), lengths up to `ctx`."""
    Q, H, D, page = 4, 96, 576, 64
    lens = torch.randint(1, ctx + 1, (batch,), generator=gen)
    lens[0] = ctx
    per = -(-lens // page)
    blocks = int(per.sum()) + 1
    cache = (torch.randn(blocks, page, D, generator=gen) * (4 if kv_dtype == FP8 else 1)).to(kv_dtype)
    table = torch.zeros(batch, int(per.max()) + 1, dtype=torch.int32)
    perm, start = torch.randperm(blocks, generator=gen), 0
    for b in range(batch):
        table[b, :per[b]] = perm[start:start + per[b]].int()
        start += int(per[b])
    q = torch.randn(batch * Q, H, D, generator=gen).to(torch.bfloat16)
    attrs = {"q_per_req": Q, "softmax_scale": 192 ** -0.5, "kv_scale": 0.25 if kv_dtype == FP8 else 1.0, "d_v": 512}
    return [t.cuda() for t in (q, cache, table, lens.int())], attrs


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_mla_verify_runs_the_sm90_kernels(harness, kv_dtype, batch, monkeypatch):
    """On SM90 the plugin runs the torch op's SM90 kernels with the op's plan (pair or swap
    schedule, splits, split rule): bitwise the op's own output, and the fp32 reference's within
    bf16 tolerance; every output element written (NaN-poisoned). K3TRT_MLA_KERNEL=plain / mma run
    the plain and the mma.sync kernel on the same call, which match the reference too."""
    from k3trt.plugins import mla_cuda  # noqa: PLC0415 (builds the op's extension)
    from k3trt.plugins.mla_verify_ref import mla_verify_ref  # noqa: PLC0415

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the SM90 path needs a compute-capability 9.0 GPU")
    inputs, attrs = _mla_k3(batch, kv_dtype, 2048, torch.Generator().manual_seed(batch))
    q, cache, table, lens = inputs
    out, lse = harness.run("MlaVerify", inputs, attrs)
    own_out, own_lse = mla_cuda.mla_verify_cuda(q, cache, table, lens, 4, attrs["softmax_scale"], attrs["kv_scale"])
    assert torch.equal(out, own_out) and torch.equal(lse, own_lse), "not the op's SM90 kernels and plan"
    ref_out, ref_lse = mla_verify_ref(q, cache, table, lens, 4, attrs["softmax_scale"], attrs["kv_scale"], 512)
    assert_close(out, ref_out.to(out.dtype), name="MlaVerify SM90 out")
    assert_close(lse, ref_lse, name="MlaVerify SM90 lse", **LSE_BF16_SCORES)
    for kernel in ("plain", "mma"):
        monkeypatch.setenv("K3TRT_MLA_KERNEL", kernel)
        other_out, other_lse = harness.run("MlaVerify", inputs, attrs)
        assert_close(other_out, ref_out.to(out.dtype), name=f"MlaVerify {kernel} out")
        assert_close(other_lse, ref_lse, name=f"MlaVerify {kernel} lse", **LSE_BF16_SCORES)


@pytest.mark.parametrize("size", ["tiny", "k3"])
def test_mla_verify_mma_kernel(harness, size, monkeypatch):
    """The mma.sync kernel (SM120's, run here on SM90, where mma.sync runs too) on every MlaVerify
    case it takes (bf16 q, bf16 and fp8 caches, slots past each length NaN-filled, every output
    NaN-poisoned) against the fp32 reference; a case it does not take (fp16, fp32, DCP, sparse)
    runs the plain kernel and matches too."""
    monkeypatch.setenv("K3TRT_MLA_KERNEL", "mma")
    cases = [c for c in _cases(size) if c.op == "MlaVerify"]
    assert any(c.inputs[0].dtype == torch.bfloat16 for c in cases)
    for case in cases:
        out, lse = harness.run(case.op, case.inputs, case.attrs)
        ref_out, ref_lse = case.reference()
        assert_close(out, ref_out, name=f"mma {case.name} out", **case.tol.get(out.dtype, {}))
        assert_close(lse, ref_lse, name=f"mma {case.name} lse",
                     **(LSE_BF16_SCORES if case.inputs[0].dtype == torch.bfloat16 else {}))
