"""Speculative decoding through the runtime, end to end (k3trt/runtime/spec_step.py + loop.py).

- Greedy speculative output equals greedy plain output token for token for every drafter (n-gram,
  a draft model with other weights, the target as its own draft, MTP), on mixed batches (plain
  argmax rows, a logits processor and penalties that must count the drafts before each row, an
  opted-out request, max_tokens 1) with arrivals mid-flight and forced preemption.
- Rollback: after rejections the slot's KDA state is the state of a run that never saw the
  rejected tokens: bitwise against the same verify step with the right drafts in their place, and
  within fp32 rounding against plain decoding (see test_rollback_* for why not bitwise there).
- Seeded speculative sampling is reproducible; stats; a drafter fault ends only its request.
Every test ends with all blocks, slots and drafter state released."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from runtime_utils import assert_no_leak, assert_released, prompts

from k3trt.engine.capacities import Capacities
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.runtime.kv_cache import CacheManager, CachePlan
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.request import Request, Status
from k3trt.runtime.scheduler import Scheduler, SchedulerConfig
from k3trt.runtime.speculative import Drafter, Proposal
from k3trt.testing import assert_close

MAX_TOKENS = 14      # a random MoE model is chaotic: long runs let fp32 rounding (batch shapes) flip tokens


@pytest.fixture(scope="module")
def draft_ckpt(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("draft") / "tiny-seed1", seed=1)


def periodic(out: list[int], row: torch.Tensor) -> torch.Tensor:
    """After 4 free tokens, repeat the token 4 back: the output turns periodic, so n-gram drafts get
    accepted, and a row that saw the wrong history (drafts not counted) would pick another token."""
    if len(out) >= 4:
        forced = torch.full_like(row, float("-inf"))
        forced[out[-4]] = 0.0
        return forced
    return row


PLAIN = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
MIX = [PLAIN, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logits_processors=(periodic,)),
       SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
       SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logits_processors=(periodic,), logprobs=2),
       SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, speculative=False),
       SamplingParams(max_tokens=1, ignore_eos=True)]
LENGTHS = [20, 18, 22, 19, 6, 12]
ARRIVE = [0, 0, 0, 2, 3, 5]              # the step each request is added at


def drive(llm: LLM, ps, params, arrive) -> list:
    """Add request i at step arrive[i]; step until all finish; outputs in request order."""
    ids, done, step = {}, {}, 0
    while len(done) < len(ps):
        for i, a in enumerate(arrive):
            if a == step:
                ids[llm.add_request(ps[i], params[i])] = i
        for out in llm.step():
            if out.finished:
                done[ids[out.request_id]] = out
        step += 1
        assert step < 500, "no progress"
    return [done[i] for i in range(len(ps))]


@pytest.fixture(scope="module")
def baseline(engine):
    ps = prompts(21, LENGTHS)
    ps[1] = [5, 6, 7, 8] * 4 + [5, 6]            # repetitive prompts for the n-gram drafter
    ps[4] = [9, 10, 11] * 2
    llm = LLM(engine, verify_checksums=False)
    outs = llm.generate(ps, MIX)
    assert_no_leak(llm)
    return ps, outs


def spec_arg(name, engine, draft_ckpt) -> str:
    return {"ngram": "ngram", "draft": f"draft:{draft_ckpt}", "self": f"draft:{engine / 'rank0'}",
            "mtp": "mtp"}[name]


@pytest.mark.parametrize("name,k", [("ngram", 3), ("draft", 3), ("self", 7), ("mtp", 2)])
def test_greedy_equals_plain_decoding(engine, draft_ckpt, baseline, name, k):
    ps, want = baseline
    # 6 blocks of 16 for requests growing to 36 tokens: preemption is certain
    llm = LLM(engine, verify_checksums=False, speculative=spec_arg(name, engine, draft_ckpt), spec_tokens=k,
              num_blocks=6, max_model_len=64)
    outs = drive(llm, ps, MIX, ARRIVE)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.finish_reason == "length", (i, o.error)
        assert o.token_ids == w.token_ids, f"request {i} ({name})"
        if w.logprobs is not None:
            assert [set(a) for a in o.logprobs] == [set(b) for b in w.logprobs]
    assert llm.stats()["preemptions"] > 0
    spec = llm.stats()["speculative"]
    assert spec["method"] == ("ngram" if name == "ngram" else "mtp" if name == "mtp" else "draft")
    assert outs[4].stats["drafted_tokens"] == 0 and outs[5].stats["drafted_tokens"] == 0  # opted out; 1 token
    assert sum(o.stats["drafted_tokens"] for o in outs) > 0
    assert sum(o.stats["accepted_tokens"] for o in outs) <= spec["accepted_tokens"]   # preempted runs count too
    if name == "ngram":      # the periodic requests are drafted right
        assert outs[1].stats["accepted_tokens"] > 0 and outs[3].stats["accepted_tokens"] > 0
    if name == "self":       # the target drafting for itself: every draft of the plain argmax request passes
        assert outs[0].stats["acceptance_rate"] == 1.0 and outs[0].stats["accepted_length_histogram"]
    assert_released(llm)


def test_stats_per_request_and_aggregate(engine):
    llm = LLM(engine, verify_checksums=False, speculative=f"draft:{engine / 'rank0'}", spec_tokens=3)
    outs = llm.generate(prompts(4, [7, 11]), SamplingParams(max_tokens=9, ignore_eos=True))
    agg = llm.stats()["speculative"]
    assert agg["spec_tokens"] == 3 and agg["drafted_tokens"] == sum(o.stats["drafted_tokens"] for o in outs)
    for o in outs:
        s = o.stats
        # 8 tokens after the prefill's: full blocks of 3 + 1, then the remainder
        assert s["acceptance_rate"] == 1.0 and s["accepted_length_histogram"] == {3: 2}
        assert s["mean_accepted_length"] == 4.0 and s["drafted_tokens"] == 6
    assert_released(llm)


# ------------------------------------------------------------------------------------ rollback
class Scripted(Drafter):
    """Proposes ref's continuation of the history with the draft at `wrong` replaced: the verify step
    accepts exactly `wrong` drafts and rolls back past them."""
    name = "scripted"

    def __init__(self, prompt_len: int, ref: list[int], wrong: int | None):
        self.prompt_len, self.ref, self.wrong = prompt_len, ref, wrong

    def propose(self, inputs, k):
        out = []
        for inp in inputs:
            at = len(inp.token_ids) - self.prompt_len
            d = self.ref[at:at + inp.limit(k)]
            if self.wrong is not None and len(d) > self.wrong:
                d = d[:self.wrong] + [(d[self.wrong] + 1) % 1000]
            out.append(list(d))
        return Proposal(out, [None] * len(out))


def kda_state(llm: LLM, req) -> list[torch.Tensor]:
    c = llm.session.cache.kda
    return [t.clone() for layer in c.values() for t in (layer.state[req.kda_slot], layer.conv[req.kda_slot])]


def states_by_length(llm: LLM, prompt, params, drafter=None) -> dict[int, list[torch.Tensor]]:
    """{committed length: the slot's KDA state and conv window} after every step of one request."""
    if drafter is not None:
        llm.spec.drafter = drafter
    rid = llm.add_request(prompt, params)
    req, seen = llm.loop.requests[rid], {}
    while llm.has_unfinished():
        llm.step()
        if not req.finished and req.decoding:
            seen[req.num_computed] = kda_state(llm, req)
    return seen


def test_rollback_restores_the_state_without_rejected_tokens(engine):
    """Why not bitwise against a run that never saw the rejected tokens: such a run has other step
    shapes, and on the CPU a row's result depends on the shape around it (BLAS rounds a 1-row matmul
    differently from a 4-row one; the MoE runs each expert over the tokens routed to it, so the
    rejected rows change the matmul sizes of the kept ones). So: (1) the rollback itself is exact
    (the slot holds bitwise the state after the last kept row of the verify step, not the state
    after the rejected rows), and (2) that state equals the state of plain decoding (one row per
    step, never a rejected token) and of a verify step with the right drafts, to fp32 rounding."""
    p = prompts(31, [13])[0]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain_llm = LLM(engine, verify_checksums=False, prefix_caching=False)
    ref = plain_llm.generate([p], params)[0].token_ids
    plain = states_by_length(plain_llm, p, params)

    def first_verify(wrong):
        """(slot state after the step, states after rows 1 and 3 of the verify step)"""
        llm = LLM(engine, verify_checksums=False, speculative="ngram", spec_tokens=3, prefix_caching=False)
        llm.spec.drafter = Scripted(len(p), ref, wrong)
        rid = llm.add_request(p, params)
        req = llm.loop.requests[rid]
        llm.step()                                   # prefill: the first token
        llm.step()                                   # verify [t0, d1, d2, d3]
        assert req.stats.accepted == (3 if wrong is None else wrong) and req.num_computed == len(p) + 1 + (
            3 if wrong is None else wrong)
        rows = [[t.clone() for layer in llm.session.cache.kda.values()
                 for t in (layer.step_state[req.kda_slot, j], layer.step_conv[req.kda_slot, j])] for j in (1, 3)]
        state = kda_state(llm, req)
        llm.abort(rid)
        assert_released(llm)
        return state, *rows

    rolled, after1, after3 = first_verify(wrong=1)
    assert all(torch.equal(a, b) for a, b in zip(rolled, after1)), "the slot is not the state after row 1"
    assert not all(torch.equal(a, b) for a, b in zip(rolled, after3)), "the rejected rows were kept"
    _, right1, _ = first_verify(wrong=None)
    for i, (a, b) in enumerate(zip(rolled, right1)):
        assert_close(a.float(), b.float(), name=f"tensor {i} vs the right drafts")

    # rejections at every position of every step, against plain decoding at each committed length
    for wrong in (0, 1, 2):
        llm = LLM(engine, verify_checksums=False, speculative="ngram", spec_tokens=3, prefix_caching=False)
        spec = states_by_length(llm, p, params, Scripted(len(p), ref, wrong))
        assert llm.stats()["speculative"]["accepted_tokens"] == wrong * llm.stats()["speculative"]["verify_steps"]
        assert set(spec) <= set(plain) and len(spec) >= 3
        for length, tensors in spec.items():
            for i, (a, b) in enumerate(zip(tensors, plain[length])):
                assert_close(a.float(), b.float(), name=f"length {length} tensor {i}")
        assert_released(llm)
    assert_no_leak(plain_llm)


# ------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_seeded_speculative_sampling_is_reproducible(engine, draft_ckpt, spec):
    ps = prompts(41, [9, 14, 5])
    ps[2] = [3, 4, 5, 3, 4, 5, 3, 4]
    params = [SamplingParams(max_tokens=12, temperature=t, top_p=tp, seed=s, ignore_eos=True)
              for t, tp, s in ((1.0, 1.0, 7), (0.7, 0.9, 8), (1.3, 1.0, 9))]
    arg = "ngram" if spec == "ngram" else f"draft:{draft_ckpt}"
    runs = []
    for _ in range(2):
        llm = LLM(engine, verify_checksums=False, speculative=arg, spec_tokens=3)
        runs.append([o.token_ids for o in llm.generate(ps, params)])
        assert_released(llm)
    assert runs[0] == runs[1]
    other = LLM(engine, verify_checksums=False, speculative=arg, spec_tokens=3)
    reseeded = [dataclasses.replace(p, seed=p.seed + 100) for p in params]
    assert [o.token_ids for o in other.generate(ps, reseeded)] != runs[0]
    if spec == "draft":
        assert other.stats()["speculative"]["drafted_tokens"] > 0


# ------------------------------------------------------------------------------------ faults
class Faulty(Drafter):
    """n-gram drafting that raises for any history holding the poison token."""
    name = "faulty"

    def __init__(self, inner, poison):
        self.inner, self.poison = inner, poison

    def propose(self, inputs, k):
        if any(self.poison in inp.token_ids for inp in inputs):
            raise RuntimeError("drafter exploded")
        return self.inner.propose(inputs, k)

    def release(self, request_id):
        self.inner.release(request_id)


def test_drafter_fault_ends_only_its_request(engine, baseline):
    ps, want = baseline
    llm = LLM(engine, verify_checksums=False, speculative="ngram", spec_tokens=3)
    llm.spec.drafter = Faulty(llm.spec.drafter, poison=99999)
    outs = llm.generate([ps[0], [99999, 3, 4], ps[1]], [MIX[0], PLAIN, MIX[1]])
    assert outs[1].finish_reason == "error" and "drafter exploded" in outs[1].error
    assert outs[0].token_ids == want[0].token_ids and outs[2].token_ids == want[1].token_ids
    assert_released(llm)


def test_options_are_checked(engine):
    with pytest.raises(ValueError, match="1..7"):
        LLM(engine, verify_checksums=False, speculative="ngram", spec_tokens=8)
    with pytest.raises(ValueError, match="unknown --speculative"):
        LLM(engine, verify_checksums=False, speculative="nonsense")
    with pytest.raises(ValueError, match="max_num_tokens"):      # 4 requests x 8 rows > 16 tokens
        LLM(engine, verify_checksums=False, speculative="ngram", spec_tokens=7, max_num_tokens=16)


def test_drafts_go_before_anyone_is_preempted():
    """The scheduler drops a request's drafts when its blocks cannot grow, before preempting anyone."""
    cache = CacheManager(CachePlan(16, 3, 2, 0, 1, 1), hybrid=True, prefix_caching=False)   # 3 blocks of 16
    s = Scheduler(SchedulerConfig(max_num_tokens=32, capacities=Capacities((1, 2), (1, 16, 32), 3),
                                  max_model_len=48, prefix_caching=False), cache)
    reqs = [Request(f"r{i}", i, list(range(1, 15)), SamplingParams(max_tokens=8)) for i in range(2)]
    for r in reqs:
        s.add(r)
    assert len(s.schedule().prefills) == 2
    for r in reqs:                  # 14 prompt tokens cached in one block each, one token sampled
        r.num_computed, r.token_ids = 14, r.token_ids + [5]
        r.set_drafts([6, 7, 8])     # rows at positions 14..17: a second block each, one is free
    plan = s.schedule()
    assert not plan.preempted and plan.decodes == reqs and [r.status for r in reqs] == [Status.RUNNING] * 2
    assert reqs[0].drafts == [6, 7, 8] and len(reqs[0].blocks) == 2      # the older one got the block
    assert reqs[1].drafts == [] and len(reqs[1].blocks) == 1              # the newer one decodes plainly
