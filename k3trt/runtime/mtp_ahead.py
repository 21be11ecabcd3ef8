"""MTP drafting on the device, for the verify step launched before the host commits the one before
it (spec_ahead.py). ``MTPAhead`` wraps the engine's ``MTPDrafter``: the host path (propose,
on_hidden, on_commit, release) is the drafter's own; ``propose_on_device`` drafts from the device's
verdict of verify step N (n accepted, the bonus token, N's hidden rows) without reading it.

The MTP drafter's step 0 runs its positions valid .. len - 2 with true target hiddens, then chains
on its own output (mtp.py). After N the history grows by drafts[:n] + [bonus], so for a request
with committed length L (before N):
  step 0    positions valid .. L - 2 (hiddens and tokens on the host) and L - 1 .. L - 2 + Q (N's
            hidden rows 0..Q-1 and tokens where(j < n, drafts[j], bonus)): every position is
            known on the host, only the last Q rows' inputs come from the device. The first draft
            comes from the row at L - 1 + n (= len - 2 after N's commit), gathered on the device.
  chained   draft j + 1 from position L - 1 + n + j: positions, lengths and cache slots on the
            device (StepContext's dev_positions / dev_seq_lens), one row per request.
Rows of step 0 past L - 1 + n write MTP cache entries past the true ones; every later step 0
rewrites from ``valid`` before reading there, as the drafter's own chained entries are. When N's
hidden rows are handed over (on_hidden, at N's commit), ``valid`` moves to len - 2, as the
drafter's own propose would have left it. Greedy drafts only (spec_ahead launches greedy requests),
scored over the drafter's head: its reduced draft vocabulary where it has one, as on the host.

Where the drafter has step graphs (mtp_graphs.py) that hold the steps, both run as replays: packed
on the host as if nothing were accepted, the device's ids, output rows (first + n) and position
shifts (n, then 1 a chained step) written into the static buffers before each replay, so the launch
queues behind step N without waiting for it. Otherwise they run eagerly, and the eager step's host
copies (its context made from host lists) wait for N.
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3trt.model.context import StepContext
from k3trt.runtime.request import Request
from k3trt.runtime.spec_ahead import to_device
from k3trt.runtime.speculative.draft_model import SeqStep, step_context
from k3trt.runtime.speculative.drafter import Drafter
from k3trt.runtime.speculative.mtp import MTPDrafter


class MTPAhead(Drafter):
    """The engine's MTP drafter, drafting on the device too (module doc)."""

    name = "mtp"
    needs_hidden = True

    def __init__(self, inner: MTPDrafter):
        self.inner = inner
        self.ahead: set[str] = set()      # requests drafted on the device since their last hand-over

    @property
    def seqs(self) -> dict:
        return self.inner.seqs

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    # ------------------------------------------------------------------------ the host path
    def propose(self, inputs, k):
        return self.inner.propose(inputs, k)

    def on_commit(self, request_id: str, tokens) -> None:
        self.inner.on_commit(request_id, tokens)

    def on_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        self.inner.on_hidden(request_id, start, hidden)
        st = self.inner.seqs.get(request_id)
        if request_id in self.ahead:
            self.ahead.discard(request_id)
            if st is not None and st.hidden is not None and len(st.hidden):
                st.valid, st.hidden = st.known - 1, st.hidden[-1:]

    def on_image_embeds(self, request_id: str, positions: torch.Tensor, rows: torch.Tensor) -> None:
        self.inner.on_image_embeds(request_id, positions, rows)

    def release(self, request_id: str) -> None:
        self.ahead.discard(request_id)
        self.inner.release(request_id)

    # ------------------------------------------------------------------------ the device path
    def propose_on_device(self, reqs: Sequence[Request], bonus: torch.Tensor, hidden: torch.Tensor | None,
                          num_accepted: torch.Tensor, k: Sequence[int]) -> torch.Tensor:
        d, m = self.inner, self.inner.model
        K = max(k)
        out = bonus[:, None].repeat(1, K)          # requests with no MTP state yet: drafts to reject
        if hidden is None or K == 0:
            return out
        Q = hidden.shape[1]
        live = []                                  # (b, request, its state, host rows)
        for b, r in enumerate(reqs):
            st, L = d.seqs.get(r.request_id), len(r.token_ids)
            if st is None or st.hidden is None or st.known < L - 1 or st.valid >= L - 1:
                continue
            if not d.blocks.grow(st.blocks, L - 1 + Q + K - st.base, d.block_size):
                continue
            live.append((b, r, st, L - 1 - st.valid))
        if not live:
            return out
        dev, n_live = d.device, len(live)
        # positions count from each state's base (its window after a prefix-cache resume), as on the host
        steps = [SeqStep(list(r.token_ids[st.valid + 1:]) + [0] * Q, st.valid - st.base, st.blocks, 0)
                 for _, r, st, _ in live]
        starts = [0]
        for s in steps:
            starts.append(starts[-1] + len(s.tokens))
        # host-known values in one pinned copy: the device rows of step 0 (in step order), each
        # request's batch row, its first device row within its sequence, its N drafts (padded), its
        # committed length less its base, its sequence's first row in step order
        rows = [starts[i] + mh + j for i, (_, _, _, mh) in enumerate(live) for j in range(Q)]
        drafts = [(r.drafts + [0] * Q)[:Q] for _, r, _, _ in live]
        meta = to_device(rows + [b for b, *_ in live] + [mh for *_, mh in live] + [t for row in drafts for t in row]
                         + [len(r.token_ids) - st.base for _, r, st, _ in live] + starts[:-1], dev)
        dev_rows, bidx, mh, nd, length, first = meta.split([n_live * Q, n_live, n_live, n_live * Q, n_live, n_live])
        n, bon = num_accepted[bidx], bonus[bidx]
        toks = torch.where(torch.arange(Q, device=dev)[None] < n[:, None], nd.view(n_live, Q), bon[:, None])
        with torch.inference_mode():
            wd = m.lm_head.weight.dtype
            normed = m.model.norm(hidden[bidx]).to(wd)       # one kernel for every request's rows
            prev = torch.cat([t for i, (_, _, st, h) in enumerate(live) for t in (st.hidden[:h].to(wd), normed[i])])
            step0 = (steps, prev, dev_rows, toks.reshape(-1), mh + n)
            chain = [SeqStep([0], len(r.token_ids) - st.base, st.blocks, 0) for _, r, st, _ in live]
            keys = (d.graphs.fits(steps), d.graphs.fits(chain)) if d.graphs is not None else (None, None)
            drafts_out = self._graphs(step0, chain, keys, n, K) if None not in keys \
                else self._eager(step0, n, length, K, first)
            out = out.index_copy(0, bidx, torch.stack(drafts_out, 1))
        self.ahead.update(r.request_id for _, r, _, _ in live)
        return out

    def _graphs(self, step0, chain, keys, n, K) -> list[torch.Tensor]:
        """Step 0 and the chained steps as the drafter's graphs (mtp_graphs.py; keys: their (S, Q)):
        packed on the host as if nothing were accepted, then the device's ids, output rows and
        shifts written in."""
        g_, head = self.inner.graphs, self.inner.draw.head
        steps, prev, dev_rows, toks, last = step0
        key = keys[0]
        g_.pack(key, steps)
        g, logits = g_.replay(key, len(steps), prev, ids=(dev_rows, toks), last=last)
        tok = head.full_ids(logits.argmax(-1))
        drafts = [tok]
        if K > 1:
            key = keys[1]
            g_.pack(key, chain)                       # draft 1's position as if n were 0
            at, one = torch.arange(len(chain), device=n.device), torch.ones_like(n)
            for step in range(1, K):
                g, logits = g_.replay(key, len(chain), g, ids=(at, tok), shift=n if step == 1 else one)
                tok = head.full_ids(logits.argmax(-1))
                drafts.append(tok)
        return drafts

    def _eager(self, step0, n, length, K, first) -> list[torch.Tensor]:
        """The same steps run eagerly (no graphs, or a step wider than every graph)."""
        d, m, head = self.inner, self.inner.model, self.inner.draw.head
        steps, prev, dev_rows, toks, last = step0
        bs, dev, n_live = d.block_size, d.device, len(steps)
        layer = m.model.layers[d.idx]
        ids, ctx = step_context(steps, bs, dev)
        ids = ids.index_copy(0, dev_rows, toks)
        h = layer(m.model.embed_tokens(ids), prev, ctx, d.cache)
        g = layer.shared_head.norm(h[first + last])
        tok = head.full_ids(head(g).argmax(-1))
        drafts = [tok]
        if K > 1:
            width = max(len(s.blocks) for s in steps)
            table = to_device([x for s in steps for x in list(s.blocks) + [0] * (width - len(s.blocks))],
                              dev).view(n_live, width)
            pos0 = length - 1 + n
            for step in range(1, K):
                pos = pos0 + step
                slots = table.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
                c = StepContext((1,) * n_live, (0,) * n_live, slots, table.to(torch.int32),
                                torch.zeros(n_live, dtype=torch.int64, device=dev), dev_positions=pos,
                                dev_seq_lens=(pos + 1).to(torch.int32),
                                dev_fresh=torch.zeros(n_live, dtype=torch.bool, device=dev))
                h = layer(m.model.embed_tokens(tok), g.to(prev.dtype), c, d.cache)
                g = layer.shared_head.norm(h)
                tok = head.full_ids(head(g).argmax(-1))
                drafts.append(tok)
        return drafts
