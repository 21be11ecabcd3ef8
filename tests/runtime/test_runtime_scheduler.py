"""Scheduler, block pool, KDA slots and the planner on fake requests (no model): chunking, budgets,
capacities, FCFS, preemption, prefix hits, and exact block accounting under random traffic."""

from __future__ import annotations

import random

import pytest
import torch

from k3trt.config import ModelConfig
from k3trt.model.presets import preset_config
from k3trt.runtime.kv_cache import BlockPool, CacheManager, CachePlan, KDASlots, plan_cache
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.request import Request, Status
from k3trt.engine.capacities import Capacities, CapacityError
from k3trt.runtime.scheduler import Scheduler, SchedulerConfig

BS = 16


def make(num_blocks=64, max_batch=4, max_num_tokens=32, prefix_caching=True, checkpoints=4,
         prefill=(1, 16, 32), hybrid=True):
    verify = tuple(c for c in (1, 2, 4, 8) if c <= max_batch)
    plan = CachePlan(BS, num_blocks, verify[-1], checkpoints, 1, 1)
    cache = CacheManager(plan, hybrid=hybrid, prefix_caching=prefix_caching)
    cfg = SchedulerConfig(max_num_tokens=max_num_tokens, capacities=Capacities(verify, prefill, 0),
                          max_model_len=num_blocks * BS, prefix_caching=prefix_caching, hybrid=hybrid)
    return Scheduler(cfg, cache)


_ids = iter(range(10**9))


