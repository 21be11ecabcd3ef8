"""Executing one scheduled step: the verify pass and the prefill pass of a ``StepPlan`` through the
engine session, and which logits rows belong to which request.

    out = run_plan(session, plan, block_size=bs, keep_hidden=drafter_needs_hidden)
    out.logits      fp32 [R, V]: every verify row (1 + len(drafts) per decode, plan order), then
                    one row per prefill chunk that completes its request (plan order)
    out.rows        [Rows]: each request's rows in out.logits (and their hidden states for MTP)
    out.chunk_hidden  per plan.prefills chunk: its rows' hidden states (keep_hidden) or None

Nothing here moves a request's bookkeeping (num_computed, blocks): the loop (loop.py) does, once it
knows what was accepted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from k3trt.runtime.engine import EngineSession, Seq, make_batch
from k3trt.runtime.media import chunk_embeds
from k3trt.runtime.request import Request
from k3trt.runtime.scheduler import StepPlan


@dataclass
class Rows:
    """One request's logits rows: out.logits[row0 : row0 + num], row j after drafts[:j] (a prefill
    that completes has one row and no drafts)."""
    req: Request
    row0: int
    num: int
    hidden: torch.Tensor | None = None     # [num, H] their hidden states (keep_hidden only)


@dataclass
class StepOutput:
    logits: torch.Tensor
    rows: list[Rows]
    chunk_hidden: list[torch.Tensor | None]


def run_plan(session: EngineSession, plan: StepPlan, *, block_size: int, keep_hidden: bool = False) -> StepOutput:
    rows: list[Rows] = []
    parts, chunk_hidden = [], []
    if plan.decodes:
        seqs = [Seq(r.token_ids[r.num_computed:] + r.drafts, r.num_computed, r.blocks, r.kda_slot,
                    1 + len(r.drafts)) for r in plan.decodes]
        parts.append(session.verify(make_batch(seqs, block_size, capacity=plan.verify_capacity,
                                               keep_hidden=keep_hidden,
                                               save_kda_states=any(r.drafts for r in plan.decodes))))
        hidden = session.hidden if keep_hidden else None
        for r, s, a in zip(plan.decodes, seqs, itertools.accumulate([s.num_logits for s in seqs], initial=0)):
            rows.append(Rows(r, a, s.num_logits, None if hidden is None else hidden[a:a + s.num_logits]))
    if plan.prefills:
        seqs = [Seq(c.req.token_ids[c.start:c.start + c.num_tokens], c.start, c.req.blocks, c.req.kda_slot,
                    int(c.completes)) for c in plan.prefills]
        parts.append(session.prefill(make_batch(seqs, block_size, capacity=plan.prefill_capacity,
                                                keep_hidden=keep_hidden, embeds=chunk_embeds(plan.prefills))))
        hidden = session.hidden if keep_hidden else None
        at = sum(r.num for r in rows)
        for c, t in zip(plan.prefills, itertools.accumulate([c.num_tokens for c in plan.prefills], initial=0)):
            chunk_hidden.append(None if hidden is None else hidden[t:t + c.num_tokens])
            if c.completes:
                rows.append(Rows(c.req, at, 1))
                at += 1
    return StepOutput(torch.cat(parts) if len(parts) > 1 else parts[0], rows, chunk_hidden)
