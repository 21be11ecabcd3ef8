"""Adaptive draft length: how many drafts a request asks for in its next step, from its own recent
acceptance (an acceptance-length controller).

A verify step costs more the more rows it has, and a rejected draft is paid for and thrown away,
so a request drafts about as far as its drafts have recently been accepted:

  grow     every draft accepted (n == proposed == K_r):   K_r + 1, up to the built K
  shrink   a draft rejected after n accepted:              min(K_r - 1, ceil(ewma_n) + 1), at least 1
  pause    the EWMA of accepted / proposed under ``min_rate``: no drafts for ``backoff`` steps, then
           one probe at K_r = 1; a probe that accepts nothing doubles the back-off (up to
           ``max_backoff``), one that accepts resets it
  room     never more than room - 1 drafts (n accepted + the target's token must fit max_tokens /
           max_model_len: ``Request.room``), so a request with one token left drafts nothing

``next_k`` and ``update`` are pure (state in, state out), so the controller is tested on fake
acceptance sequences (tests/speculative/test_adaptive_k.py); ``KState`` is the one piece of state a
request holds for it (``Request.adaptive``). With adaptive K off the same record keeps K_r = the
built K and never pauses, so "K used" is reported either way.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class AdaptiveK:
    """The controller's settings (one per engine)."""
    k_max: int                  # the built K: rows per request stay within the step's capacity
    enabled: bool = True        # False: always k_max (still bounded by the room)
    weight: float = 0.3         # EWMA weight of the newest step
    min_rate: float = 0.2       # acceptance rate (EWMA) under which a request stops drafting
    backoff: int = 8            # steps without drafts before the first probe
    max_backoff: int = 128

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1 or not 0 <= self.min_rate < 1 or not 1 <= self.backoff <= self.max_backoff:
            raise ValueError(f"adaptive K settings out of range: {self}")

    def start(self) -> "KState":
        """A new request starts at the built K, trusted (rate 1) until its drafts say otherwise."""
        return KState(k=self.k_max, ewma_n=float(self.k_max))


@dataclass(frozen=True)
class KState:
    k: int                      # drafts asked for while drafting (1..k_max)
    ewma_n: float               # EWMA of drafts accepted per verify step
    rate: float = 1.0           # EWMA of accepted / proposed
    pause: int = 0              # steps left without drafts
    backoff: int = 0            # the current back-off (0: not backing off yet)
    probing: bool = False       # the next verified step is a probe after a pause


def next_k(s: KState, cfg: AdaptiveK, room: int) -> tuple[int, KState]:
    """Drafts for the request's next step (0..k_max) and the state after asking; `room`: tokens the
    request may still emit (Request.room)."""
    if room <= 1:                           # the target's own token is all that fits
        return 0, s
    if not cfg.enabled:
        return min(cfg.k_max, room - 1), s
    if s.pause > 0:
        return 0, replace(s, pause=s.pause - 1, probing=s.pause == 1)
    return min(s.k, room - 1), s


def update(s: KState, cfg: AdaptiveK, proposed: int, accepted: int) -> KState:
    """The state after a verify step that checked `proposed` drafts and accepted `accepted`."""
    if not cfg.enabled or proposed <= 0:
        return s
    w = cfg.weight
    rate = (1 - w) * s.rate + w * accepted / proposed
    ewma_n = (1 - w) * s.ewma_n + w * accepted
    if accepted == proposed:
        k = min(cfg.k_max, max(s.k, proposed + 1))
    else:
        k = max(1, min(s.k - 1, math.ceil(ewma_n) + 1))
    backoff = s.backoff
    if s.probing:
        backoff = min(cfg.max_backoff, 2 * backoff) if accepted == 0 else 0
    if rate < cfg.min_rate:
        backoff = backoff or cfg.backoff
        # a probe is one draft: its acceptance moves the rate by at most `weight`, so the rate
        # restarts at the threshold and one accepted probe resumes drafting
        return KState(k=1, ewma_n=ewma_n, rate=cfg.min_rate, pause=backoff, backoff=backoff)
    return KState(k=k, ewma_n=ewma_n, rate=rate, backoff=backoff)


def k_used_stats(hist: Counter) -> dict:
    """The drafts asked for per (request, step): their mean and histogram (0: a step that drafted
    nothing, paused or out of room)."""
    steps = sum(hist.values())
    return {"k_used_mean": sum(k * c for k, c in hist.items()) / steps if steps else None,
            "k_used_histogram": {int(k): c for k, c in sorted(hist.items())}}
