"""The draft-length controller (runtime/adaptive_k.py) on fake acceptance sequences: it grows on full
acceptance, shrinks on rejection, stops drafting when drafts stop being accepted and probes again
after a back-off that doubles while probes fail, never asks past the room, and with adaptive K off
always asks for the built K within the room."""

from __future__ import annotations

from collections import Counter

import pytest

from k3trt.runtime.adaptive_k import AdaptiveK, KState, k_used_stats, next_k, update

CFG = AdaptiveK(k_max=5)
ROOM = 1000


def run(cfg: AdaptiveK, accepts, room: int = ROOM, state: KState | None = None) -> tuple[list[int], KState]:
    """Drive the controller: each step asks next_k, and a step that drafts accepts
    min(k, accepts(step, k)) drafts. Returns the K asked at every step."""
    s = state or cfg.start()
    ks = []
    for step in range(len(accepts) if isinstance(accepts, list) else accepts[0]):
        k, s = next_k(s, cfg, room)
        ks.append(k)
        if k:
            a = accepts[step] if isinstance(accepts, list) else accepts[1](step, k)
            s = update(s, cfg, k, min(k, a))
    return ks, s


def test_full_acceptance_grows_to_the_built_k():
    cfg = AdaptiveK(k_max=4)
    s = KState(k=1, ewma_n=0.0)
    ks, s = run(cfg, [9] * 6, state=s)
    assert ks == [1, 2, 3, 4, 4, 4]
    assert s.k == 4 and s.pause == 0


def test_rejection_shrinks_toward_the_accepted_length():
    ks, s = run(CFG, (16, lambda step, k: 1))          # one draft of every step accepted
    assert ks[:5] == [5, 4, 3, 2, 1]                    # one less after every rejection
    # then it probes one past the accepted length: 1 (all accepted, grows), 2 (one rejected)
    assert set(ks[5:]) == {1, 2}
    assert s.pause == 0                                 # most of its drafts accepted: keeps drafting


def test_a_request_that_stops_accepting_stops_drafting_and_probes_with_a_growing_back_off():
    ks, s = run(CFG, (200, lambda step, k: 0))
    drafting = [i for i, k in enumerate(ks) if k]
    first_pause = next(i for i, k in enumerate(ks) if k == 0)
    assert 2 <= first_pause <= 8                        # a few rejected steps, then it stops
    assert all(ks[i] == 1 for i in drafting if i > first_pause)     # probes are one draft
    gaps = [b - a - 1 for a, b in zip(drafting, drafting[1:]) if b - a > 1]
    assert gaps[0] == CFG.backoff and gaps[1] == 2 * CFG.backoff and gaps[2] == 4 * CFG.backoff
    assert sum(ks[first_pause:]) <= 5                   # almost nothing drafted once it stopped


def test_back_off_is_bounded():
    cfg = AdaptiveK(k_max=3, backoff=2, max_backoff=8)
    ks, _ = run(cfg, (200, lambda step, k: 0))
    drafting = [i for i, k in enumerate(ks) if k]
    gaps = [b - a - 1 for a, b in zip(drafting, drafting[1:]) if b - a > 1]
    assert max(gaps) == 8 and gaps[-3:] == [8, 8, 8]


def test_an_accepted_probe_resumes_drafting_and_resets_the_back_off():
    script = {}

    def accepts(step, k):
        return script.get(step, 0)
    ks, _ = run(CFG, (60, accepts))
    probes = [i for i, k in enumerate(ks) if k and i > 5]
    # replay with the second probe accepted: drafting resumes and grows again
    script[probes[1]] = 1
    script.update({i: 9 for i in range(probes[1] + 1, 60)})
    ks2, s2 = run(CFG, (60, accepts))
    after = ks2[probes[1]:]
    assert after[0] == 1 and after[1] >= 1 and max(after) == CFG.k_max and 0 not in after
    assert s2.backoff == 0


@pytest.mark.parametrize("room, want", [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3), (100, 5)])
def test_room_bounds_the_drafts(room, want):
    for enabled in (True, False):
        cfg = AdaptiveK(k_max=5, enabled=enabled)
        k, _ = next_k(cfg.start(), cfg, room)
        assert k == want


def test_fixed_k_ignores_acceptance():
    cfg = AdaptiveK(k_max=3, enabled=False)
    ks, s = run(cfg, (30, lambda step, k: 0))
    assert ks == [3] * 30 and s == cfg.start()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="adaptive K"):
        AdaptiveK(k_max=3, weight=0.0)
    with pytest.raises(ValueError, match="adaptive K"):
        AdaptiveK(k_max=3, backoff=9, max_backoff=4)


def test_k_used_stats():
    assert k_used_stats(Counter({0: 2, 3: 2})) == {"k_used_mean": 1.5, "k_used_histogram": {0: 2, 3: 2}}
    assert k_used_stats(Counter()) == {"k_used_mean": None, "k_used_histogram": {}}
