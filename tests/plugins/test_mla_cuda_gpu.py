"""GPU tests of the SM90 CUDA MLA verification kernel (k3trt/plugins/mla_cuda) against the fp32
reference, on fresh random inputs: lengths not multiple of 64, zero length, batch 1 / 32, H = 12
(one M tile) and H = 48 (three), bf16 and fp8 KV, split-K on and off, NaN-poisoned outputs and
scratch (every element written, no unwritten partial read), NaN in every cache slot past a length.
Both kernel schedules (``pair``, and ``swap`` for fp8 caches: a request's rows in one CTA as 12
heads x 4, 24 x 2, 16 x 3, 12 x 1, 5 x 4, or in head groups as 48 x 4, 96 x 1, 16 x 4). Every
test's split scratch is NaN-filled (the ``nan_scratch`` fixture).
Relative error under 1e-2, never a NaN.
Run on the H200 (sm_90 only; the extension JIT-builds on first use):
``pytest -m gpu tests/plugins/test_mla_cuda_gpu.py``.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from test_mla_verify import Case, make_inputs
from test_mla_verify_gpu import check, replay_shorter

from k3trt.plugins import mla_cuda, plans
from k3trt.plugins.mla_verify import mla_verify_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 GPU")]

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def nan_scratch(monkeypatch):
    """The kernel's split partials come NaN-filled: a partial the merge reads unwritten shows."""
    monkeypatch.setattr(mla_cuda, "split_scratch",
                        functools.partial(plans.split_scratch, poison=True))


LENS = [(0, 1, 63, 65, 700, 2500), (20000,), (0, 0)]


def _case(lens, heads, kv, q_per_req=4):
    return Case(lens, q_per_req, heads=heads, width=576, d_v=512, page=64, dtype=torch.bfloat16,
                kv_dtype=kv, kv_scale=0.5 if kv == FP8 else 1.0)


# (schedule, kv dtype) pairs each kernel takes: swap only an fp8 cache
COMBOS = [("pair", None), ("pair", FP8), ("swap", FP8)]
COMBO_IDS = [f"{s}-{'fp8' if kv == FP8 else 'bf16'}" for s, kv in COMBOS]


def cases():
    g = torch.Generator().manual_seed(3)
    lens32 = tuple(int(x) for x in torch.randint(1, 3000, (32,), generator=g))
    out = [_case(lens, h, kv) for lens, h, kv in itertools.product(LENS + [lens32], (12,), (None, FP8))]
    out += [_case((17, 300, 1500), 48, kv) for kv in (None, FP8)]
    out += [_case((129, 64), 16, None), _case((3000, 2), 20, None)]
    return out


def run(case, splits, seed, schedule, edit=None, **launch):
    """(out, lse, ref_out, ref_lse); edit(cache, table), if given, changes the cache in place first."""
    q, cache, table, seq_lens, _ = make_inputs(case, seed=seed, device="cuda")
    if edit is not None:
        edit(cache, table)
    scale = case.width ** -0.5
    out = torch.full((q.shape[0], case.heads, case.d_v), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
    mla_cuda.reset_kernel_error()
    mla_cuda.mla_verify_cuda(q, cache, table, seq_lens, case.q_per_req, scale, case.kv_scale,
                             case.d_v, num_splits=splits, out=out, lse=lse, schedule=schedule,
                             **launch)
    assert mla_cuda.kernel_error() is None
    ref_out, ref_lse = mla_verify_ref(q, cache, table, seq_lens, case.q_per_req, scale,
                                      case.kv_scale, case.d_v)
    return out, lse, ref_out, ref_lse


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"L{len(c.lens)}x{max(c.lens)}-H{c.heads}-"
                         f"{'fp8' if c.kv_dtype == FP8 else 'bf16'}")
@pytest.mark.parametrize("splits", [1, 5, None])
@pytest.mark.parametrize("schedule", ["pair"])
def test_kernel_matches_reference(case, splits, schedule):
    check(*run(case, splits, seed=splits or 0, schedule=schedule))


