"""MTP drafting: the target checkpoint's own next-token-prediction layer (DeepSeek-V3 style), run
EAGLE-fashion: chained on its own hidden output for drafts past the first.

MTP layer 0 at position i combines the target's hidden state h_i with the embedding of token
x_{i+1}; its output g_i gives logits for x_{i+2} and is the "previous hidden" for position i+1
when h_{i+1} is not known yet. Its MLA layer (RoPE) has a cache over positions; the drafter owns
it (its own blocks; no KDA, so no state to roll back).

Which hidden state: what K3's production code (the vLLM fork's kimi_linear.py and deepseek_mtp.py)
feeds its MTP layer. The target model's forward there ends with the final norm, so h_i is the
target's hidden AFTER ``model.norm``; a chained step takes g AFTER ``shared_head.norm`` (the
tensor lm_head reads). DeepSeek-V3's own modeling code does the same. The runtime hands over the
pre-norm rows (``K3ForCausalLM.forward``'s output); ``on_hidden`` applies the final norm.

Hand-over (``needs_hidden``): after every target forward the runtime calls
``on_hidden(request_id, start, hidden)`` with the target's hidden states (``K3ForCausalLM.forward``
output rows, before the final norm) for the positions whose next token is now committed:
  prefill chunk   all its rows (start = the chunk's first position)
  verify step     rows 0..n of the request (the last committed token and the n accepted drafts:
                  start = len(history before the commit) - 1)
Per request the drafter keeps ``valid`` (cache positions ..valid-1 were computed from true target
hiddens) and the handed-over hiddens of positions valid.. not yet run.

propose (history x_0..x_{N-1}, k drafts):
  step 0   positions valid..N-2: (h_i, x_{i+1}) -> g_{N-2}, d_1        (true entries)
  step j   position N-2+j: (g_{N-3+j}, d_j) -> g_{N-2+j}, d_{j+1}     (speculative entries)
Afterwards valid = N-2 and the hidden of position N-2 is kept, so the next step 0 re-runs it with
the new positions and always has a row to run. Rollback is implicit: speculative entries lie past
``valid`` and step 0 of the next propose overwrites them with true ones before anything reads them.
Guided requests draw under their grammar and a reduced draft vocabulary narrows the head
(draw.py, draft_vocab.py).

Image prompts: at an image placeholder the target read an image embedding, not the token's, and
K3's serving code hands its MTP layer the same rows. ``on_image_embeds`` keeps a prefill chunk's
image rows by position until step 0 runs over them (``_image_embeds``: then eagerly, not as a
graph); without them the MTP cache rows over an image would be the placeholder's, and drafts that
attend to the image would be accepted less often (outputs are the target's either way).

A request resumed from the target's prefix cache (its first hand-over starts at position b > 0:
the hiddens of the cached prompt were never computed) drafts from a window: its MTP sequence
begins at b, its cache rows are those of positions b.. and its MLA attention reads them only. The
window is laid out at local positions p - b; RoPE is relative, so that is the MTP layer run on the
history from b on, at its true positions. No target row is recomputed; drafts start with the first
decode step and see more context as the request goes on.
Draft steps replay CUDA graphs per batch capacity where they fit (mtp_graphs.py; ``graphs``).
Only MTP layer 0 is used; further layers (num_nextn_predict_layers > 1) are not (see the report).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from k3trt.config import ModelConfig
from k3trt.model.context import ModelCache, StepContext
from k3trt.runtime import sampling
from k3trt.runtime.graphs import graphs_by_default
from k3trt.runtime.speculative.draft_model import BlockList, SeqStep, draft_live, drawer, pick_into, step_context
from k3trt.runtime.speculative.drafter import DraftInput, Drafter, Proposal
from k3trt.runtime.speculative.draw import DraftMasks
from k3trt.runtime.speculative.mtp_graphs import MTPGraphs

log = logging.getLogger(__name__)


@dataclass
class _MTPSeq:
    base: int = 0                              # first position of the window (module doc); 0 normally
    blocks: list[int] = field(default_factory=list)
    valid: int = 0                             # MTP cache positions computed from true hiddens
    hidden: torch.Tensor | None = None         # target hiddens of positions valid.. [m, H]
    generator: torch.Generator | None = None
    image_pos: torch.Tensor | None = None      # prompt positions holding image rows, not yet run [n]
    image_rows: torch.Tensor | None = None     # their embeddings [n, H] (on_image_embeds)

    @property
    def known(self) -> int:
        """Positions up to which target hiddens are available (valid + pending rows)."""
        return self.valid + (0 if self.hidden is None else len(self.hidden))


class MTPDrafter(Drafter):
    name = "mtp"
    needs_hidden = True

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, *, k_max: int, max_live: int, max_model_len: int,
                 block_size: int = 16, num_blocks: int | None = None, sample_drafts: bool = False,
                 draft_vocab: torch.Tensor | None = None, graphs: bool | None = None,
                 cache: ModelCache | None = None):
        if cfg.num_nextn_predict_layers < 1:
            raise ValueError("this checkpoint has no MTP layers (num_nextn_predict_layers = 0): "
                             "use --speculative ngram or draft:DIR")
        p = next(model.parameters())
        self.model, self.cfg, self.device, self.k_max = model, cfg, p.device, k_max
        self.block_size = block_size
        self.idx = cfg.num_hidden_layers          # MTP layer 0 (k3.py: layers[num_hidden_layers + j])
        self.draw = drawer(model, cfg, draft_vocab, sample_drafts)
        nb = num_blocks or max_live * -(-(max_model_len + k_max) // block_size)
        # `cache`: one the caller allocated for these nb blocks (a rank's shard: runtime/rank_session.py)
        self.cache = cache or ModelCache.allocate(cfg, num_blocks=nb, block_size=block_size, num_slots=1,
                                                  dtype=p.dtype, device=self.device, layers=range(self.idx, self.idx + 1))
        self.blocks = BlockList(nb)
        self.seqs: dict[str, _MTPSeq] = {}
        self.eager_steps = 0
        self.image_rows = 0                       # image embeddings used in place of token embeddings
        if graphs is None:
            graphs = graphs_by_default(self.device, p.dtype)
        self.graphs = MTPGraphs(self._forward, self._finish, hidden_size=cfg.hidden_size, dtype=p.dtype,
                                device=self.device, max_live=max_live, k_max=k_max,
                                max_blocks=-(-(max_model_len + k_max) // block_size), block_size=block_size,
                                ) if graphs else None
        log.info("MTP drafter: k <= %d, draft vocabulary %s, CUDA graphs %s", k_max,
                 self.draw.head.size, "off" if self.graphs is None else "on" if self.graphs.capture
                 else "static (uncaptured)")

    # ------------------------------------------------------------------------ drafter API
    def on_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        st = self.seqs.get(request_id)
        if st is None or start < st.base:
            if st is not None:
                self.blocks.give(st.blocks)
            if start > 0:     # the history began in the target's prefix cache: a window from here
                log.debug("MTP drafter: %s starts at position %d (prefix cache hit); drafting from a window",
                          request_id, start)
            st = self.seqs[request_id] = _MTPSeq(base=start, valid=start)
        if start > st.known:
            raise ValueError(f"MTP drafter: hidden states for {request_id} start at position {start} but only "
                             f"positions < {st.known} were handed over (every committed position is needed)")
        with torch.inference_mode():      # the MTP layer reads the target's final-normed hidden (module doc)
            h = self.model.model.norm(hidden.detach().to(self.device))
        if start < st.valid:          # recomputed positions (e.g. after preemption): redo from there
            st.valid, st.hidden = start, h.clone()
        else:                          # clone/cat: the runtime may reuse its output buffer
            keep = st.hidden[:start - st.valid] if st.hidden is not None else h[:0]
            st.hidden = torch.cat([keep, h])

    def on_image_embeds(self, request_id: str, positions: torch.Tensor, rows: torch.Tensor) -> None:
        st = self.seqs.get(request_id)
        if st is None:
            return
        positions, rows = positions.to(self.device), rows.to(self.device, self.model.lm_head.weight.dtype)
        if st.image_pos is not None:       # a recomputed chunk (preemption) brings its rows again
            keep = st.image_pos < positions.min()
            positions, rows = torch.cat([st.image_pos[keep], positions]), torch.cat([st.image_rows[keep], rows])
        st.image_pos, st.image_rows = positions, rows

    def propose(self, inputs: Sequence[DraftInput], k: int) -> Proposal:
        k = min(k, self.k_max)
        out = Proposal.empty(len(inputs))
        live: list[tuple[int, DraftInput, _MTPSeq, int]] = []
        for i, inp in enumerate(inputs):
            want, N = inp.limit(k), len(inp.token_ids)
            st = self.seqs.get(inp.request_id)
            if not want or st is None or st.hidden is None or st.known < N - 1 or st.valid >= N - 1:
                continue                       # no hand-over yet for every committed position
            st.hidden = st.hidden[:N - 1 - st.valid]
            if not self.blocks.grow(st.blocks, N - 2 + want - st.base, self.block_size):
                continue
            if st.generator is None and self.draw.sample_drafts and inp.params is not None and not inp.params.greedy:
                st.generator = sampling.make_generator(inp.seed, self.device)
            live.append((i, inp, st, want))
        if not live:
            return out
        draft_live(self, live, out)
        return out

    def release(self, request_id: str) -> None:
        st = self.seqs.pop(request_id, None)
        if st is not None:
            self.blocks.give(st.blocks)

    def stats(self) -> dict[str, int]:
        steps = {f"{k}_steps": v for k, v in self.graphs.stats.items()} if self.graphs is not None else {}
        return {**self.draw.stats(), **steps, "eager_steps": self.eager_steps, "image_rows": self.image_rows}

    # ------------------------------------------------------------------------ internals
    def _draft(self, live: list, out: Proposal, qs: dict[int, list], masks: DraftMasks | None) -> None:
        """The draft steps of propose (module doc); a row whose draw gives no token drafts no further."""
        steps = [SeqStep(inp.token_ids[st.valid + 1:], st.valid - st.base, st.blocks, 0) for _, inp, st, _ in live]
        prev = torch.cat([st.hidden for _, _, st, _ in live])
        embeds = self._image_embeds(live, steps)
        for _, inp, st, _ in live:
            st.valid, st.hidden = len(inp.token_ids) - 2, st.hidden[-1:]
        rows = live
        for j in range(max(w for *_, w in live)):
            g, logits = self._step(steps, prev, embeds)
            embeds = None
            toks = pick_into(self.draw, logits, rows, masks, out, qs)
            # the next step's rows: the sequences that want more than j + 1 drafts and got this one
            keep = [a for a, r in enumerate(rows) if r[3] > j + 1 and toks[a] is not None]
            if not keep:
                return
            rows, prev = [rows[a] for a in keep], g[keep]
            steps = [SeqStep([out.tokens[i][-1]], len(inp.token_ids) - 1 + j - st.base, st.blocks, 0)
                     for i, inp, st, _ in rows]

    def _image_embeds(self, live: list, steps: list[SeqStep]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows int64 [n] of step 0's flat tokens, their image embeddings [n, H]): step 0's row r of
        a sequence embeds the token at position valid + 1 + r, where the target read an image
        embedding if that position is an image placeholder. The sequences' rows are used up here."""
        rows, values, t0 = [], [], 0
        for (_, _, st, _), s in zip(live, steps):
            if st.image_pos is not None:
                first = st.valid + 1
                here = (st.image_pos >= first) & (st.image_pos < first + len(s.tokens))
                rows.append(st.image_pos[here] - first + t0)
                values.append(st.image_rows[here])
                st.image_pos = st.image_rows = None
            t0 += len(s.tokens)
        if not rows or not sum(len(r) for r in rows):
            return None
        self.image_rows += sum(len(r) for r in rows)
        return torch.cat(rows), torch.cat(values)

    def _step(self, steps: list[SeqStep], prev: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward: (g at each sequence's last row [S, H], after shared_head.norm: the next
        step's previous hidden; logits there over the draft head's columns [S, N] fp32). Mirrors
        K3ForCausalLM.mtp(0, …) but takes the head only at the last rows: step 0 may hold a whole
        prompt, and logits for every row would cost T x V. A replayed graph when one fits (and no
        image rows replace token embeddings: `embeds`, _image_embeds)."""
        key = self.graphs.fits(steps) if self.graphs is not None and embeds is None else None
        if key is not None:
            return self.graphs.run(key, steps, prev)
        self.eager_steps += 1
        ids, ctx = step_context(steps, self.block_size, self.device)
        h = self._forward(ids, prev, ctx, embeds)
        return self._finish(h[torch.tensor(ctx.cu_q[1:], device=self.device) - 1])

    def _forward(self, ids: torch.Tensor, prev: torch.Tensor, ctx: StepContext,
                 embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        m = self.model
        x = m.model.embed_tokens(ids)
        if embeds is not None:             # the image rows the target read at these positions
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        return m.model.layers[self.idx](x, prev.to(m.lm_head.weight.dtype), ctx, self.cache)

    def _finish(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.model.model.layers[self.idx].shared_head.norm(h)
        return g, self.draw.head(g)


def mtp_forward(model: torch.nn.Module, cache: ModelCache, ids: torch.Tensor, ctx, prev: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer 0 over one step (MTPDrafter._step's forward): (g at each sequence's last row after
    shared_head.norm [S, H], its logits [S, V] fp32, gathered over TP ranks)."""
    layer = model.model.layers[model.cfg.num_hidden_layers]
    h = layer(model.model.embed_tokens(ids), prev.to(model.lm_head.weight.dtype), ctx, cache)
    g = layer.shared_head.norm(h[torch.tensor(ctx.cu_q[1:], device=ids.device) - 1])
    return g, model._head(g).float()
