"""Speculation overlapped with the host: the verify step after verify step N is launched before N's
accepted tokens reach the host.

After a verify step the host reads the logits, accepts, commits, rolls the KDA state back, asks
the drafter for the next drafts and packs the next step: the GPU waits all that time. For greedy
requests every input of the next verify step can be made on the device instead:

  accept    target = argmax of N's rows [B, Q]; n = leading drafts equal to the target's token;
            bonus = target[n] (``accept_on_device``: accept_greedy's rule, on device tensors)
  rollback  each request's KDA state <- its state after row n of N (the host's rollback, moved
            here: the host skips it for these requests)
  draft     the drafter proposes from the device (``DeviceDrafter.propose_on_device``: the bonus
            token, N's hidden rows and n), k_r drafts per request
  launch    N+1 is packed on the host as if n were 0 (ctx = num_computed + 1) and shifted on the
            device by n (graphs.GraphSession.verify's ``shift``: positions, lengths, cache slots);
            its ids are [bonus, drafts]
  commit    the host reads N's target rows and N+1's drafts (copied to pinned memory before N+1
            was queued), commits N exactly as the synchronous loop does, and N+1's drafts become
            the requests' drafts for N+1's acceptance
The host's acceptance of N reads the same argmax and drafts, so it reaches the device's verdict;
greedy output equals plain greedy decoding token for token (tests/runtime/test_spec_ahead.py).

N+1 is launched so only when nothing about it needs the host (``eligible``): a graph session, a
drafter that drafts on the device, N a pure decode step of plain greedy requests (no grammar,
processors, penalties or logprobs) that speculate, all running, none waiting to be admitted, each
with blocks for N's and N+1's rows taken now, positions within max_model_len, and no KDA checkpoint
boundary (prefix caching on a hybrid model) inside them. A request that N ends (EOS, a stop id or
string, max_tokens mid-block) still has rows in N+1: they are ignored, as one step ahead does
(lookahead.py). Each request drafts its controller's K for N+1 (adaptive_k.py) with the room it
has before N commits (at least one token less: n + 1 >= 1), so rows past its end are only cut,
never missing. A launch that raises (a device drafter's fault, say) ends no request: that step
commits synchronously, and the loop runs verify steps synchronously from then on.

Which drafters draft on the device: any with ``propose_on_device`` (``DeviceDrafter``). The host
still hands every drafter N's kept hidden rows and tokens after N's commit (on_hidden, on_commit),
as in the synchronous loop, and calls ``propose`` for every step it schedules itself. Drafters that
need the host (n-gram lookup over the history, a draft model with its own KDA state) keep the
synchronous step. The MTP drafter drafts on the device through ``mtp_ahead.MTPAhead`` (LLM wraps
it so on a graph session): its step 0 over N's rows is a step whose positions the host knows, its
chained steps run at positions shifted by n on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from k3trt.runtime.engine import Seq, make_batch
from k3trt.runtime.graphs import GraphSession
from k3trt.runtime.kv_cache import CacheManager
from k3trt.runtime.request import Request, Status
from k3trt.runtime.scheduler import StepPlan
from k3trt.runtime.step import Rows, StepOutput


@runtime_checkable
class DeviceDrafter(Protocol):
    def propose_on_device(self, reqs: Sequence[Request], bonus: torch.Tensor, hidden: torch.Tensor | None,
                          num_accepted: torch.Tensor, k: Sequence[int]) -> torch.Tensor:
        """Drafts int64 [B, max(k)] on the device for requests whose history is their committed
        tokens + drafts[:num_accepted[b]] + bonus[b] (none of which the host has seen yet); row b's
        first k[b] are used. hidden: N's hidden rows [B, Q, H] (keep_hidden drafters) or None."""