@pytest.mark.parametrize("rule", [dict(min_split_blocks=1, full_split_blocks=1000),
                                  dict(min_split_blocks=2), dict(min_split_blocks=7, max_spread=3),
                                  dict(full_split_blocks=3, max_spread=1),
                                  dict(full_split_blocks=40, max_spread=2)], ids=str)
@pytest.mark.parametrize("schedule, kv", COMBOS, ids=COMBO_IDS)
def test_split_rule(rule, kv, schedule):
    """How far each request spreads over the plan's splits (SplitRule) changes the work split and
    which partials the merge reads, never the result; lengths from 0 to 20000 under one plan."""
    case = _case((0, 1, 63, 65, 130, 700, 2500, 20000), 12, kv)
    check(*run(case, 6, seed=len(rule), schedule=schedule, **rule))


@pytest.mark.parametrize("splits", [2, 8, 9, 16, 37, 64, 128])
@pytest.mark.parametrize("lens", [(20000,), (5000, 0, 64, 131)], ids=["one", "mixed"])
def test_merge_thread_groups(splits, lens):
    """Both merges: up to 8 splits the few-splits kernel (every load at once), from 9 the grouped one
    (a 128-thread group per 8 splits, up to 8 groups, adding up through shared memory); every group
    count, rows whose later splits saw none of their tokens, and in the grouped kernel the rows of a
    request spread over only 3 splits (131 tokens), which one group merges with every load at once."""
    check(*run(_case(lens, 12, None), splits, seed=splits, schedule="pair", min_split_blocks=1,
               full_split_blocks=1, max_spread=splits))


@pytest.mark.parametrize("splits", [4, 12])
@pytest.mark.parametrize("schedule", ["pair"])
def test_one_split_requests_beside_merged_ones(splits, schedule):
    """Short requests stay on one split, whose CTA writes their bf16 rows while the merge skips them;
    the long ones beside them spread over all splits and are merged (the few-splits merge at 4, the
    grouped one at 12, whose grid is three waves of CTAs), each over as many splits as its length
    gives. NaN scratch and NaN outputs: a row written by neither, or from an unwritten partial,
    shows."""
    g = torch.Generator().manual_seed(splits)
    lens = [int(x) for x in torch.randint(2000, 6000, (30,), generator=g)] + [40, 100]
    case = _case(tuple(lens), 12, None)
    check(*run(case, splits, seed=splits, schedule=schedule, min_split_blocks=4, max_spread=splits))


@pytest.mark.parametrize("schedule, kv", COMBOS, ids=COMBO_IDS)
def test_captures_in_graph_and_follows_lengths(kv, schedule):
    case = _case((5, 900, 64), 12, kv)
    q, cache, table, seq_lens, _ = make_inputs(case, device="cuda")
    call = lambda: mla_cuda.mla_verify_cuda(q, cache, table, seq_lens, 4, case.width ** -0.5,  # noqa: E731
                                            case.kv_scale, case.d_v, num_splits=3,
                                            schedule=schedule, min_split_blocks=1)
    out, lse = replay_shorter(call, seq_lens)
    check(out, lse, *mla_verify_ref(q, cache, table, seq_lens, 4, case.width ** -0.5,
                                    case.kv_scale, case.d_v))


@pytest.mark.parametrize("splits", [2, 4, 6, 8])
@pytest.mark.parametrize("kv", [None, FP8], ids=["bf16", "fp8"])
def test_merge_rows_not_a_multiple_of_its_cta(splits, kv):
    """The few-splits merge takes 8 rows a CTA (a warp each): 5 heads x 4 rows x 3 requests = 60
    rows leave its last CTA half empty; one request on one split beside merged ones."""
    check(*run(_case((3000, 70, 1200), 5, kv), splits, seed=splits, schedule="pair",
               min_split_blocks=4, max_spread=splits))