def req(n, start=1, max_tokens=4):
    return Request(f"r{next(_ids)}", 0, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def fake_step(s: Scheduler):
    """Schedule, then commit as the loop does (every sampled token is 0); returns the plan."""
    plan = s.schedule()
    s.cache.copies.clear()
    for r in plan.decodes:
        r.num_computed = len(r.token_ids)
        r.token_ids.append(0)
        s.cache.commit(r)
    for c in plan.prefills:
        c.req.num_computed += c.num_tokens
        if c.completes:
            c.req.token_ids.append(0)
        s.cache.commit(c.req)
    for r in list(s.running):
        if r.num_output >= r.params.max_tokens:
            s.remove(r)
            s.cache.free(r)
            r.status = Status.FINISHED
    return plan


@pytest.mark.parametrize("prefix_caching,chunks", [(True, [16, 16, 16, 2]), (False, [20, 20, 10])])
def test_chunk_ends(prefix_caching, chunks):
    s = make(max_num_tokens=20, prefill=(1, 16, 20), prefix_caching=prefix_caching)
    r = req(50)
    s.add(r)
    got = []
    while not r.decoding:
        got += [c.num_tokens for c in fake_step(s).prefills]
    assert got == chunks


def test_budget_and_capacities():
    s = make(max_num_tokens=8, prefill=(1, 4, 8))
    old = [req(3, max_tokens=8) for _ in range(3)]
    for r in old:
        s.add(r)
    plan = fake_step(s)                            # 3 + 3 + 2 tokens: the third waits for budget
    assert [c.num_tokens for c in plan.prefills] == [3, 3, 2] and plan.prefill_capacity == 8
    plan = fake_step(s)
    assert len(plan.decodes) == 2 and [c.num_tokens for c in plan.prefills] == [1]
    assert plan.verify_capacity == 2 and plan.prefill_capacity == 1
    late = req(20)
    s.add(late)
    plan = fake_step(s)                            # decode rows count first: 8 - 3 for the prefill
    assert plan.verify_capacity == 4 and len(plan.decodes) == 3
    assert [c.num_tokens for c in plan.prefills] == [5] and plan.prefill_capacity == 8


def test_config_checks_capacities():
    with pytest.raises(CapacityError, match="ascending"):
        SchedulerConfig(max_num_tokens=8, capacities=Capacities((2, 1), (1, 8), 0), max_model_len=64)
    with pytest.raises(CapacityError, match="max_num_tokens"):
        SchedulerConfig(max_num_tokens=4, capacities=Capacities((1, 2, 4), (1, 4), 1), max_model_len=64)


def test_admission_is_first_come_first_served():
    s = make(max_batch=1)
    rs = [req(5, max_tokens=2), req(30, max_tokens=2), req(2, max_tokens=2)]
    for r in rs:
        s.add(r)
    order = []
    while s.has_work:
        for c in fake_step(s).prefills:
            if c.req not in order:
                order.append(c.req)
    assert order == rs


def test_preemption_takes_the_newest():
    s = make(num_blocks=5, max_batch=4, max_num_tokens=64, prefill=(1, 16, 32, 64))
    rs = [req(15, start=100 * i, max_tokens=40) for i in range(4)]
    for r in rs:
        s.add(r)
    preempted = []
    while not preempted:
        preempted = fake_step(s).preempted
    assert preempted[0] is rs[-1]
    assert list(s.waiting) == [r for r in rs if r in s.waiting]     # resumed in arrival order
    assert all(r.blocks == [] and r.kda_slot is None and r.num_computed == 0 for r in s.waiting)
    while s.has_work:
        fake_step(s)
    assert s.cache.usage()["blocks_in_use"] == 0


def test_prefills_holding_the_pool_do_not_deadlock():
    # aligned chunk ends leave budget for a second prefill, which then holds the blocks the first
    # one needs: the newer one is preempted instead of both waiting forever
    s = make(num_blocks=5, max_batch=2, max_num_tokens=40, prefill=(1, 16, 32, 40))
    r1, r2 = req(70, max_tokens=2), req(70, start=500, max_tokens=2)
    s.add(r1)
    s.add(r2)
    preempted, steps = [], 0
    while s.has_work:
        plan = fake_step(s)
        assert not plan.empty, "no progress"
        preempted += plan.preempted
        steps += 1
    assert preempted and preempted[0] is r2 and steps < 20
    assert s.cache.usage()["blocks_in_use"] == 0


def test_prefix_hit_needs_a_checkpoint():
    for checkpoints, cached in ((4, 32), (0, 0)):
        s = make(checkpoints=checkpoints)
        a = req(40)
        s.add(a)
        while a.status is not Status.FINISHED:
            fake_step(s)
        b = req(40)
        s.add(b)
        fake_step(s)
        assert b.stats.cached_tokens == cached


def test_block_pool_and_slots():
    pool = BlockPool(3)
    a, _ = pool.allocate()
    pool.register(a, b"h")
    pool.release(a)
    assert pool.num_free == 3 and pool.by_hash[b"h"] == a
    pool.share(a)
    assert pool.num_free == 2 and pool.ref[a] == 1
    pool.release(a)
    got = [pool.allocate() for _ in range(3)]
    assert (a, b"h") in got and b"h" not in pool.by_hash      # evicted last, hash forgotten
    slots = KDASlots(max_live=2, num_checkpoints=2)
    assert sorted([slots.take(), slots.take()]) == [0, 1]
    c1, c2 = slots.reserve(b"x"), slots.reserve(b"y")
    assert {c1, c2} == {2, 3}
    assert slots.lookup(b"x") == c1
    assert slots.reserve(b"z") == c2                           # y was least recently used
    slots.drop(b"x")
    assert slots.reserve(b"w") == c1


def test_plan_cache():
    cfg = ModelConfig.from_dict(preset_config("tiny", 1024))
    plan = plan_cache(cfg, budget_bytes=1 << 20, block_size=16, max_live=4, max_model_len=64,
                      kv_dtype=torch.bfloat16, state_dtype=torch.float32, num_checkpoints=2)
    row = cfg.mla_cache_dim * 2
    assert plan.bytes_per_block == len(cfg.mla_layers) * 16 * row
    assert plan.num_blocks == 4 * 4 + 2 * 4            # capped at what live requests can use
    assert plan.total_bytes <= 1 << 20
    with pytest.raises(ValueError, match="max_model_len"):
        plan_cache(cfg, budget_bytes=1 << 16, block_size=16, max_live=4, max_model_len=4096,
                   kv_dtype=torch.bfloat16, state_dtype=torch.float32)
    slots = plan_cache(cfg, budget_bytes=1 << 20, block_size=16, max_live=4, max_model_len=64, kv_dtype=torch.bfloat16,
                       state_dtype=torch.float32, max_q=4).bytes_per_slot * 4
    with pytest.raises(ValueError, match=r"KDA states of 4 slots \(5 states each\).*lower the batch or K"):
        plan_cache(cfg, budget_bytes=slots - 1, block_size=16, max_live=4, max_model_len=64,
                   kv_dtype=torch.bfloat16, state_dtype=torch.float32, max_q=4)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_exact_accounting(seed):
    rng = random.Random(seed)
    s = make(num_blocks=rng.choice([6, 10, 40]), max_batch=rng.choice([1, 2, 4]),
             max_num_tokens=rng.choice([8, 20, 32]), prefix_caching=rng.random() < 0.7)
    shared = list(range(1, 40))
    reqs = []
    for step in range(5000):
        if step < 150 and rng.random() < 0.3:
            n = rng.randint(1, 60)
            toks = shared[:n] if rng.random() < 0.5 else [rng.randint(1, 999) for _ in range(n)]
            r = Request(f"q{len(reqs)}", 0, toks, SamplingParams(max_tokens=rng.randint(1, 30)))
            reqs.append(r)
            s.add(r)
        plan = fake_step(s)
        assert len(plan.decodes) <= s.config.max_batch
        assert sum(c.num_tokens for c in plan.prefills) + len(plan.decodes) <= s.config.max_num_tokens
        held = [b for r in s.running for b in r.blocks]
        refs = [0] * s.cache.pool.num_blocks
        for b in held:
            refs[b] += 1
        assert refs == s.cache.pool.ref
        for r in s.running:
            assert len(r.blocks) * BS >= r.num_computed
        if step > 150 and not s.has_work:
            break
    assert all(r.status is Status.FINISHED for r in reqs)
    assert s.cache.usage()["blocks_in_use"] == 0 and s.cache.free_slots == s.config.max_batch
