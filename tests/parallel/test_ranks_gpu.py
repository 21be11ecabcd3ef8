"""The multi-rank runtime on 2 GPUs (NCCL): the eager steps equal one GPU's greedy tokens in fp32,
decode / verify steps captured as CUDA graphs with the NCCL collectives inside equal the eager
steps in bf16, and a killed rank, or one that hangs while the others replay a graph, stops the
engine within its timeout. Needs 2 GPUs (nvidia-h100-x2 / nvidia-h200-x2); skipped on one:
``python -m pytest -q -m gpu tests/parallel/test_ranks_gpu.py``.
"""

import os
import signal
import time

import pytest
import torch
from runtime_utils import assert_released, build_tiny_engine, prompts

from k3trt.runtime.graphs import GraphSession
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.ranks import RankFailure

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h100-x2)")]

PROMPTS = prompts(7, [40, 9, 23], vocab=2000)


def _tokens(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def engines(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-engines")
    return {dt: build_tiny_engine(tiny_ckpt, d / dt, dtype=dt) for dt in ("fp32", "bf16")}


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, dcp=2, ep=2)])
def test_two_gpus_equal_one_in_fp32(engines, layout):
    one = LLM(engines["fp32"], device="cuda:0", verify_checksums=False)
    want = _tokens(one)
    one.close()
    llm = LLM(engines["fp32"], device="cuda:0", verify_checksums=False, **layout)
    try:
        assert _tokens(llm) == want
        assert_released(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_graphs_with_collectives_equal_eager(engines, spec):
    kw = dict(device="cuda:0", verify_checksums=False, tp=2, dcp=2, ep=2, speculative=spec,
              spec_tokens=2 if spec != "none" else None)
    eager = LLM(engines["bf16"], cuda_graphs=False, **kw)
    want = _tokens(eager)
    eager.close()
    llm = LLM(engines["bf16"], **kw)        # graphs by default in bf16 on CUDA
    try:
        assert _tokens(llm) == want
        assert llm.stats()["graphs"].get("graph", 0) > 0
        assert_released(llm)
    finally:
        llm.close()


def test_killed_rank_on_nccl_stops_the_engine(engines):
    llm = LLM(engines["bf16"], device="cuda:0", verify_checksums=False, tp=2, rank_timeout_s=20)
    for p in PROMPTS:
        llm.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True))
    llm.step()
    os.kill(llm.session.group.procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1"):
        for _ in range(400):
            llm.step()
    assert time.monotonic() - t0 < 60
    assert not llm.health()["ok"]
    llm.close()
    assert not any(r["alive"] for r in llm.health()["ranks"][1:])


def hang_in_third_graph_verify(rank):
    """rank_init: rank 1's third verify step (a graph replay) never starts."""
    if rank != 1:
        return
    calls, verify = [0], GraphSession.verify

    def patched(self, batch, device_ids=None, shift=None):
        calls[0] += 1
        if calls[0] == 3:
            time.sleep(3600)
        return verify(self, batch, device_ids, shift)
    GraphSession.verify = patched


def test_rank_hanging_in_a_graph_step_stops_the_engine(engines):
    """A replayed graph's NCCL kernels are outside the watchdog: rank 0's wait for the step
    (ranks.py settle) aborts the communicators at rank_timeout_s and stops the engine."""
    llm = LLM(engines["bf16"], device="cuda:0", verify_checksums=False, tp=2, rank_timeout_s=10,
              rank_init=hang_in_third_graph_verify)
    for p in PROMPTS:
        llm.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True))
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="hung or is slower than rank_timeout_s=10"):
        for _ in range(400):
            llm.step()
    assert time.monotonic() - t0 < 60
    assert llm.stats()["graphs"].get("graph", 0) > 0
    llm.close()
    assert not any(r["alive"] for r in llm.health()["ranks"][1:])