def accept_on_device(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance without the host: target int64 [B, K+1] (the argmax per row), drafts
    [B, K], num_drafts [B] -> (n accepted [B], the token after them [B]); acceptance.accept_greedy's
    rule, whose emitted tokens are drafts[:n] + [that token]."""
    K = drafts.shape[1]
    ok = (drafts == target[:, :K]) & (torch.arange(K, device=drafts.device)[None] < num_drafts[:, None])
    n = ok.long().cumprod(1).sum(1)
    return n, target.gather(1, n[:, None])[:, 0]


class HostCopy:
    """A device tensor copied to pinned memory now; reading it waits for the copy only."""

    def __init__(self, dev: torch.Tensor):
        self.host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=dev.is_cuda)
        self.host.copy_(dev, non_blocking=dev.is_cuda)
        self.event = torch.cuda.Event() if dev.is_cuda else None
        if self.event is not None:
            self.event.record()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small int64 host list on the device without waiting for the work queued there (pinned)."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class SpecLaunch:
    """Verify step N+1 in flight, and what the host needs from N and N+1 to commit them."""
    plan: StepPlan
    out: StepOutput
    chosen: HostCopy            # N's argmax per logits row, for N's acceptance
    drafts: HostCopy            # N+1's drafts [B, max k]
    k: list[int]                # N+1's drafts per request

    def rows(self, req: Request) -> int:
        """Rows N+1 writes for `req` (0: none)."""
        for r, k in zip(self.plan.decodes, self.k):
            if r is req:
                return 1 + k
        return 0

    def set_drafts(self) -> None:
        """N+1's drafts become its requests' drafts (for its acceptance); call once N is committed."""
        for r, d, k in zip(self.plan.decodes, self.drafts.tolist(), self.k):
            if not r.finished:
                r.set_drafts(d[:k])


def eligible(session, drafter, plan: StepPlan, out: StepOutput, cache: CacheManager, *, waiting: bool,
             checkpoints: bool, max_model_len: int, k: int) -> bool:
    """N+1 can be launched on the device's verdict of `plan` (module doc); k: the built K."""
    if (not isinstance(session, GraphSession) or not isinstance(drafter, DeviceDrafter) or plan.prefills
            or not plan.decodes or waiting or len(out.rows) != len(plan.decodes)):
        return False
    bs = cache.block_size
    for r in plan.decodes:
        p = r.params
        if (r.status is not Status.RUNNING or not p.plain or r.guided is not None or not p.speculative
                or p.max_tokens <= 1):
            return False
        end = r.num_computed + (1 + len(r.drafts)) + (1 + k)       # past N+1's last row, all of N kept
        if end > max_model_len or checkpoints and end // bs != r.num_computed // bs:
            return False
    return True


def launch(session: GraphSession, drafter: DeviceDrafter, cache: CacheManager, plan: StepPlan, out: StepOutput,
           k: list[int]) -> SpecLaunch | None:
    """Accept N on the device, roll its KDA states back, draft, and launch N+1 (module doc); None if a
    request's blocks for N+1 are not free (nothing was queued then)."""
    reqs, dev = plan.decodes, session.device
    for r, kr in zip(reqs, k):          # N's rows, then N+1's 1 + k rows, with all of N kept
        if not cache.allocate(r, r.num_computed + 1 + len(r.drafts) + 1 + kr):
            return None
    Q = max(len(r.drafts) for r in reqs) + 1
    index = [[rw.row0 + min(j, rw.num - 1) for j in range(Q)] for rw in out.rows]
    drafts = [r.drafts + [0] * (Q - 1 - len(r.drafts)) for r in reqs]
    # N's hidden rows as index_d picks its logits rows, within the rows' hidden tensors end to end:
    # one index in the pinned copy (a Python list as an index is a pageable copy, which waits for
    # the device to finish step N)
    want_hidden = getattr(drafter, "needs_hidden", False) and all(rw.hidden is not None for rw in out.rows)
    starts = [0]
    for rw in out.rows if want_hidden else ():
        starts.append(starts[-1] + rw.hidden.shape[0])
    hidden_index = [at + min(j, rw.num - 1) for at, rw in zip(starts, out.rows) for j in range(Q)] if want_hidden else []
    B = len(reqs)
    meta = to_device([x for row in index for x in row] + [x for row in drafts for x in row]
                     + [len(r.drafts) for r in reqs] + [r.kda_slot for r in reqs] + hidden_index, dev)
    index_d, drafts_d, nd_d, slots_d, hidden_d = meta.split([B * Q, B * (Q - 1), B, B, len(hidden_index)])
    index_d, drafts_d = index_d.view(B, Q), drafts_d.view(B, Q - 1)
    argmax = out.logits.argmax(-1)
    chosen = HostCopy(argmax)
    n, bonus = accept_on_device(argmax[index_d], drafts_d, nd_d)
    if Q > 1:
        session._restore_kda(slots_d, n)
    hidden = None
    if want_hidden:
        kept = out.rows[0].hidden if B == 1 else torch.cat([rw.hidden for rw in out.rows])
        hidden = kept[hidden_d].view(B, Q, -1)
    ids = bonus[:, None]
    if max(k) > 0:
        new = drafter.propose_on_device(reqs, bonus, hidden, n, k)
        ids = torch.cat([ids, new[:, :max(k)]], 1)
    else:
        new = ids[:, :0]
    host_drafts = HostCopy(new)
    # packed as if N kept only its first row; shifted on the device by n
    seqs = [Seq([0] * (1 + kr), r.num_computed + 1, r.blocks, r.kda_slot, 1 + kr) for r, kr in zip(reqs, k)]
    batch = make_batch(seqs, cache.block_size, capacity=plan.verify_capacity, save_kda_states=max(k) > 0,
                       keep_hidden=bool(getattr(drafter, "needs_hidden", False)))
    logits = session.verify(batch, device_ids=ids, shift=n)
    hidden_next = session.hidden
    rows, at = [], 0
    for r, kr in zip(reqs, k):
        rows.append(Rows(r, at, 1 + kr, None if hidden_next is None else hidden_next[at:at + 1 + kr]))
        at += 1 + kr
    nxt = StepPlan(decodes=list(reqs), verify_capacity=plan.verify_capacity)
    return SpecLaunch(nxt, StepOutput(logits, rows, []), chosen, host_drafts, list(k))
