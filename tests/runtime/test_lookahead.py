"""Decoding one step ahead (runtime/lookahead.py): greedy output equals the synchronous loop's
token for token, however requests end (max_tokens, a stop id mid-flight, abort) or arrive, with
prefix caching (block-boundary checkpoints) on and off; nothing leaks. On the CPU the graph
session runs its static padded steps uncaptured (cuda_graphs=True), which is where the device ids
go in; the GPU runs the same code under capture (tests/runtime/test_graphs_gpu.py's runtime test)."""

from __future__ import annotations

import dataclasses

import pytest
from runtime_utils import arrival_and_abort_while_ahead, assert_released, prompts

from k3trt.runtime import lookahead
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams

LENGTHS = [5, 30, 12, 3]
MAX_TOKENS = [20, 9, 14, 20]


@pytest.fixture(scope="module")
def reference(engine):
    """Each prompt alone through the synchronous loop (no static steps, so nothing runs ahead)."""
    llm = LLM(engine, verify_checksums=False, cuda_graphs=False)
    ps = prompts(11, LENGTHS)
    outs = [llm.generate([p], SamplingParams(max_tokens=n))[0].token_ids for p, n in zip(ps, MAX_TOKENS)]
    assert llm.stats()["launched_ahead"] == 0
    return ps, outs


def params(want: list[int], n: int, stop_at: int | None) -> SamplingParams:
    """max_tokens n; with stop_at, the token generated at that index ends the request (a stop id
    the host only sees after the next step was launched)."""
    stop = [want[stop_at]] if stop_at is not None and want[stop_at] not in want[:stop_at] else []
    return SamplingParams(max_tokens=n, stop_token_ids=stop)


def expected(want: list[int], p: SamplingParams) -> list[int]:
    for i, t in enumerate(want):
        if t in p.stop_token_ids:
            return want[:i + 1]
    return want


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_ahead_equals_synchronous(engine, reference, prefix_caching):
    ps, want = reference
    llm = LLM(engine, verify_checksums=False, cuda_graphs=True, prefix_caching=prefix_caching, block_size=16)
    ps_params = [params(w, n, 4 if i == 1 else None) for i, (w, n) in enumerate(zip(want, MAX_TOKENS))]
    outs = llm.generate(ps, ps_params)
    assert [o.token_ids for o in outs] == [expected(w, p) for w, p in zip(want, ps_params)]
    assert llm.stats()["launched_ahead"] > 0
    assert_released(llm)


def test_arrivals_and_abort_while_a_step_is_ahead(engine, reference):
    ps, want = reference
    llm = LLM(engine, verify_checksums=False, cuda_graphs=True, prefix_caching=False)
    arrival_and_abort_while_ahead(llm, ps, want, MAX_TOKENS, warm_steps=4)     # decoding, one step ahead


def test_a_failed_launch_ahead_loses_nothing(engine, reference, monkeypatch):
    """If launching ahead fails, the step's own tokens still commit and decoding goes on in step."""
    ps, want = reference
    llm = LLM(engine, verify_checksums=False, cuda_graphs=True, prefix_caching=False)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(lookahead, "launch_ahead", broken)
    outs = llm.generate(ps[:2], [SamplingParams(max_tokens=n) for n in MAX_TOKENS[:2]])
    assert [o.token_ids for o in outs] == want[:2]
    assert llm.stats()["launched_ahead"] == 0
    assert_released(llm)


# ------------------------------------------------------------------------------------ sampled
SAMPLED = [SamplingParams(max_tokens=16, temperature=1.0, seed=3),
           SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=50, seed=4, logprobs=2),
           SamplingParams(max_tokens=14),                                  # greedy beside them
           SamplingParams(max_tokens=12, temperature=1.2, min_p=0.05, seed=5)]


def sampled_run(engine, params, *, ahead: bool, arrive_late: bool = False):
    """The prompts through the static padded steps, one step ahead or synchronously (the same
    steps, so the logits are the same and only the launch order differs)."""
    llm = LLM(engine, verify_checksums=False, cuda_graphs=True, prefix_caching=False)
    llm.loop.lookahead.possible = ahead
    ps = prompts(11, LENGTHS)
    if not arrive_late:
        outs = llm.generate(ps, params)
    else:     # the last request arrives while a step is ahead
        ids, done = {}, {}
        for i in range(3):
            ids[llm.add_request(ps[i], params[i])] = i
        for n in range(500):
            if n == 6:
                assert not ahead or llm.loop.lookahead.launched is not None
                ids[llm.add_request(ps[3], params[3])] = 3
            done.update({ids[o.request_id]: o for o in llm.step() if o.finished})
            if not llm.has_unfinished():
                break
        outs = [done[i] for i in range(4)]
    assert_released(llm)
    return llm, outs


@pytest.mark.parametrize("arrive_late", [False, True])
def test_sampled_ahead_equals_synchronous_sampling(engine, arrive_late):
    """Seeded sampled requests draw their tokens on the device one step ahead, from the same
    generator stream as the synchronous loop: the same tokens and logprobs, token for token."""
    sync, want = sampled_run(engine, SAMPLED, ahead=False, arrive_late=arrive_late)
    llm, got = sampled_run(engine, SAMPLED, ahead=True, arrive_late=arrive_late)
    assert sync.stats()["launched_ahead"] == 0 and llm.stats()["launched_ahead"] > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        if w.logprobs is not None:     # a late arrival joins other batch shapes: fp32 rounding apart
            assert [set(a) for a in g.logprobs] == [set(b) for b in w.logprobs]
            assert all(abs(a[t] - b[t]) < 1e-4 for a, b in zip(g.logprobs, w.logprobs) for t in a)
    # the draws are random: another seed gives other tokens (the test can fail)
    other = [dataclasses.replace(p, seed=p.seed + 1) if p.seed is not None else p for p in SAMPLED]
    _, moved = sampled_run(engine, other, ahead=True)
    assert moved[0].token_ids != got[0].token_ids


def test_host_side_processing_keeps_the_step_synchronous(engine):
    """A penalty or a logits processor reads the committed tokens on the host: no step goes ahead."""
    ps = [SamplingParams(max_tokens=8, temperature=1.0, seed=1, repetition_penalty=1.2),
          SamplingParams(max_tokens=8, logits_processors=(lambda ids, row: row,))]
    for p in ps:
        llm, _ = sampled_run(engine, [p] * 4, ahead=True)
        assert llm.stats()["launched_ahead"] == 0
