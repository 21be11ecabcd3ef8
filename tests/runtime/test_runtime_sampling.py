"""The sampler: the right distribution (chi-square on a small vocabulary), penalties, logprobs, and
seeded requests that draw the same tokens whatever else is in the batch."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from k3trt.runtime import sampling
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from runtime_utils import assert_no_leak, prompts

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
N = 20000


def expected(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> list[float]:
    """The target distribution, written independently of sampling.probs (plain Python)."""
    p = [math.exp(x / temperature) for x in logits.tolist()]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order[:top_k] if top_k else order)
    mass, kept = 0.0, set()
    for i in order:                      # top-p over the softmax (after top-k)
        if i in keep and mass < top_p * sum(p[j] for j in keep):
            kept.add(i)
            mass += p[i]
    pmax = max(p[i] for i in kept)
    kept = {i for i in kept if p[i] >= min_p * pmax}
    z = sum(p[i] for i in kept)
    return [p[i] / z if i in kept else 0.0 for i in range(len(p))]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 5, 0.95, 0.0), (1.0, 0, 1.0, 0.2)])
def test_draws_follow_the_distribution(temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    p = sampling.probs(LOGITS[None].clone(), params)[0]
    want = torch.tensor(expected(LOGITS, temperature, top_k, top_p, min_p))
    torch.testing.assert_close(p, want.float(), atol=1e-6, rtol=1e-5)
    g = sampling.make_generator(1234, "cpu")
    draws = sampling.draw(p.expand(N, -1).contiguous(), g)
    counts = torch.bincount(draws, minlength=len(LOGITS)).double()
    support = want > 0
    assert counts[~support].sum() == 0, "drew a token outside the top-k/top-p/min-p support"
    stat = chisquare(counts[support].numpy(), (want[support] * N).numpy())
    assert stat.pvalue > 1e-3, f"chi-square p={stat.pvalue:.2g}: counts {counts.tolist()} want {(want * N).tolist()}"


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = sampling.apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0, 1], num_prompt=2)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    out = sampling.apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                                   [0, 2, 2, 3], num_prompt=1)           # output tokens: 2, 2, 3
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]]


def test_logprobs_of_the_sampled_and_top_tokens():
    x = torch.log_softmax(LOGITS, -1)
    toks, lps = sampling.sample(LOGITS[None], SamplingParams(logprobs=2), [1], 1, None)
    assert toks == [0]
    assert set(lps[0]) == {0, 1} and lps[0][0] == pytest.approx(x[0].item())


@pytest.fixture(scope="module")
def llm(engine):
    return LLM(engine, verify_checksums=False)


def test_seeded_sampling_is_reproducible(llm):
    p, q, r = prompts(21, [9, 14, 4])
    sp = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = llm.generate([p], sp)[0].token_ids
    again = llm.generate([p], sp)[0].token_ids
    other = SamplingParams(max_tokens=5, temperature=1.2, seed=99, ignore_eos=True)
    in_batch = llm.generate([q, p, r], [other, sp, SamplingParams(max_tokens=3)])[1].token_ids
    assert alone == again == in_batch
    reseeded = llm.generate([p], SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=8,
                                                ignore_eos=True))[0].token_ids
    assert reseeded != alone
    assert_no_leak(llm)


def test_logprobs_through_the_engine(llm):
    out = llm.generate([prompts(22, [6])[0]], SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3          # greedy: the sampled token is the top one
        assert max(lp.values()) == lp[tok] <= 0
    assert_no_leak(llm)
