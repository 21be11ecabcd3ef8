"""One step ahead and overlapped speculation on the GPU under CUDA graph capture (marked gpu; run on
the H200): the same engine and steps with and without launching ahead give the same tokens (seeded
sampling drawn on the device; greedy speculation accepted on the device, where the batches match),
and the launches happen."""

from __future__ import annotations

import pytest
from runtime_utils import assert_released, build_tiny_engine, prompts
from test_spec_ahead import DeviceTableDrafter, TableDrafter

from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams

pytestmark = pytest.mark.gpu

LENGTHS = [6, 11, 30, 4]


@pytest.fixture(scope="module")
def bf16_engine(tiny_ckpt, tmp_path_factory):
    return build_tiny_engine(tiny_ckpt, tmp_path_factory.mktemp("gpu") / "engine", dtype="bf16", max_num_tokens=64)


def test_sampled_ahead_equals_synchronous_on_the_gpu(bf16_engine):
    ps = prompts(3, LENGTHS)
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=0.95, seed=s, ignore_eos=True)
              for t, s in ((1.0, 1), (0.8, 2), (1.2, 3), (0.0, None))]
    runs = []
    for ahead in (False, True):
        llm = LLM(bf16_engine, verify_checksums=False, device="cuda", cuda_graphs=True, prefix_caching=False)
        llm.loop.lookahead.possible = ahead
        runs.append([o.token_ids for o in llm.generate(ps, params)])
        assert (llm.stats()["launched_ahead"] > 0) == ahead
        assert llm.stats()["graphs"]["graph"] > 0
        assert_released(llm)
    assert runs[0] == runs[1]


def test_overlapped_speculation_on_the_gpu(bf16_engine):
    ps = prompts(3, LENGTHS)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = LLM(bf16_engine, verify_checksums=False, device="cuda", cuda_graphs=True, prefix_caching=False)
    want = [o.token_ids for o in ref.generate(ps, params)]
    runs = []
    for drafter in (TableDrafter, DeviceTableDrafter):       # host drafts only: every step synchronous
        llm = LLM(bf16_engine, verify_checksums=False, device="cuda", cuda_graphs=True, prefix_caching=False,
                  speculative="ngram", spec_tokens=3, adaptive_k=False)
        llm.spec.drafter = drafter(want, llm.vocab_size, wrong=7, device="cuda")
        runs.append([o.token_ids for o in llm.generate(ps, params)])
        assert (llm.stats()["launched_ahead"] > 0) == (drafter is DeviceTableDrafter)
        spec = llm.stats()["speculative"]
        assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"]
        assert_released(llm)
    # bf16 on the GPU: a step launched ahead still holds rows of requests that just ended, and other
    # batch shapes round the MoE apart, so the runs are compared where their batches are alike
    assert all(len(a) == len(b) == 24 and a[:12] == b[:12] == w[:12] for a, b, w in zip(*runs, want))


def test_mtp_drafted_on_the_device_on_the_gpu(bf16_engine):
    """MTP drafting on the device (mtp_ahead.py) against the MTP drafter on the host, on the same
    graph session: the launches happen and the tokens agree where the batches match."""
    ps = prompts(3, LENGTHS)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(bf16_engine, verify_checksums=False, device="cuda", cuda_graphs=True, prefix_caching=False,
              speculative="mtp", spec_tokens=3, adaptive_k=False)
    both = llm.spec.drafter
    runs = []
    for drafter in (both.inner, both):
        llm.spec.drafter = drafter
        before = llm.stats()["launched_ahead"]
        runs.append([o.token_ids for o in llm.generate(ps, params)])
        assert (llm.stats()["launched_ahead"] > before) == (drafter is both)
        assert_released(llm)
    assert all(len(a) == len(b) == 24 and a[:12] == b[:12] for a, b in zip(*runs))
