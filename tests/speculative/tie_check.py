"""Where a run parts from plain greedy decoding, and whether it parts on a near-tie (a test helper).

In bf16 a (K+1)-row verify step and a 1-row decode step round differently, so where the plain run's
top two logprobs are within rounding the other run may pick the second one and the outputs part
there. `divergences` finds each request's first parting and its margin in the plain run, so a test
can assert that every parting is such a near-tie and never a real disagreement."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Divergence:
    """A request's first position where the other run's token differs from the plain run's.
    margin: lp(plain) - lp(other) in the plain run, None when `other` is outside its top-n."""
    request: int
    position: int
    plain: int
    other: int
    margin: float | None
    ok: bool


def divergences(plain_tokens: Sequence[Sequence[int]], plain_logprobs: Sequence[Sequence[dict[int, float]]],
                other_tokens: Sequence[Sequence[int]], bound: float) -> list[Divergence]:
    """Per request (the three sequences are aligned by request): its first parting, if any.
    plain_logprobs[r][i]: RequestOutput.logprobs of the plain run ({token id: logprob}, the chosen
    token and the top-n). ok: the margin is known and at most `bound`. Outputs of different lengths
    are compared over their common length: after the first parting the runs are no longer
    comparable, and a run cut short (a stop id, max_tokens) agrees on everything it produced."""
    if not len(plain_tokens) == len(plain_logprobs) == len(other_tokens):
        raise ValueError(f"runs of different request counts: plain {len(plain_tokens)}, "
                         f"plain logprobs {len(plain_logprobs)}, other {len(other_tokens)}")
    out = []
    for r, (want, lps, got) in enumerate(zip(plain_tokens, plain_logprobs, other_tokens)):
        if len(lps) != len(want):
            raise ValueError(f"request {r}: {len(lps)} logprob entries for {len(want)} tokens; "
                             "run the plain reference with SamplingParams(logprobs=n)")
        i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if i is None:
            continue
        top = lps[i]
        margin = top[want[i]] - top[got[i]] if got[i] in top else None
        out.append(Divergence(r, i, want[i], got[i], margin, margin is not None and margin <= bound))
    return out
