"""bf16 speculative decoding against plain greedy decoding: every point where a speculative run's
output parts from the plain run's is a near-tie of the plain run (its top two logits within bf16
rounding), never a real disagreement. A (K+1)-row verify step and a 1-row decode step round
differently (GEMM shapes, MoE grouping, attention kernels), so where the plain run's top two are
that close the verify may pick the other one; in fp32 the outputs are equal (test_spec_e2e.py).

On the GPU (marked gpu; run on the H200): CUDA graphs, K = 3, the n-gram table drafter on the host,
the same table chained on the device (spec_ahead), and MTP drafted on the device (MTPAhead), with
adaptive K off and on. On the CPU (CI): the host table drafter, where bf16 parts the runs too.
Every parting is logged (request, position, margin, bound); to see them on a passing run:
    python -m pytest -q -m gpu -s tests/speculative/test_bf16_ties_gpu.py -o log_cli=true --log-cli-level=INFO"""

from __future__ import annotations

import logging

import pytest
import torch
from runtime.test_spec_ahead import DeviceTableDrafter, TableDrafter
from runtime_utils import assert_released, build_tiny_engine, prompts
from tie_check import Divergence, divergences

from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams

log = logging.getLogger(__name__)

LENGTHS = [6, 11, 30, 4, 17, 9, 23, 2]
MAX_TOKENS = 32
K = 3

# The bound on a parting's margin lp(plain) - lp(other), in units of the plain run's logit scale.
# bf16 keeps 8 significant bits: a logit x is rounded by up to |x|·2^-8 (unit roundoff). The other
# run picks b over the plain run's a only if x_a - x_b <= |Δx_a| + |Δx_b|, each run's logit within
# |x|·2^-8 of the exact one, so a margin of up to 4·|x|·2^-8 = |x|·2^-6 is a rounding tie, where
# |x| is the largest top-two logit the plain run saw (measured in that run: TopLogitScale). The
# logprob margin is the logit difference (log_softmax shifts a row by one constant).
# The tiny model (bf16, CPU, the prompts below): top logits 3.8..5.3, so the bound is ~0.083, just
# over 2 ulps (ulp 2^-5 on [4, 8)); the runs parted at margins 0, 2^-6 and 2^-5; of the plain
# run's 256 top1-top2 gaps ~10% are exact ties (0), the median is 0.125 and ~30% are <= the bound.
# A real bug (a draft accepted at the wrong position, a bonus token off by a row) picks a token
# unrelated to the plain top two: outside the top-5 (margin None) or a typical gap over the bound.
ROUNDINGS = 4
UNIT_ROUNDOFF = 2.0 ** -8
TOP_N = 5


class TopLogitScale:
    """A logits processor that records the largest |logit| among each row's top two and returns the
    row unchanged (the plain run's tokens stay its argmax)."""

    def __init__(self):
        self.scale = 0.0

    def __call__(self, token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        self.scale = max(self.scale, float(row.topk(2).values.abs().max()))
        return row


def bound_of(scale: float) -> float:
    return ROUNDINGS * UNIT_ROUNDOFF * scale


def plain_reference(engine, device: str, graphs: bool) -> tuple[list, list, list, float]:
    """(prompts, the plain greedy tokens, their top-n logprobs, the parting bound)."""
    ps = prompts(3, LENGTHS)
    scale = TopLogitScale()
    llm = LLM(engine, verify_checksums=False, device=device, cuda_graphs=graphs, prefix_caching=False)
    outs = llm.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_N,
                                           logits_processors=[scale]))
    assert_released(llm)
    tokens = [o.token_ids for o in outs]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    log.info("plain run: largest top-two |logit| %.4f, bound %.4f", scale.scale, bound_of(scale.scale))
    return ps, tokens, [o.logprobs for o in outs], bound_of(scale.scale)


def check_ties(name: str, ref, got: list[list[int]]) -> list[Divergence]:
    _, want, lps, bound = ref
    assert all(len(g) == MAX_TOKENS for g in got), f"{name}: lengths {[len(g) for g in got]}"
    found = divergences(want, lps, got, bound)
    for d in found:
        log.info("%s: request %d parts at position %d (plain %d, %s %d), margin %s, bound %.4f%s", name,
                 d.request, d.position, d.plain, name, d.other, d.margin, bound, "" if d.ok else "  NOT A TIE")
    log.info("%s: %d of %d requests part from plain greedy", name, len(found), len(want))
    assert all(d.ok for d in found), f"{name}: a parting that is not a near-tie (bound {bound:.4f}): {found}"
    return found


def spec_run(engine, ref, device: str, graphs: bool, drafter: str, adaptive_k: bool) -> tuple[list, dict, int]:
    """Greedy speculative output of one drafter: (tokens, speculative stats, steps launched ahead)."""
    ps, want, _, _ = ref
    llm = LLM(engine, verify_checksums=False, device=device, cuda_graphs=graphs, prefix_caching=False,
              speculative="mtp" if drafter == "mtp" else "ngram", spec_tokens=K, adaptive_k=adaptive_k)
    if drafter != "mtp":
        table = {"table": TableDrafter, "device-table": DeviceTableDrafter}[drafter]
        llm.spec.drafter = table(want, llm.vocab_size, wrong=7, device=device)
    got = [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))]
    stats = llm.stats()
    assert_released(llm)
    return got, stats["speculative"], stats["launched_ahead"]


@pytest.fixture(scope="module")
def bf16_engine(tiny_ckpt, tmp_path_factory):
    return build_tiny_engine(tiny_ckpt, tmp_path_factory.mktemp("bf16") / "engine", dtype="bf16",
                             capacities=[1, 2, 4, 8], max_num_tokens=64)


@pytest.fixture(scope="module")
def cpu_reference(bf16_engine):
    return plain_reference(bf16_engine, "cpu", graphs=False)


@pytest.mark.parametrize("adaptive_k", [False, True], ids=["fixed_k", "adaptive_k"])
def test_bf16_speculation_parts_from_plain_greedy_only_on_ties_on_the_cpu(bf16_engine, cpu_reference, adaptive_k):
    """Eager steps: on the CPU the graph session's padded steps give the verify and decode rows the
    same shapes, and the runs rarely part; eager ones part at a few near-ties."""
    got, spec, _ = spec_run(bf16_engine, cpu_reference, "cpu", False, "table", adaptive_k)
    check_ties("table", cpu_reference, got)
    assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"]


@pytest.fixture(scope="module")
def gpu_reference(bf16_engine):
    return plain_reference(bf16_engine, "cuda", graphs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("adaptive_k", [False, True], ids=["fixed_k", "adaptive_k"])
@pytest.mark.parametrize("drafter", ["table", "device-table", "mtp"])
def test_bf16_speculation_parts_from_plain_greedy_only_on_ties_on_the_gpu(bf16_engine, gpu_reference, drafter,
                                                                          adaptive_k):
    got, spec, ahead = spec_run(bf16_engine, gpu_reference, "cuda", True, drafter, adaptive_k)
    check_ties(f"{drafter}/{'adaptive' if adaptive_k else 'fixed'}", gpu_reference, got)
    log.info("%s: %s, launched ahead %d", drafter, spec, ahead)
    assert spec["verify_steps"] > 0 and spec["drafted_tokens"] > 0      # tokens came from K+1-row verify steps
    if drafter != "mtp":      # the tiny model's random MTP layer drafts nothing right: its runs are all bonus tokens
        assert 0 < spec["accepted_tokens"] < spec["drafted_tokens"]
    assert (ahead > 0) == (drafter != "table")     # drafted on the device: the overlapped path ran
