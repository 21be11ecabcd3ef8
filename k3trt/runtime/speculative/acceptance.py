"""Speculative acceptance as pure functions (gpt-fast style), batched over requests.

Layouts: B requests, K = the widest draft count of the batch, V the vocabulary.
  drafts      int64 [B, K]      draft ids, right-padded (padding is never read)
  num_drafts  int64 [B]         real drafts per request (0..K); row i of a request verified
                                drafts < i, so rows 0..num_drafts are meaningful
  target      int64 [B, K+1]    greedy: the target's token per row (argmax after the runtime's
                                processors/penalties)
  p           fp32  [B, K+1, V] stochastic: the target distribution per row, already processed
                                (temperature/top-k/top-p/min-p: sampling.probs)
  q           fp32  [B, K, V]   the draft distribution per draft row, or None: one-hot drafts
Both return ``Accepted``: per request n accepted drafts and the n+1 emitted tokens (the accepted
drafts, then the target's correction or, when every draft passed, the bonus token).

Stochastic acceptance (Leviathan et al. / Chen et al.): accept draft i with probability
min(1, p_i(d)/q_i(d)); at the first rejection emit a draw from normalise(max(p_i - q_i, 0)); when
all pass, emit a draw from p_K. The emitted sequence is distributed exactly as plain sampling from
p. Random numbers: a request consumes num_drafts uniforms then one sampling.draw over V from its
generator, whatever the outcome, so a seeded request is reproducible whatever else is in the
batch; with no drafts this is exactly plain sampling's draw.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from k3trt.runtime.sampling import draw


@dataclass(frozen=True)
class Accepted:
    num_accepted: list[int]          # n per request
    tokens: list[list[int]]          # the n+1 emitted tokens per request
    num_drafts: list[int]            # drafts that were verified (for acceptance rates)


def pad_drafts(drafts: Sequence[Sequence[int]], device: torch.device | str = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged draft lists -> (drafts [B, K] right-padded with 0, num_drafts [B])."""
    K = max((len(d) for d in drafts), default=0)
    out = [list(d) + [0] * (K - len(d)) for d in drafts]      # lists, not a torch call per request
    return (torch.tensor(out, dtype=torch.int64).view(len(drafts), K).to(device),
            torch.tensor([len(d) for d in drafts], dtype=torch.int64, device=device))


def pad_q(qs: Sequence[torch.Tensor | None], drafts: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Per-request draft distributions (Proposal.probs: [n_i, V], or None for one-hot drafts) ->
    q [B, K, V] with one-hot rows where a request has none; None when every request is one-hot."""
    if all(q is None for q in qs):
        return None
    B, K = drafts.shape
    out = torch.zeros(B, K, vocab, device=drafts.device).scatter_(-1, drafts[..., None].clamp(0, vocab - 1), 1.0)
    for b, q in enumerate(qs):
        if q is not None:
            out[b, :len(q)] = q.to(out.device)
    return out


def _leading(ok: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """ok bool [B, K] -> count of leading True within each request's num_drafts."""
    K = ok.shape[1]
    ok = ok & (torch.arange(K, device=ok.device)[None] < num_drafts[:, None])
    return ok.long().cumprod(1).sum(1)


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> Accepted:
    """Accept while draft i equals the target's token at row i; emit the target's row-n token.
    Since accepted drafts equal the target's tokens, the emitted tokens are target[:n+1]."""
    K = drafts.shape[1]
    n = _leading(drafts == target[:, :K], num_drafts)
    rows, ns = target.tolist(), n.tolist()
    return Accepted(ns, [r[:m + 1] for r, m in zip(rows, ns)], num_drafts.tolist())


def accept_stochastic(p: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, q: torch.Tensor | None,
                      generators: torch.Generator | Sequence[torch.Generator | None] | None) -> Accepted:
    """Speculative sampling (module doc). `generators`: one per request (reproducible per request),
    or a single generator / None for the whole batch (draws batched: tests, unseeded traffic)."""
    B, K = drafts.shape
    dev = p.device
    d = drafts.clamp(0, p.shape[-1] - 1)          # padding may hold anything; it is masked below
    p_d = p[:, :K].gather(-1, d[..., None])[..., 0]                          # [B, K]
    q_d = torch.ones_like(p_d) if q is None else q[:, :K].gather(-1, d[..., None])[..., 0]
    per_request = isinstance(generators, (list, tuple))
    if per_request:
        u = torch.zeros(B, K, device=dev)
        for b, g in enumerate(generators):
            u[b, :int(num_drafts[b])] = torch.rand(int(num_drafts[b]), generator=g, device=dev)
    else:
        u = torch.rand(B, K, generator=generators, device=dev)
    # u ~ U[0, 1): P(u·q < p) = min(1, p/q); strict, so a token the target rules out (p = 0) never passes
    n = _leading(u * q_d < p_d, num_drafts)                                  # [B]

    # the row the final token is drawn from: the residual at the first rejection, else p's bonus row
    last = p[torch.arange(B, device=dev), n]                                 # [B, V]
    rejected = n < num_drafts
    if rejected.any():
        nr = n.clamp(max=max(K - 1, 0))
        if q is None:
            q_row = torch.zeros_like(last).scatter_(-1, d.gather(1, nr[:, None]), 1.0)
        else:
            q_row = q[torch.arange(B, device=dev), nr]
        resid = (last - q_row).clamp_(min=0)
        mass = resid.sum(-1, keepdim=True)
        # float rounding can leave no residual mass when p ≈ q; then p itself is the right row
        resid = torch.where(mass > 0, resid / mass.clamp(min=1e-30), last)
        last = torch.where(rejected[:, None], resid, last)
    if per_request:
        final = torch.cat([draw(last[b:b + 1], g) for b, g in enumerate(generators)]) if B else n
    else:
        final = draw(last, generators)

    ns, dl, fl = n.tolist(), drafts.tolist(), final.tolist()
    return Accepted(ns, [dl[b][:m] + [fl[b]] for b, m in enumerate(ns)], num_drafts.tolist())


@dataclass
class AcceptanceStats:
    """Aggregate counters (per request or per engine): drafted / accepted tokens, verify steps, and
    the distribution of accepted lengths n (steps with no drafts are counted apart)."""
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: Counter = field(default_factory=Counter)   # n -> steps that accepted n drafts

    def add(self, acc: Accepted) -> None:
        for n, k in zip(acc.num_accepted, acc.num_drafts):
            if k:
                self.steps += 1
                self.drafted += k
                self.accepted += n
                self.histogram[n] += 1

    def to_dict(self) -> dict:
        return {"verify_steps": self.steps, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                # tokens emitted per verify step that had drafts: n + 1
                "mean_accepted_length": (self.accepted + self.steps) / self.steps if self.steps else None,
                "accepted_length_histogram": {int(n): c for n, c in sorted(self.histogram.items())}}
