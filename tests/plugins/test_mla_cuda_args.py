"""CPU checks of the SM90 MLA kernel's Python front (k3trt/plugins/mla_cuda): which calls it
refuses and why, before anything is built or launched (the kernel itself: test_mla_cuda_gpu.py)."""

from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from k3trt.plugins import mla_cuda
from k3trt.plugins.mla_cuda import constants, schedule


def _args(**over):
    a = dict(q=torch.zeros(8, 12, 576, dtype=torch.bfloat16),
             kv_cache=torch.zeros(3, 64, 576, dtype=torch.bfloat16),
             block_table=torch.zeros(2, 2, dtype=torch.int32),
             seq_lens=torch.zeros(2, dtype=torch.int32), d_v=512)
    a.update(over)
    return a


def test_bad_schedule_is_named_before_anything_runs():
    a = _args()
    with pytest.raises(ValueError, match=r"schedule 'fast' is not one of \['pair', 'swap'\]"):
        mla_cuda.mla_verify_cuda(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 4,
                                 576 ** -0.5, schedule="fast")


def test_cpu_call_is_refused_with_its_reason():
    a = _args()
    with pytest.raises(ValueError, match="unsupported call: q not on CUDA"):
        mla_cuda.mla_verify_cuda(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 4,
                                 576 ** -0.5)


def test_schedules_table():
    assert mla_cuda.DEFAULT_SCHEDULE in mla_cuda.SCHEDULES
    assert sorted(mla_cuda.SCHEDULES.values()) == [0, 1]  # the kernel's LaunchArgs::schedule codes


def test_constants_header_is_the_table():
    """mla_constants.h holds every shared constant with the table's value, and no CUDA source
    defines one of them by hand."""
    text = constants.header()
    for k in constants.TABLE:
        assert f"constexpr int {k.c} = {k.value};" in text
    sources = glob.glob(os.path.join(mla_cuda.SOURCE_DIR, "*.cu*")) + \
        glob.glob(os.path.join(mla_cuda.SOURCE_DIR, "*.h"))
    assert sources
    for path in sources:
        src = open(path).read()
        for k in constants.TABLE:
            assert not re.search(rf"constexpr\s+int\s+{k.c}\b", src), f"{path} defines {k.c}"


def test_write_header_rewrites_only_a_changed_text(tmp_path):
    path = os.path.join(constants.write_header(str(tmp_path)), constants.HEADER)
    assert open(path).read() == constants.header()
    mtime = os.stat(path).st_mtime_ns
    constants.write_header(str(tmp_path))
    assert os.stat(path).st_mtime_ns == mtime


def test_timeout_names_cover_the_error_codes():
    codes = {k.value for k in constants.TABLE if k.py.startswith("ERR_")}
    assert set(constants.TIMEOUT_NAMES) == codes


@pytest.mark.parametrize("kv, q, heads, batch, expect", [
    (torch.float8_e4m3fn, 4, 12, 32, "swap"),    # 12 heads x 4 at TP 8, batch 32
    (torch.float8_e4m3fn, 1, 12, 256, "swap"),   # plain decode: the request in one CTA
    (torch.float8_e4m3fn, 4, 48, 32, "swap"),    # TP 2: 4 head groups of 12 x 4 rows
    (torch.float8_e4m3fn, 4, 96, 128, "swap"),   # TP 1: 8 of them
    (torch.float8_e4m3fn, 1, 96, 64, "swap"),    # 2 groups of 48 heads
    (torch.float8_e4m3fn, 4, 12, 16, "pair"),    # few requests: the swap CTA's fixed cost
    (torch.float8_e4m3fn, 4, 16, 128, "pair"),   # 2 groups of 8 heads x 4: CTAs a third empty
    (torch.float8_e4m3fn, 49, 1, 128, "pair"),   # more query rows than a swap CTA has
    (torch.bfloat16, 4, 12, 128, "pair"),        # the swap kernel takes fp8 only
])
def test_pick_schedule(kv, q, heads, batch, expect):
    assert mla_cuda.pick_schedule(kv, q, heads, batch) == expect
    assert expect in mla_cuda.SCHEDULES


@pytest.mark.parametrize("q, heads, expect", [(4, 12, 12), (4, 48, 12), (4, 96, 12), (1, 96, 48),
                                              (2, 48, 24), (3, 16, 16), (4, 16, 8), (4, 5, 5),
                                              (4, 13, 1), (48, 3, 1), (49, 1, 0)])
def test_swap_head_group(q, heads, expect):
    """The most heads that divide H with Q x them <= 48 (the launcher passes it to the kernel)."""
    assert mla_cuda.swap_head_group(q, heads) == expect


def test_swap_tiles_are_head_groups():
    """The swap grid's CTAs per split (split plans count them): heads / head group per request."""
    assert mla_cuda.tiles(32, 4, 48, "swap") == 128 and mla_cuda.tiles(32, 4, 48, "pair") == 96
    assert mla_cuda.wave_splits(8, 4, 96, 5, 132, "swap") == 2  # 64 CTAs: two splits fill 128 SMs


@pytest.mark.parametrize("batch, heads, splits, expect", [
    (1, 12, 113, 113),   # batch 1: 113 CTAs, one wave: spread as far as the plan goes
    (32, 12, 4, 4),      # 128 CTAs
    (32, 48, 4, 1),      # 96 programs: a second split is a second wave
    (8, 96, 5, 2),       # 48 programs: two splits fill 96 SMs
    (128, 12, 1, 1),
])
def test_wave_splits(batch, heads, splits, expect):
    assert mla_cuda.wave_splits(batch, 4, heads, splits, num_sms=132) == expect


def test_default_plan_is_the_ops_choice(monkeypatch):
    """The (schedule, splits) the op takes by default, which benchmarks report: at 48 heads, batch 32
    an fp8 cache runs swap on one split of 128 head-group CTAs, bf16 the pair kernel on four of 96;
    a given schedule is kept."""
    monkeypatch.setattr(schedule, "sm_count", lambda index: 132)
    assert mla_cuda.default_plan(torch.float8_e4m3fn, 32, 4, 48) == ("swap", 1)
    assert mla_cuda.default_plan(torch.bfloat16, 32, 4, 48) == ("pair", 4)
    assert mla_cuda.default_plan(torch.float8_e4m3fn, 32, 4, 48, schedule="pair") == ("pair", 4)
