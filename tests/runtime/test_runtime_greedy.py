"""Greedy runtime output equals full recompute with the model, under batching, mid-flight arrivals,
chunked prefill and preemption; every test ends with all blocks and slots free."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from runtime_utils import Oracle, assert_no_leak, prompts

GREEDY = dict(ignore_eos=True)     # a random model may emit EOS; the oracle does not stop


@pytest.fixture(scope="module")
def oracle(tiny_model):
    cfg, model = tiny_model
    return Oracle(model, cfg)


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]
    max_tokens: int = 10
    options: dict = field(default_factory=dict)


CASES = [
    Case("mixed_lengths", (3, 17, 40, 5)),
    # 50 > max_num_tokens: the prompt is prefilled in chunks; without prefix caching the chunk
    # ends fall inside blocks (20, 40), with it they are moved to block boundaries (16, 32, 48)
    Case("chunks_unaligned", (50, 9), options=dict(max_num_tokens=20, prefix_caching=False)),
    Case("chunks_aligned", (50, 9), options=dict(max_num_tokens=20)),
    Case("one_token_prompt", (1, 2), max_tokens=20),
    Case("more_requests_than_slots", (5, 6, 7, 8, 9, 10, 11), max_tokens=6),
    Case("bigger_batch_across_block_ends", (14, 15, 16, 31), max_tokens=6),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_equals_full_recompute(engine, oracle, case):
    llm = LLM(engine, verify_checksums=False, **case.options)
    ps = prompts(sum(map(ord, case.name)), list(case.lengths))
    outs = llm.generate(ps, SamplingParams(max_tokens=case.max_tokens, **GREEDY))
    for p, out in zip(ps, outs):
        assert out.token_ids == oracle(p, case.max_tokens), f"prompt of {len(p)} tokens"
        assert out.finish_reason == "length"
    hits = llm.stats()["capacity_hits"]
    assert set(hits["verify"]) <= set(llm.config.capacities.verify)
    assert set(hits["prefill"]) <= set(llm.config.capacities.prefill)
    assert_no_leak(llm)


def test_arrivals_mid_flight(engine, oracle):
    llm = LLM(engine, verify_checksums=False, max_num_tokens=24)
    ps = prompts(7, [12, 30, 4, 21, 9])
    params = SamplingParams(max_tokens=8, **GREEDY)
    done = {}

    def run(steps):
        for _ in range(steps):
            for out in llm.step():
                if out.finished:
                    done[out.request_id] = out

    ids = [llm.add_request(ps[0], params), llm.add_request(ps[1], params)]
    run(3)                                  # the first two are mid-prefill / decoding
    ids += [llm.add_request(p, params) for p in ps[2:4]]
    run(4)
    ids.append(llm.add_request(ps[4], params))
    while llm.has_unfinished():
        run(1)
    for p, rid in zip(ps, ids):
        assert done[rid].token_ids == oracle(p, 8)
    assert_no_leak(llm)


def test_forced_preemption(engine, oracle):
    # 4 requests growing to 44 tokens need 12 blocks of 16; the pool has 6
    llm = LLM(engine, verify_checksums=False, num_blocks=6, max_model_len=64)
    ps = prompts(3, [20, 18, 22, 19])
    outs = llm.generate(ps, SamplingParams(max_tokens=24, **GREEDY))
    assert llm.stats()["preemptions"] > 0
    assert sum(o.stats["preemptions"] for o in outs) > 0
    for p, out in zip(ps, outs):
        assert out.token_ids == oracle(p, 24)
    assert_no_leak(llm)


def test_max_model_len_ends_with_length(engine, oracle):
    llm = LLM(engine, verify_checksums=False, max_model_len=20)
    p = prompts(5, [15])[0]
    out = llm.generate([p], SamplingParams(max_tokens=50, **GREEDY))[0]
    assert out.token_ids == oracle(p, 5) and out.finish_reason == "length"
    assert_no_leak(llm)