def test_next_kernel_sees_the_whole_output_after_a_merge_with_nothing_to_merge():
    """The merge is a programmatic dependent launch whose CTAs exit at once when their rows sit on
    one split; only CTA 0 waits for the verify grid. If none waited, the merge grid could complete
    while the verify kernel (3000 tokens a request here, ~100 us) still writes, and the next kernel
    in the stream would read a NaN-poisoned output."""
    case = _case((3000,) * 32, 12, None)
    q, cache, table, seq_lens, _ = make_inputs(case, device="cuda")
    out = torch.empty(q.shape[0], case.heads, case.d_v, dtype=q.dtype, device="cuda")
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")
    first = None
    for _ in range(50):
        out.fill_(float("nan"))
        mla_cuda.mla_verify_cuda(q, cache, table, seq_lens, 4, case.width ** -0.5, 1.0, case.d_v,
                                 num_splits=4, out=out, lse=lse, max_spread=1,
                                 full_split_blocks=1000)
        assert not torch.isnan(out).any().item()
        first = out.clone() if first is None else first
        assert torch.equal(out, first)


def test_pair_kernel_is_bitwise_repeatable():
    """The result may not depend on timing (which warpgroup's chunks land first, which CTAs run
    together, which warps skip a rescale): repeated calls agree bit for bit, and with the
    reference. 48 heads, 24 requests of mixed lengths, split-K and the merge included."""
    g = torch.Generator().manual_seed(5)
    case = _case(tuple(int(x) for x in torch.randint(1, 4000, (24,), generator=g)), 48, None)
    q, cache, table, seq_lens, _ = make_inputs(case, seed=4, device="cuda")
    args = (q, cache, table, seq_lens, 4, case.width ** -0.5, 1.0, case.d_v)
    out, lse = mla_cuda.mla_verify_cuda(*args)
    check(out, lse, *mla_verify_ref(*args))
    for _ in range(20):
        again, again_lse = mla_cuda.mla_verify_cuda(*args)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("schedule, kv", COMBOS, ids=COMBO_IDS)
