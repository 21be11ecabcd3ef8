"""CPU tests of k3trt::mla_verify (reference), k3trt::merge_attn_states, DCP helpers and plans.

The oracle is a naive float64 softmax per request over the global token sequence, built without
pages, DCP or masks; the paged cache handed to the op has NaN in every slot it must not read.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import k3trt.plugins.merge  # noqa: F401  (registers the op)
from k3trt.plugins import dcp, dcp_sim, plans
from k3trt.plugins.mla_verify import mla_verify_ref, sparse_keep, visible_lengths
from k3trt.testing import assert_close

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    q_per_req: int = 4
    heads: int = 4
    width: int = 80       # tiny model: kv_lora_rank 64 + rope 16
    d_v: int = 64
    page: int = 16
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype | None = None
    kv_scale: float = 1.0


def nan_fill(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == FP8:
        return torch.full((rows, width), 0x7F, dtype=torch.uint8).view(FP8)
    return torch.full((rows, width), float("nan"), dtype=dtype)


def make_inputs(case: Case, seed: int = 0, device: str = "cpu"):
    """Random q and per-request global caches, written into shuffled pages of a paged cache
    whose unused slots, unused pages and spare block-table entries all point at NaN."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = case.kv_dtype or case.dtype
    batch = len(case.lens)
    q = torch.randn(batch * case.q_per_req, case.heads, case.width, generator=g).to(case.dtype)
    scale = 2.0 if kv_dtype == FP8 else 1.0  # spread fp8 values over its exponent range
    kv_global = [(torch.randn(n, case.width, generator=g) * scale).to(kv_dtype) for n in case.lens]
    per_req = [max(1, -(-n // case.page)) for n in case.lens]
    num_blocks = sum(per_req) + 3
    cache = nan_fill(num_blocks * case.page, case.width, kv_dtype).view(num_blocks, case.page, -1)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((batch, max(per_req) + 1), int(perm[-1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(case.lens):
        ids = perm[used:used + per_req[b]]
        used += per_req[b]
        table[b, : len(ids)] = ids.int()
        flat = cache[ids.long()].reshape(-1, case.width)
        flat[:n] = kv_global[b]
        cache[ids.long()] = flat.view(len(ids), case.page, -1)
    seq_lens = torch.tensor(case.lens, dtype=torch.int32)
    dev = lambda t: t.to(device)  # noqa: E731
    return dev(q), dev(cache), dev(table), dev(seq_lens), kv_global


def naive_attention(q, kv_global, q_per_req, softmax_scale, d_v, kv_scale=1.0, keep=None):
    """float64 softmax of each row over the global tokens it sees; keep(b, n) -> bool mask."""
    rows, heads, _ = q.shape
    out = torch.zeros(rows, heads, d_v, dtype=torch.float64)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64)
    for b, kv in enumerate(kv_global):
        kv = kv.double() * kv_scale
        for j in range(q_per_req):
            vis = max(kv.shape[0] - (q_per_req - 1 - j), 0)
            idx = torch.arange(vis)
            if keep is not None:
                idx = idx[keep(b, kv.shape[0])[:vis]]
            if idx.numel() == 0:
                continue
            r = b * q_per_req + j
            s = q[r].double() @ kv[idx].T * softmax_scale          # [H, n]
            lse[r] = torch.logsumexp(s, -1)
            out[r] = torch.softmax(s, -1) @ kv[idx, :d_v]
    return out, lse


def run_op(q, cache, table, seq_lens, case, **kw):
    return torch.ops.k3trt.mla_verify(q, cache, table, seq_lens, case.q_per_req,
                                      case.width ** -0.5, case.kv_scale, case.d_v, **kw)


def check_against_naive(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close(lse, ref_lse.float(), dtype=torch.float32, atol=1e-4, rtol=1e-4, name="lse")
    assert_close(out, ref_out.to(out.dtype), dtype=dtype, name="out")


BASE = [(0,), (1,), (17,), (0, 5, 33, 64), (3, 48, 100)]
CASES = [Case(lens, q, page=p, dtype=dt)
         for lens, q, p, dt in itertools.product(BASE, (1, 4), (16, 48), (torch.float32, torch.bfloat16))]
CASES += [Case((70, 2, 130), kv_dtype=FP8, dtype=torch.bfloat16, kv_scale=0.25),
          Case((40,), heads=12, width=576, d_v=512, page=64, dtype=torch.bfloat16)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_naive(case):
    q, cache, table, seq_lens, kv_global = make_inputs(case, seed=hash(case) % 1000)
    out, lse = run_op(q, cache, table, seq_lens, case)
    assert out.shape == (q.shape[0], case.heads, case.d_v) and out.dtype == case.dtype
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    ref_out, ref_lse = naive_attention(q, kv_global, case.q_per_req, case.width ** -0.5, case.d_v,
                                       case.kv_scale)
    check_against_naive(out, lse, ref_out, ref_lse, case.dtype)
    for b, n in enumerate(case.lens):  # a row that sees nothing: out 0, lse -inf
        for j in range(case.q_per_req):
            if n - (case.q_per_req - 1 - j) <= 0:
                r = b * case.q_per_req + j
                assert torch.isneginf(lse[r]).all() and (out[r] == 0).all()


def test_spec_vector_and_placement():
    assert visible_lengths(17, 4, 4, 3, 2) == [2, 3, 4, 4]
    for size, inter, length in itertools.product((1, 2, 4), (1, 2, 3), range(0, 40)):
        t = torch.arange(length)
        lens = [dcp.local_len(length, size, r, inter) for r in range(size)]
        assert sum(lens) == length
        for r in range(size):
            mine = t[dcp.token_rank(t, size, inter) == r]
            assert mine.numel() == lens[r]
            assert dcp.local_index(mine, size, inter).tolist() == list(range(lens[r]))
        tensor_len = dcp.local_len(torch.tensor(length), size, size - 1, inter)
        assert int(tensor_len) == lens[-1]


@pytest.mark.parametrize("size,inter,q_per_req", [(2, 1, 4), (2, 2, 1), (4, 1, 4), (4, 2, 4), (4, 3, 1)])
def test_dcp_shards_merge_to_unsharded(size, inter, q_per_req):
    case = Case((0, 3, 17, 50, 97), q_per_req, page=16)
    q, cache, table, seq_lens, kv_global = make_inputs(case, seed=size * 10 + inter)
    shards = dcp_sim.shard_paged_cache(cache, table, seq_lens, size, inter)
    out = lse = None
    for r, (c, t) in enumerate(shards):
        o, s = run_op(q, c, t, seq_lens, case, dcp_size=size, dcp_rank=r, dcp_interleave=inter)
        out, lse = (o, s) if out is None else torch.ops.k3trt.merge_attn_states(out, lse, o, s)
    ref_out, ref_lse = naive_attention(q, kv_global, q_per_req, case.width ** -0.5, case.d_v)
    check_against_naive(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("q_rep", [False, True])
def test_dcp_group_q_rep(q_rep):
    case = Case((5, 40, 66), heads=4)
    q, cache, table, seq_lens, kv_global = make_inputs(case, seed=7)
    size = 2
    shards = dcp_sim.shard_paged_cache(cache, table, seq_lens, size, 2)
    q_in = [q] * size if q_rep else list(q.chunk(size, dim=1))
    outs, lses, log = dcp_sim.simulate_dcp_group(q_in, shards, seq_lens, case.q_per_req,
                                             case.width ** -0.5, d_v=case.d_v, interleave=2,
                                             q_rep=q_rep)
    names = [name for name, _ in log.collectives]
    assert ("all_gather_q" in names) != q_rep
    ref_out, ref_lse = naive_attention(q, kv_global, case.q_per_req, case.width ** -0.5, case.d_v)
    heads = case.heads // (1 if q_rep else size)
    for r in range(size):
        lo = 0 if q_rep else r * heads
        check_against_naive(outs[r], lses[r], ref_out[:, lo:lo + heads], ref_lse[:, lo:lo + heads],
                            torch.float32)
    if q_rep:
        with pytest.raises(ValueError):
            dcp_sim.simulate_dcp_group(list(q.chunk(size, dim=1)), shards, seq_lens, case.q_per_req,
                                   1.0, d_v=case.d_v, q_rep=True)


def test_sparse_stride_one_is_dense_and_strided_matches_mask():
    case = Case((0, 30, 200, 131), page=32)
    q, cache, table, seq_lens, kv_global = make_inputs(case, seed=3)
    dense = run_op(q, cache, table, seq_lens, case)
    ones = run_op(q, cache, table, seq_lens, case, sparse_chunk=16, sparse_sink=1, sparse_stride=1,
                  sparse_recent=1)
    assert torch.equal(dense[0], ones[0]) and torch.equal(dense[1], ones[1])
    policy = dict(sparse_chunk=16, sparse_sink=1, sparse_stride=3, sparse_recent=2)
    out, lse = run_op(q, cache, table, seq_lens, case, **policy)
    keep = lambda b, n: sparse_keep(n, 16, 1, 3, 2)  # noqa: E731
    ref_out, ref_lse = naive_attention(q, kv_global, case.q_per_req, case.width ** -0.5, case.d_v,
                                       keep=keep)
    check_against_naive(out, lse, ref_out, ref_lse, torch.float32)
    assert not torch.equal(out, dense[0])
    assert sparse_keep(10 * 16, 16, 1, 3, 2).view(10, 16)[:, 0].tolist() == [
        True, True, False, False, True, False, False, True, True, True]


def test_merge_attn_states():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 3, 32, generator=g, dtype=torch.float64)
    kv = torch.randn(50, 32, generator=g, dtype=torch.float64)

    def part(lo, hi):
        s = torch.einsum("thd,nd->thn", q, kv[lo:hi])
        return torch.softmax(s, -1) @ kv[lo:hi, :16], torch.logsumexp(s, -1)
    full, a, b = part(0, 50), part(0, 20), part(20, 50)
    out, lse = torch.ops.k3trt.merge_attn_states(a[0].float(), a[1].float(), b[0].float(), b[1].float())
    assert_close(out, full[0].float(), dtype=torch.float32)
    assert_close(lse, full[1].float(), dtype=torch.float32)
    # a -inf side contributes nothing, even with garbage in its out; both -inf → 0, -inf
    garbage = torch.full_like(out, float("nan"))
    ninf = torch.full_like(lse, float("-inf"))
    o2, l2 = torch.ops.k3trt.merge_attn_states(garbage, ninf, a[0].float(), a[1].float())
    assert_close(o2, a[0].float(), dtype=torch.float32)
    assert torch.equal(l2, a[1].float())
    o3, l3 = torch.ops.k3trt.merge_attn_states(garbage, ninf, garbage, ninf)
    assert (o3 == 0).all() and torch.isneginf(l3).all()
    o4, _ = torch.ops.k3trt.merge_attn_states(a[0].bfloat16(), a[1].float(), b[0].bfloat16(), b[1].float())
    assert o4.dtype == torch.bfloat16


def test_plans_capacities_and_pick():
    ps = plans.make_plans(28, 4, 12, 576, 512)
    assert [p.capacity for p in ps] == [1, 2, 4, 8, 16, 28]
    assert [p.capacity for p in plans.make_plans(1, 4, 12, 576, 512)] == [1]
    assert [p.capacity for p in plans.make_plans(64, 4, 12, 576, 512)][-2:] == [32, 64]
    assert plans.pick_plan(ps, 3).capacity == 4
    assert plans.pick_plan(ps, 17).capacity == 28
    with pytest.raises(ValueError, match="exceed"):
        plans.pick_plan(ps, 29)
    for p in ps:
        assert p.grid == (p.m_tiles * p.config.dv_split, p.num_splits, p.capacity)
        assert p.m_tiles == 1 and p.config.block_m == 64   # 4 rows × 12 heads in one tile
        assert p.config.dv_split == (2 if p.capacity <= plans.SMALL_GRID else 1)
        assert 1 <= p.num_splits <= plans.MAX_SPLITS
        rows = p.capacity * 48 if p.num_splits > 1 else 0
        assert p.scratch_out_shape[0] == rows and p.scratch_bytes == 4 * rows * p.num_splits * 513
    big = plans.make_plan(128, 4, 96, 576, 512)
    assert big.m_tiles == 6 and big.num_splits == 1 and big.scratch_bytes == 0
    assert big.config == plans.KernelConfig(64, 64, 8, 2)
    assert plans.make_plan(1, 4, 12, 576, 512).num_splits > 16   # one request fills the GPU


def test_fake_and_opcheck():
    case = Case((5, 20), q_per_req=2, page=16)
    q, cache, table, seq_lens, _ = make_inputs(case)
    args = (q, cache, table, seq_lens, 2, 0.1, 1.0, case.d_v)
    torch.library.opcheck(torch.ops.k3trt.mla_verify.default, args)
    with FakeTensorMode() as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out, lse = torch.ops.k3trt.mla_verify(*fargs)
        assert out.shape == (4, 4, case.d_v) and lse.shape == (4, 4) and lse.dtype == torch.float32
    o = torch.randn(3, 2, 8)
    torch.library.opcheck(torch.ops.k3trt.merge_attn_states.default, (o, torch.randn(3, 2), o + 1, torch.randn(3, 2)))


def test_bad_inputs_raise():
    case = Case((5,), q_per_req=2)
    q, cache, table, seq_lens, _ = make_inputs(case)
    with pytest.raises(ValueError):
        torch.ops.k3trt.mla_verify(q, cache, table.long(), seq_lens, 2, 0.1)
    with pytest.raises(ValueError):
        torch.ops.k3trt.mla_verify(q, cache, table, seq_lens, 3, 0.1)
    with pytest.raises(ValueError):
        torch.ops.k3trt.mla_verify(q, cache, table, seq_lens, 2, 0.1, d_v=999)
    with pytest.raises(ValueError):
        torch.ops.k3trt.mla_verify(q, cache, table, seq_lens, 2, 0.1, dcp_size=2, dcp_rank=2)


def test_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import k3trt.plugins.mla_verify, "
            "k3trt.plugins.merge, k3trt.plugins.plans, k3trt.plugins.dcp, k3trt.plugins.dcp_sim; "
            "import torch; assert hasattr(torch.ops.k3trt, 'mla_verify')")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reference_direct_matches_op():
    case = Case((9, 33), page=16)
    q, cache, table, seq_lens, _ = make_inputs(case, seed=11)
    a = run_op(q, cache, table, seq_lens, case)
    b = mla_verify_ref(q, cache, table, seq_lens, case.q_per_req, case.width ** -0.5, 1.0, case.d_v)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
