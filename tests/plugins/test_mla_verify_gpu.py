"""GPU tests of the Triton kernels behind k3trt::mla_verify and k3trt::merge_attn_states.

Kernel vs the fp32 reference on fresh random inputs over a Cartesian product of cases (FlashMLA's
test style): relative error under 1e-2 for bf16 and fp8 KV, never a NaN, NaN-poisoned outputs and
scratch (every element written, no unwritten partial read), NaN in every cache slot past a length.
Run on the H200: ``pytest -m gpu tests/plugins/test_mla_verify_gpu.py -n 8`` (xdist compiles in parallel).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_mla_verify import Case, make_inputs

from k3trt.plugins import dcp_sim
from k3trt.plugins import mla_verify as mv
from k3trt.plugins.merge import merge_attn_states_ref
from k3trt.plugins.mla_verify import mla_verify_ref
from k3trt.testing import assert_close, rel_norm_error

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
DIMS = [(4, 80, 64), (12, 576, 512), (20, 576, 512)]   # tiny model; K3 TP8; K3 with 2 M tiles
LENS = (0, 1, 63, 65, 700, 2500)


def gpu_cases():
    cases = [Case(LENS, q, heads=h, width=w, d_v=v, page=64, dtype=torch.bfloat16, kv_dtype=kv,
                  kv_scale=0.5 if kv == FP8 else 1.0)
             for (h, w, v), q, kv in itertools.product(DIMS, (1, 4), (None, FP8))]
    k3 = Case((0, 17, 300, 1500), 4, heads=12, width=576, d_v=512, dtype=torch.bfloat16)
    cases += [dataclasses.replace(k3, page=16), dataclasses.replace(k3, page=48),
              dataclasses.replace(k3, lens=(20000,)), dataclasses.replace(k3, dtype=torch.float16),
              dataclasses.replace(k3, lens=(3000,) * 40)]
    return cases


def reference(q, cache, table, seq_lens, case, **kw):
    return mla_verify_ref(q, cache, table, seq_lens, case.q_per_req, case.width ** -0.5,
                          case.kv_scale, case.d_v, **kw)


def run_kernel(q, cache, table, seq_lens, case, splits=None, dv_split=None, **kw):
    """The kernel through mla_triton directly, with poisoned outputs and scratch."""
    from k3trt.plugins import mla_triton, plans  # noqa: PLC0415 (optional: triton)
    rows = q.shape[0] // case.q_per_req
    config = plans.kernel_config(case.q_per_req * case.heads, case.d_v, cache.dtype == FP8, rows)
    if dv_split:  # the other layout of the same kernel, whichever the default is
        config = dataclasses.replace(config, dv_split=dv_split,
                                     num_warps=config.num_warps * config.dv_split // dv_split)
    plan = plans.make_plan(rows, case.q_per_req, case.heads, case.width, case.d_v,
                           kv_fp8=cache.dtype == FP8, num_splits=splits, config=config,
                           num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    out = torch.full((q.shape[0], case.heads, case.d_v), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
    mla_triton.mla_verify_fwd(plan, q, cache, table, seq_lens, case.q_per_req, case.width ** -0.5,
                              case.kv_scale, case.d_v, out=out, lse=lse, poison_scratch=True, **kw)
    return out, lse


def replay_shorter(call, seq_lens):
    """Capture call() in a CUDA graph, shorten the 3 requests' lengths in place (same pages) and
    replay: the replay's (out, lse), which must follow the new lengths."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    seq_lens.copy_(torch.tensor([3, 640, 1], dtype=torch.int32))
    graph.replay()
    return out, lse


def check(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any(), "NaN (unwritten or poisoned) in out"
    assert not torch.isnan(lse).any(), "NaN (unwritten or poisoned) in lse"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows seeing no token differ"
    fin = torch.isfinite(ref_lse)
    assert (out[~fin] == 0).all()
    assert rel_norm_error(out.float(), ref_out.float()) < 1e-2
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-2


@pytest.mark.parametrize("case", gpu_cases(), ids=str)
@pytest.mark.parametrize("splits", [1, 5])
@pytest.mark.parametrize("dv_split", [1, 2])
def test_kernel_matches_reference(case, splits, dv_split):
    q, cache, table, seq_lens, _ = make_inputs(case, seed=splits, device="cuda")
    out, lse = run_kernel(q, cache, table, seq_lens, case, splits, dv_split)
    ref_out, ref_lse = reference(q, cache, table, seq_lens, case)
    check(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("size,rank,inter", [(2, 1, 1), (4, 3, 2), (4, 0, 3)])
def test_kernel_dcp_and_sparse(size, rank, inter):
    case = Case((0, 17, 500, 1400), 4, heads=12, width=576, d_v=512, dtype=torch.bfloat16)
    q, cache, table, seq_lens, _ = make_inputs(case, seed=rank)
    c, t = dcp_sim.shard_paged_cache(cache, table, seq_lens, size, inter)[rank]
    args = [x.cuda() for x in (q, c, t, seq_lens)]
    kw = dict(dcp_size=size, dcp_rank=rank, dcp_interleave=inter)
    check(*run_kernel(*args, case, 3, **kw), *reference(*args, case, **kw))
    sparse = dict(sparse_chunk=64, sparse_sink=1, sparse_stride=3, sparse_recent=2)
    check(*run_kernel(*args, case, 3, **kw, **sparse), *reference(*args, case, **kw, **sparse))


def test_op_dispatches_to_kernel_and_captures_in_graph():
    case = Case((5, 900, 64), 4, heads=12, width=576, d_v=512, dtype=torch.bfloat16, kv_dtype=FP8,
                kv_scale=0.5)
    q, cache, table, seq_lens, _ = make_inputs(case, device="cuda")
    assert mv.mla_verify_unsupported(q, cache, table, seq_lens, case.d_v) is None
    call = lambda: torch.ops.k3trt.mla_verify(q, cache, table, seq_lens, 4, case.width ** -0.5,  # noqa: E731
                                              case.kv_scale, case.d_v)
    out, lse = replay_shorter(call, seq_lens)
    check(out, lse, *reference(q, cache, table, seq_lens, case))


def test_merge_kernel():
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (37, 12, 512)
    a, b = (torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(2))
    la, lb = (torch.randn(shape[:2], device="cuda", generator=g) * 3 for _ in range(2))
    la[0] = float("-inf")
    a[0] = float("nan")
    la[1] = lb[1] = float("-inf")
    out, lse = torch.ops.k3trt.merge_attn_states(a, la, b, lb)
    ref_out, ref_lse = merge_attn_states_ref(a, la, b, lb)
    assert_close(out, ref_out, dtype=torch.bfloat16)
    assert_close(lse, ref_lse, dtype=torch.float32)
