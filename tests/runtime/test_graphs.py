"""The padded static decode / verify steps (k3trt/runtime/graphs.py) without capture, on the CPU:
greedy output equals the eager session's token for token, with and without drafts, with requests
arriving mid-flight (batches padded to a larger capacity) and uneven draft counts (eager fallback).
The captured CUDA graphs themselves are checked on the GPU (test_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from k3trt.runtime.engine import make_batch, Seq
from k3trt.runtime.graphs import Layout
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from runtime_utils import assert_released, prompts

LENGTHS = [5, 9, 3, 14, 7]


def test_layout_pads_every_field():
    seqs = [Seq([4, 5], 10, [3, 7], 2, 2), Seq([6, 8], 0, [1], 0, 2)]
    batch = make_batch(seqs, 16, capacity=4)
    L = Layout(S=4, Q=2, max_blocks=5)
    buf = torch.full((L.size,), 99, dtype=torch.int64)
    L.pack(batch, spare_slot=9, out=buf)
    v = L.views(buf)
    assert v["input_ids"].tolist() == [4, 5, 6, 8, 0, 0, 0, 0]
    assert v["slot_mapping"].tolist() == [3 * 16 + 10, 3 * 16 + 11, 16, 17, -1, -1, -1, -1]
    assert v["positions"].tolist() == [10, 11, 0, 1, 0, 0, 0, 0]
    assert v["kda_slots"].tolist() == [2, 0, 9, 9]
    assert v["seq_lens"].tolist() == [12, 2, 0, 0]
    assert v["fresh"].tolist() == [0, 1, 1, 1]
    assert v["block_table"].tolist() == [[3, 7, 0, 0, 0], [1, 0, 0, 0, 0], [0] * 5, [0] * 5]
    with pytest.raises(ValueError, match="cannot hold"):
        Layout(S=1, Q=2, max_blocks=5).pack(batch, 9, buf)
    # uneven rows: each sequence padded at its end
    ragged = make_batch([Seq([4], 10, [3], 2, 1), Seq([6, 8, 9], 0, [1], 0, 3)], 16, capacity=2)
    L = Layout(S=2, Q=4, max_blocks=2)
    buf = torch.full((L.size,), 99, dtype=torch.int64)
    assert L.pack(ragged, 9, buf).tolist() == [0, 4, 5, 6]
    v = L.views(buf)
    assert v["input_ids"].tolist() == [4, 0, 0, 0, 6, 8, 9, 0]
    assert v["slot_mapping"].tolist() == [58, -1, -1, -1, 16, 17, 18, -1]
    assert v["seq_lens"].tolist() == [14, 4]          # row j sees ctx + j + 1: the real rows their own
    assert v["positions"].tolist() == [10, 11, 12, 13, 0, 1, 2, 3]


@pytest.fixture(scope="module")
def plain(engine):
    llm = LLM(engine, verify_checksums=False)
    ps = prompts(5, LENGTHS)
    outs = llm.generate(ps, SamplingParams(max_tokens=9))
    return ps, [o.token_ids for o in outs]


@pytest.mark.parametrize("spec", ["none", "mtp", "ngram"])
def test_static_steps_equal_eager(engine, plain, spec):
    ps, want = plain
    kw = {} if spec == "none" else dict(speculative=spec, spec_tokens=3)
    llm = LLM(engine, verify_checksums=False, cuda_graphs=True, **kw)
    ids, done = {}, {}

    def collect(outs):
        for o in outs:
            if o.finished:
                done[ids[o.request_id]] = o.token_ids

    for i, p in enumerate(ps):               # arrivals over the first steps: live counts 1..5 pad to 2/4/8
        ids[llm.add_request(p, SamplingParams(max_tokens=9))] = i
        collect(llm.step())
    while llm.has_unfinished():
        collect(llm.step())
    assert [done[i] for i in range(len(ps))] == want
    stats = llm.session.graph_stats
    assert stats["static"] > 0, stats
    # uneven draft counts (max_tokens cuts MTP's; n-gram finds few) pad within the static steps
    assert stats["eager"] == 0, stats
    assert_released(llm)
