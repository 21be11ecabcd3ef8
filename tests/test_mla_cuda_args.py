"""CPU checks of the SM90 MLA kernel's Python front (k3trt/plugins/mla_cuda): which calls it
refuses and why, before anything is built or launched (the kernel itself: test_mla_cuda_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from k3trt.plugins import mla_cuda


def _args(**over):
    a = dict(q=torch.zeros(8, 12, 576, dtype=torch.bfloat16),
             kv_cache=torch.zeros(3, 64, 576, dtype=torch.bfloat16),
             block_table=torch.zeros(2, 2, dtype=torch.int32),
             seq_lens=torch.zeros(2, dtype=torch.int32), d_v=512)
    a.update(over)
    return a


def test_bad_schedule_is_named_before_anything_runs():
    a = _args()
    with pytest.raises(ValueError, match=r"schedule 'fast' is not one of \['pair', 'shared'\]"):
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

