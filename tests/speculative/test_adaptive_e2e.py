"""Adaptive draft length through the runtime (spec_step.Speculator + adaptive_k.py): greedy output
equals plain decoding whatever K each step asks for; a request whose drafts are always right drafts
the built K, one whose drafts are always wrong stops drafting; short budgets draft less; K used is
reported per request and in llm.stats()."""

from __future__ import annotations

import pytest
from runtime_utils import assert_released, prompts

from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.speculative import Drafter, Proposal

K = 3
N = 24


class Script(Drafter):
    """Drafts each request's reference continuation (every draft accepted) or, `wrong`, the same
    with its first draft changed (every draft rejected)."""
    name = "script"

    def __init__(self, refs: dict[int, tuple[int, list[int]]], wrong: bool):
        self.refs, self.wrong = refs, wrong      # first prompt token -> (prompt length, reference)

    def propose(self, inputs, k):
        out = []
        for inp in inputs:
            n, ref = self.refs[inp.token_ids[0]]
            at = len(inp.token_ids) - n
            d = list(ref[at:at + inp.limit(k)])
            if self.wrong and d:
                d[0] = (d[0] + 1) % 1000
            out.append(d)
        return Proposal(out, [None] * len(out))


@pytest.fixture(scope="module")
def reference(engine):
    ps = prompts(51, [9, 17])
    llm = LLM(engine, verify_checksums=False)
    outs = llm.generate(ps, SamplingParams(max_tokens=N, ignore_eos=True))
    return ps, [o.token_ids for o in outs]


def run(engine, reference, *, wrong: bool, adaptive: bool, max_tokens: int = N):
    ps, want = reference
    llm = LLM(engine, verify_checksums=False, speculative="ngram", spec_tokens=K, adaptive_k=adaptive)
    llm.spec.drafter = Script({p[0]: (len(p), w) for p, w in zip(ps, want)}, wrong)
    outs = llm.generate(ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert [o.token_ids for o in outs] == [w[:max_tokens] for w in want]
    assert_released(llm)
    return llm, outs


def test_right_drafts_keep_the_built_k(engine, reference):
    llm, outs = run(engine, reference, wrong=False, adaptive=True)
    for o in outs:
        hist = o.stats["k_used_histogram"]
        assert o.stats["acceptance_rate"] == 1.0
        assert max(hist, key=hist.get) == K and set(hist) <= set(range(K + 1))     # less only near the end
        assert o.stats["k_used_mean"] == sum(k * c for k, c in hist.items()) / sum(hist.values())
    spec = llm.stats()["speculative"]
    assert spec["adaptive_k"] is True and spec["k_used_histogram"][K] == sum(o.stats["k_used_histogram"][K]
                                                                           for o in outs)


def test_wrong_drafts_stop_drafting(engine, reference):
    fixed, fixed_outs = run(engine, reference, wrong=True, adaptive=False)
    llm, outs = run(engine, reference, wrong=True, adaptive=True)
    for o, f in zip(outs, fixed_outs):
        assert o.stats["accepted_tokens"] == 0 and o.stats["k_used_histogram"].get(0, 0) > N // 3
        assert o.stats["drafted_tokens"] < f.stats["drafted_tokens"] / 2
        assert 0 not in f.stats["k_used_histogram"] or f.stats["k_used_histogram"][0] == 1    # only the last step
    assert llm.stats()["speculative"]["k_used_mean"] < fixed.stats()["speculative"]["k_used_mean"] / 2
    assert fixed.stats()["speculative"]["adaptive_k"] is False


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_short_budgets_draft_less(engine, reference, max_tokens):
    _, outs = run(engine, reference, wrong=False, adaptive=True, max_tokens=max_tokens)
    for o in outs:
        # the prefill emits the first token; after it, room - 1 drafts (none for max_tokens 1: never tracked)
        assert o.stats["k_used_histogram"] == ({} if max_tokens == 1 else {max_tokens - 2: 1})
