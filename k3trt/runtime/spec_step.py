"""Speculative decoding inside the step loop: drafting before the schedule, acceptance after the
forward. ``StepLoop.step`` (loop.py) strings them together (ARCHITECTURE.md, "One step of the runtime"):

  draft    Speculator.draft(decoding requests): K_r per request (adaptive_k.py: its recent acceptance,
           within room - 1) → drafter.propose → req.drafts (+ req.draft_q)
  schedule 1 + len(drafts) verify rows per decode (drafts are dropped before anyone is preempted)
  mask     guided requests: drafts cut at the first token the grammar refuses; masks on the rows
  run      verify [last token, *drafts] per request with the KDA state kept after every row
  accept   decide(): per request its rows → processors / penalties (row j counts drafts[:j]) →
           greedy or stochastic acceptance → Verdict (n accepted drafts + the target's token)
  commit   StepLoop: Request.block_end (stop ids / max_tokens) and the grammar cut the block;
           num_computed = old + len(block); KDA rollback to the last kept row; cache.commit frees the rejected rows' blocks;
           Speculator.committed hands the drafter the kept rows' hidden states and the tokens

The drafter contract is speculative/drafter.py's. A drafter fault is confined to its request: a
batched propose that raises is retried one request at a time, and the request whose propose (or
on_hidden / on_commit) raises is the one that ends ("error"). Drafts a drafter returns past a
request's limit or outside the vocabulary are cut there.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from k3trt.runtime import sampling
from k3trt.runtime.adaptive_k import AdaptiveK, k_used_stats, next_k, update
from k3trt.runtime.ranks import RankFailure
from k3trt.runtime.request import Request
from k3trt.runtime.media import request_embeds
from k3trt.runtime.step import Rows
from k3trt.runtime.speculative import (AcceptanceStats, Accepted, DraftInput, Drafter, NoDrafter, accept_greedy,
                                       accept_stochastic, pad_drafts, pad_q)

log = logging.getLogger(__name__)

Fault = Callable[[Request, str], None]     # ends one request with an error message


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]                      # emitted: the accepted drafts, then the target's token
    num_accepted: int
    num_drafts: int
    logprobs: list[dict[int, float]] | None = None


class Speculator:
    """The engine's drafter, K, the per-request draft length (adaptive_k.py), and the aggregate
    acceptance counters."""

    def __init__(self, drafter: Drafter, k: int, *, vocab_size: int, max_model_len: int, adaptive: bool = True):
        self.drafter, self.k, self.vocab_size, self.max_model_len = drafter, k, vocab_size, max_model_len
        self.enabled = not isinstance(drafter, NoDrafter) and k > 0
        self.adaptive = AdaptiveK(k_max=max(k, 1), enabled=adaptive)
        self.stats = AcceptanceStats()
        self.proposed = 0          # drafts proposed (before the grammar's cut and the scheduler's drop)
        self.k_used: Counter = Counter()       # K asked for -> (request, step) pairs

    @property
    def needs_hidden(self) -> bool:
        return self.enabled and self.drafter.needs_hidden

    def wants(self, req: Request) -> bool:
        """The request speculates (it may still get no drafts in a given step); a one-token request
        has nothing to draft for, so the drafter never tracks it."""
        return self.enabled and req.params.speculative and req.params.max_tokens > 1

    def limit(self, req: Request, ahead: int = 0) -> int:
        """Drafts for the request's next step (its controller's K_r, within room - 1: n accepted + 1
        must fit Request.room); counted in the K-used stats. Called once per step per request;
        `ahead`: tokens a step not yet committed emits at least (spec_ahead.py)."""
        if req.adaptive is None:
            req.adaptive = self.adaptive.start()
        k, req.adaptive = next_k(req.adaptive, self.adaptive, req.room(self.max_model_len) - ahead)
        req.stats.k_used[k] += 1
        self.k_used[k] += 1
        return k

    # ------------------------------------------------------------------------ draft
    def draft(self, reqs: Sequence[Request], fault: Fault) -> None:
        """Drafts for decoding requests (before the schedule); sets req.drafts / req.draft_q."""
        todo = [(r, n) for r in reqs if self.wants(r) and (n := self.limit(r)) > 0]
        for r in reqs:
            r.set_drafts([])
        if not todo:
            return
        inputs = [DraftInput(r.request_id, r.token_ids, max_drafts=n, params=r.params, seed=r.seed or 0,
                             guide=r.guided) for r, n in todo]
        try:
            prop = self.drafter.propose(inputs, self.k)
            got = [(t, prop.q(i)) for i, t in enumerate(prop.tokens)]
            if len(got) != len(inputs):
                raise RuntimeError(f"{len(got)} proposals for {len(inputs)} requests")
        except RankFailure:          # the engine stopped (a sharded drafter's rank): not this batch's fault
            raise
        except Exception as e:    # find the request at fault: one at a time
            log.warning("drafter %s failed on a batch of %d (%s: %s); retrying one request at a time",
                        self.drafter.name, len(inputs), type(e).__name__, e)
            got = []
            for (r, _), inp in zip(todo, inputs):
                try:
                    one = self.drafter.propose([inp], self.k)
                    got.append((one.tokens[0], one.q(0)))
                except Exception as e1:
                    got.append(([], None))
                    fault(r, f"drafter failed: {type(e1).__name__}: {e1}")
        for (r, n), (tokens, q) in zip(todo, got):
            if r.finished:
                continue
            tokens = list(tokens[:n])
            ok = next((i for i, t in enumerate(tokens)
                       if not (isinstance(t, int) and 0 <= t < self.vocab_size)), len(tokens))
            r.set_drafts(tokens[:ok], q)
            self.proposed += ok

    # ------------------------------------------------------------------------ hand-over
    def on_prefill(self, req: Request, start: int, hidden: torch.Tensor | None, fault: Fault) -> None:
        """A prefill chunk of the request ran: MTP-style drafters get its rows' hidden states and
        the image embeddings at its image placeholders (before media.release_passed drops them)."""
        if self.needs_hidden and self.wants(req) and hidden is not None:
            if not self._call(req, fault, self.drafter.on_hidden, req.request_id, start, hidden):
                return
            embeds = request_embeds(req, start, start + len(hidden)) if req.images else None
            if embeds is not None:
                self._call(req, fault, self.drafter.on_image_embeds, req.request_id, *embeds)

    def committed(self, req: Request, start: int, tokens: list[int], hidden: torch.Tensor | None,
                  fault: Fault) -> None:
        """`tokens` were appended after history position `start` (the verified row 0): hand the
        drafter the kept rows' hidden states (MTP) and the tokens (rollback of its own state)."""
        if not self.wants(req):
            return
        if self.needs_hidden and hidden is not None:
            if not self._call(req, fault, self.drafter.on_hidden, req.request_id, start, hidden[:len(tokens)]):
                return
        self._call(req, fault, self.drafter.on_commit, req.request_id, tokens)

    def release(self, req: Request) -> None:
        if self.enabled:
            try:
                self.drafter.release(req.request_id)
            except Exception:
                log.exception("drafter %s: release of %s failed", self.drafter.name, req.request_id)

    def _call(self, req: Request, fault: Fault, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:
            fault(req, f"drafter failed: {type(e).__name__}: {e}")
            return False

    # ------------------------------------------------------------------------ stats
    def record(self, req: Request, v: Verdict) -> None:
        if v.num_drafts:
            if req.adaptive is not None:
                req.adaptive = update(req.adaptive, self.adaptive, v.num_drafts, v.num_accepted)
            s = req.stats
            s.drafted += v.num_drafts
            s.accepted += v.num_accepted
            s.verify_steps += 1
            s.accepted_lengths[v.num_accepted] += 1
            self.stats.add(Accepted([v.num_accepted], [v.tokens], [v.num_drafts]))

    def to_dict(self) -> dict:
        return {"method": self.drafter.name, "spec_tokens": self.k if self.enabled else 0,
                "adaptive_k": self.enabled and self.adaptive.enabled, "proposed_tokens": self.proposed,
                **self.stats.to_dict(), **k_used_stats(self.k_used), "drafter": self.drafter.stats()}


def decide(rows: Sequence[Rows], logits: torch.Tensor, fault: Fault,
           chosen: list[int] | None = None) -> dict[int, Verdict]:
    """Acceptance for every request of the step (keyed by id(req)); logits [R, V] fp32 are the
    step's rows, already masked by grammars; `chosen`, when given, is every row's token already
    chosen on the device and copied to the host (lookahead.NextTokens: the argmax, or the request's
    draw: it is not drawn again). A fault in one request's processors ends only it."""
    out: dict[int, Verdict] = {}
    plain = [r for r in rows if r.req.params.plain]
    if plain:      # argmax only: one batched argmax and one batched acceptance
        # every row (the few non-plain ones too): one sync
        best = logits.argmax(-1).tolist() if chosen is None else chosen
        d, nd = pad_drafts([r.req.drafts for r in plain])
        width = d.shape[1] + 1
        target = torch.tensor([best[r.row0:r.row0 + r.num] + [0] * (width - r.num) for r in plain],
                              dtype=torch.int64).view(len(plain), width)
        acc = accept_greedy(target, d, nd)
        for b, r in enumerate(plain):
            out[id(r.req)] = Verdict(acc.tokens[b], acc.num_accepted[b], acc.num_drafts[b])
    for r in rows:
        if id(r.req) in out:
            continue
        try:
            out[id(r.req)] = _decide_one(r, logits[r.row0:r.row0 + r.num],
                                         None if chosen is None else chosen[r.row0])
        except Exception as e:
            fault(r.req, f"sampling failed: {type(e).__name__}: {e}")
    return out


def _decide_one(r: Rows, rows: torch.Tensor, chosen: int | None = None) -> Verdict:
    """One request's verdict; `chosen`: its token, already chosen on the device (a row without drafts)."""
    req, p = r.req, r.req.params
    x = sampling.process(rows, p, req.token_ids, req.num_prompt, req.drafts)
    if chosen is not None and not req.drafts:
        tokens, n, nd = [chosen], 0, 0
    elif not req.drafts:         # plain decoding: exactly sampling.sample's draw
        tokens, n, nd = sampling.choose(x, p, req.generator).tolist(), 0, 0
    else:
        d, num = pad_drafts([req.drafts], device=x.device)
        if p.greedy:
            acc = accept_greedy(x.argmax(-1)[None], d, num)
        else:
            q = pad_q([req.draft_q], d, x.shape[-1])
            acc = accept_stochastic(sampling.probs(x, p)[None], d, num, q, [req.generator])
        tokens, n, nd = acc.tokens[0], acc.num_accepted[0], acc.num_drafts[0]
    lps = None
    if p.logprobs is not None:
        lps = sampling.top_logprobs(x[:len(tokens)], torch.tensor(tokens, device=x.device), p.logprobs)
    return Verdict(tokens, n, nd, lps)
