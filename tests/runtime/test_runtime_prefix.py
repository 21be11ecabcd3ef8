"""Prefix caching on the hybrid model: a hit restores MLA blocks and the KDA state checkpointed at
a block boundary, and gives the same tokens as a miss; without a checkpoint the hit is refused."""

from __future__ import annotations

import logging

import pytest

from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from runtime_utils import BLOCK, Oracle, assert_no_leak, prompts

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(tiny_model):
    cfg, model = tiny_model
    return Oracle(model, cfg)


def test_hit_equals_miss(engine, oracle):
    llm = LLM(engine, verify_checksums=False)
    p = prompts(11, [40])[0]
    miss = llm.generate([p], PARAMS)[0]
    hit = llm.generate([p], PARAMS)[0]
    assert miss.stats["cached_tokens"] == 0
    # 39 tokens may come from the cache (one must be computed): two full blocks
    assert hit.stats["cached_tokens"] == 2 * BLOCK
    assert hit.token_ids == miss.token_ids == oracle(p, 8)
    assert_no_leak(llm)


def test_multi_turn_hit_uses_decode_checkpoints(engine, oracle):
    llm = LLM(engine, verify_checksums=False)
    p = prompts(12, [27])[0]
    first = llm.generate([p], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    # the next turn repeats the conversation so far: 57 tokens, boundaries 16, 32 (prompt) and
    # 48 (reached while decoding) were checkpointed
    turn2 = p + first.token_ids + prompts(13, [5])[0]
    out = llm.generate([turn2], PARAMS)[0]
    assert out.stats["cached_tokens"] == 3 * BLOCK
    assert out.token_ids == oracle(turn2, 8)
    assert_no_leak(llm)


def test_hit_without_checkpoint_is_refused(engine, oracle, caplog):
    llm = LLM(engine, verify_checksums=False, kda_checkpoints=0)
    p = prompts(14, [40])[0]
    llm.generate([p], PARAMS)
    with caplog.at_level(logging.INFO, logger="k3trt"):
        out = llm.generate([p], PARAMS)[0]
    assert out.stats["cached_tokens"] == 0
    assert "no KDA state checkpoint" in caplog.text
    assert out.token_ids == oracle(p, 8)
    assert_no_leak(llm)


def test_evicted_blocks_drop_their_checkpoints(engine, oracle):
    # a pool just big enough for one request: the second prompt evicts the first one's blocks
    llm = LLM(engine, verify_checksums=False, num_blocks=4, max_model_len=64, max_batch=1)
    a, b = prompts(15, [40, 40])
    llm.generate([a], PARAMS)
    llm.generate([b], PARAMS)
    out = llm.generate([a], PARAMS)[0]
    assert out.stats["cached_tokens"] < 2 * BLOCK
    assert out.token_ids == oracle(a, 8)
    assert len(llm.cache.slots.ckpt) <= llm.cache.slots.num_checkpoints
    assert set(llm.cache.slots.ckpt) <= set(llm.cache.pool.by_hash)
    assert_no_leak(llm)


def test_shared_prefix_in_one_batch(engine, oracle):
    llm = LLM(engine, verify_checksums=False)
    base = prompts(16, [33])[0]
    ps = [base + [5, 6, 7], base + [8, 9], base]
    llm.generate([base], PARAMS)
    outs = llm.generate(ps, PARAMS)
    assert all(o.stats["cached_tokens"] == 2 * BLOCK for o in outs)
    for p, o in zip(ps, outs):
        assert o.token_ids == oracle(p, 8)
    assert_no_leak(llm)
