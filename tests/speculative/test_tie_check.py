"""tie_check.divergences on hand-made runs: a parting within the bound is accepted, one over it, or
at a token outside the plain run's top-n, is refused; equal runs give no record."""

from __future__ import annotations

import pytest
from tie_check import Divergence, divergences

# The plain run: two requests, their tokens and per-position top-3 logprobs (the chosen token first).
PLAIN = [[5, 7, 9], [1, 2]]
LPS = [
    [{5: -0.1, 6: -3.0, 4: -4.0}, {7: -1.00, 8: -1.02, 3: -2.5}, {9: -0.5, 2: -0.9, 1: -3.0}],
    [{1: -0.2, 0: -2.0, 3: -2.1}, {2: -0.7, 4: -0.7, 6: -1.9}],
]
BOUND = 0.05


def test_equal_runs_give_no_record():
    assert divergences(PLAIN, LPS, PLAIN, BOUND) == []


def test_a_parting_within_the_bound_is_a_tie():
    got = divergences(PLAIN, LPS, [[5, 8, 1], [1, 4]], BOUND)
    assert got == [Divergence(0, 1, 7, 8, pytest.approx(0.02), True), Divergence(1, 1, 2, 4, 0.0, True)]


def test_a_parting_over_the_bound_is_refused():
    (d,) = divergences(PLAIN, LPS, [[5, 7, 2], [1, 2]], BOUND)
    assert (d.request, d.position, d.plain, d.other, d.ok) == (0, 2, 9, 2, False)
    assert d.margin == pytest.approx(0.4)
    assert divergences(PLAIN, LPS, [[5, 7, 2], [1, 2]], 0.4)[0].ok      # at the bound: still a tie


def test_a_token_outside_the_top_n_is_refused():
    (d,) = divergences(PLAIN, LPS, [[5, 7, 9], [11, 2]], bound=100.0)
    assert (d.request, d.position, d.margin, d.ok) == (1, 0, None, False)


def test_only_the_first_parting_counts_and_lengths_are_compared_where_both_have_tokens():
    (d,) = divergences(PLAIN, LPS, [[5, 8, 4, 4], [1]], BOUND)       # longer, then shorter
    assert (d.request, d.position, d.ok) == (0, 1, True)
    assert divergences(PLAIN, LPS, [[5, 7], []], BOUND) == []


def test_mismatched_inputs_are_named():
    with pytest.raises(ValueError, match="request counts"):
        divergences(PLAIN, LPS, PLAIN[:1], BOUND)
    with pytest.raises(ValueError, match="logprobs=n"):
        divergences(PLAIN, [LPS[0], LPS[1][:1]], PLAIN, BOUND)
