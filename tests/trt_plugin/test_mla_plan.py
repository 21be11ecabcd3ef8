"""mla_cuda/plan.h, the C++ copy of the SM90 MLA launch plan that the TensorRT plugin applies,
equals the torch op's rule (mla_cuda/schedule.py over plans.choose_splits) on a grid of cache
dtypes, batches, rows per request, head counts and SM counts. Compiled with g++ on the CPU."""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess

import pytest

from k3trt.plugins.mla_cuda import constants
from k3trt.plugins.mla_cuda.schedule import pick_schedule, swap_head_group, tiles, wave_splits
from k3trt.plugins.mla_cuda.schedule import FP8
from k3trt.plugins.plans import choose_splits
from k3trt.trt_plugin.build import MLA_SM90_DIR

SHIM = r"""
#include "plan.h"
extern "C" void plan(int fp8, int batch, int q, int heads, int sms, int* out) {
  const k3mla::Plan p = k3mla::make_plan(fp8 != 0, batch, q, heads, sms);
  out[0] = p.schedule; out[1] = p.head_group; out[2] = p.splits; out[3] = p.wave_splits;
}
"""


@pytest.fixture(scope="module")
def plan_lib(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    d = tmp_path_factory.mktemp("plan")
    (d / "shim.cpp").write_text(SHIM)
    include = constants.write_header(str(d))
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(MLA_SM90_DIR), "-I", include,
                    str(d / "shim.cpp"), "-o", str(d / "libplan.so")], check=True, capture_output=True)
    return ctypes.CDLL(str(d / "libplan.so"))


def test_plan_h_equals_the_torch_ops_rule(plan_lib):
    out = (ctypes.c_int * 4)()
    checked = 0
    for fp8, batch, q, heads, sms in itertools.product((False, True), (1, 2, 3, 8, 31, 32, 33, 64, 128, 200),
                                                        (1, 2, 4, 8, 16), (1, 8, 12, 16, 24, 48, 96, 128),
                                                        (78, 114, 132)):
        plan_lib.plan(int(fp8), batch, q, heads, sms, out)
        schedule = pick_schedule(FP8 if fp8 else None, q, heads, batch)
        splits = choose_splits(max(1, tiles(batch, q, heads, schedule)), sms)
        want = (constants.SCHEDULES[schedule], swap_head_group(q, heads), splits,
                wave_splits(batch, q, heads, splits, sms, schedule))
        assert tuple(out) == want, (fp8, batch, q, heads, sms)
        checked += 1
    assert checked == 2 * 10 * 5 * 8 * 3