def test_running_max_jumps(schedule, kv, splits):
    """The pair kernel keeps a row's running max until a block's max passes it by more than a
    factor of 2^8 (lazy rescaling): here single tokens' rope keys are scaled up so that rows'
    maxima jump late in the sequence by less (~120 row-head-blocks) and by more (~40, in blocks
    3, 5, 10, 14, 35: both warpgroups' blocks) than that, while V (the latent's first 512)
    stays as drawn."""
    case = _case((1000, 2500, 130, 64), 12, kv)
    jumps = [(70, 4.0), (200, 12.0), (330, 30.0), (650, 12.0), (900, 30.0), (2300, 20.0)]

    def scale_rope_keys(cache, table):
        for b, n in enumerate(case.lens):
            for t, gain in jumps:
                if t < n:
                    page, slot = int(table[b, t // case.page]), t % case.page
                    row = cache[page, slot, 512:].float() * gain
                    cache[page, slot, 512:] = row.to(cache.dtype)

    check(*run(case, splits, seed=6, schedule=schedule, edit=scale_rope_keys))


@pytest.mark.parametrize("kv", [None, FP8], ids=["bf16", "fp8"])
def test_q_tile_reads_only_its_rows(kv):
    """The pair kernel's Q tile comes by TMA, from a tensor map over Q's own rows: here Q is a view
    one row into a NaN-filled buffer, so a map based on anything but Q's pointer reads NaN or
    shifted rows. With 12 heads a request's 48 rows fill three quarters of its 64-row tile; the
    rest reads the next request's Q (zeros past the tensor), which must not reach the output."""
    case = _case((700, 65, 1, 2000), 12, kv)
    q, cache, table, seq_lens, _ = make_inputs(case, seed=11, device="cuda")
    buf = torch.full((q.shape[0] + 2, *q.shape[1:]), float("nan"), dtype=q.dtype, device="cuda")
    buf[1:-1] = q
    for splits in (1, 3):
        out = torch.full((q.shape[0], case.heads, case.d_v), float("nan"), dtype=q.dtype,
                         device="cuda")
        lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
        mla_cuda.mla_verify_cuda(buf[1:-1], cache, table, seq_lens, 4, case.width ** -0.5,
                                 case.kv_scale, case.d_v, num_splits=splits, out=out, lse=lse,
                                 min_split_blocks=1)
        check(out, lse, *mla_verify_ref(q, cache, table, seq_lens, 4, case.width ** -0.5,
                                        case.kv_scale, case.d_v))


def test_misaligned_q_is_refused():
    """TMA needs a 16-byte aligned base: a Q view 2 bytes into its buffer is refused by name."""
    case = _case((100,), 12, None)
    q, cache, table, seq_lens, _ = make_inputs(case, device="cuda")
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    qv = buf[1:].view(q.shape)
    qv.copy_(q)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mla_cuda.mla_verify_cuda(qv, cache, table, seq_lens, 4, case.width ** -0.5, 1.0, case.d_v)


def swap_cases():
    """fp8 caches with every row count the swap kernel takes: 48 rows as 12 heads x 4, 24 x 2 and
    16 x 3 (the visible length changes at other columns), 12 x 1 (plain decode) and 5 x 4 (28 of 48
    columns padding), lengths from 0 to 20000; and requests over several CTAs (head groups): 48
    heads x 4 (4 groups of 12), 96 x 1 (2 of 48), 16 x 4 (2 of 8: 32 rows)."""
    g = torch.Generator().manual_seed(9)
    lens32 = tuple(int(x) for x in torch.randint(1, 3000, (32,), generator=g))
    out = [_case(lens, 12, FP8) for lens in LENS + [lens32]]
    out += [_case((129, 64, 3000), 24, FP8, 2), _case((700, 1, 2049), 16, FP8, 3),
            _case((0, 65, 5000), 12, FP8, 1), _case((3000, 70, 1200), 5, FP8)]
    out += [_case((17, 300, 1500, 0), 48, FP8), _case((129, 3000), 96, FP8, 1),
            _case((700, 65, 2049), 16, FP8)]
    return out


@pytest.mark.parametrize("case", swap_cases(), ids=lambda c: f"L{len(c.lens)}x{max(c.lens)}-"
                         f"H{c.heads}xQ{c.q_per_req}")
@pytest.mark.parametrize("splits", [1, 5, None])
def test_swap_kernel_matches_reference(case, splits):
    check(*run(case, splits, seed=splits or 0, schedule="swap"))


@pytest.mark.parametrize("kv, q_per_req", [(None, 4), (FP8, 49)], ids=["bf16", "49-rows"])
def test_swap_refuses_what_it_does_not_take(kv, q_per_req):
    """A bf16 cache, or more query rows a request than a CTA has: refused by name, not computed
    wrongly."""
    case = _case((100,), 1, kv, q_per_req)
    q, cache, table, seq_lens, _ = make_inputs(case, device="cuda")
    expect = "schedule swap takes an fp8 cache and a head group dividing"
    with pytest.raises(RuntimeError, match=expect):
        mla_cuda.mla_verify_cuda(q, cache, table, seq_lens, q_per_req, 0.1, case.kv_scale, 512,
                                 schedule="swap")


@pytest.mark.parametrize("heads", [12, 48])
def test_default_schedule_takes_swap_where_picked(heads):
    """With no schedule given, an fp8 cache at 12 heads (one CTA a request) or 48 (four head
    groups) and batch 32 runs the swap kernel (pick_schedule), through the default split plan."""
    g = torch.Generator().manual_seed(12)
    case = _case(tuple(int(x) for x in torch.randint(1, 5000, (32,), generator=g)), heads, FP8)
    assert mla_cuda.pick_schedule(FP8, 4, heads, 32) == "swap"
    check(*run(case, None, seed=12, schedule=None))
