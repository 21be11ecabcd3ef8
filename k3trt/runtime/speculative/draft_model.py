"""A draft model: any smaller K3-format checkpoint (same vocabulary), run by the same model code
with its own caches, drafting autoregressively.

Caches: the drafter owns a ``ModelCache`` of the draft model (paged MLA blocks from its own free
list, one KDA slot per live request) — nothing is shared with the target's cache manager, so the
runtime's block accounting is untouched by drafting. Per request it keeps ``cached``: how many
leading history tokens are in those caches (all of them committed).

propose (history x_0..x_{L-1}, k drafts):
  step 0    run x_cached..x_{L-1} (a catch-up chunk: the whole prompt the first time, then 1 or 2
            tokens) -> d_1; cached = L
  step j    run d_j at position L-1+j -> d_{j+1}          (j = 1..k-1; d_k is never run)
After every step j the KDA state and conv window of the slot are copied into the cache's per-
position buffers ``step_state[slot, j]`` / ``step_conv[slot, j]`` (allocated with max_q = k_max),
so rollback is a copy back: when the runtime commits c, the drafter keeps the m drafts fed that
c confirms (m = common prefix of d_1..d_{k-1} and c, at most len(c) - 1 so one token is always left
to run), restores the state saved after step m, and sets cached = L + m. MLA rows past ``cached``
are stale but never read: the next step overwrites them before attending up to its own length.

Drafts are the draft model's argmax (one-hot q) unless ``sample_drafts`` and the request samples:
then d_j is drawn from q = sampling.probs(draft logits, request params) with a generator of the
drafter's own (seeded by DraftInput.seed), and q is returned for stochastic acceptance. Guided
requests draw under their grammar, and a reduced draft vocabulary narrows the head (draw.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from k3trt.config import ModelConfig
from k3trt.model.context import ModelCache, StepContext
from k3trt.model.loader import load_model
from k3trt.runtime import sampling
from k3trt.runtime.speculative.draft_vocab import DraftHead
from k3trt.runtime.speculative.drafter import Drafter, DraftInput, Proposal, common_prefix
from k3trt.runtime.speculative.draw import DraftMasks, Drawer

log = logging.getLogger(__name__)


class SeqStep(NamedTuple):
    tokens: Sequence[int]
    ctx_len: int
    blocks: Sequence[int]
    slot: int


def step_context(steps: Sequence[SeqStep], block_size: int, device: torch.device) -> tuple[torch.Tensor, StepContext]:
    """input_ids [T] and the StepContext of one forward over `steps` (flat layout, context.py)."""
    ids, slots = [], []
    table = torch.zeros(len(steps), max(len(s.blocks) for s in steps), dtype=torch.int32)
    for i, s in enumerate(steps):
        pos = torch.arange(s.ctx_len, s.ctx_len + len(s.tokens))
        blocks = torch.tensor(list(s.blocks), dtype=torch.int64)
        table[i, :len(blocks)] = blocks.to(torch.int32)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        ids.extend(s.tokens)
    ctx = StepContext(tuple(len(s.tokens) for s in steps), tuple(s.ctx_len for s in steps),
                      torch.cat(slots).to(device), table.to(device),
                      torch.tensor([s.slot for s in steps], dtype=torch.int64, device=device))
    return torch.tensor(ids, dtype=torch.int64, device=device), ctx


class BlockList:
    """The drafter's own free list of cache blocks."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))

    def grow(self, blocks: list[int], num_tokens: int, block_size: int) -> bool:
        """Extend `blocks` to hold num_tokens positions; all or nothing."""
        need = -(-num_tokens // block_size) - len(blocks)
        if need > len(self.free):
            return False
        blocks.extend(self.free.pop() for _ in range(max(need, 0)))
        return True

    def give(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))
        blocks.clear()


def pick_into(draw, logits: torch.Tensor, rows: list, masks, out, qs: dict[int, list]) -> list:
    """One draft step's tokens for `rows` (index, input, state, wanted), drawn by `draw` under
    `masks`, appended to `out` with their q; returns them (None: the row's draw gave none)."""
    toks, q = draw.pick(logits, [inp for _, inp, _, _ in rows], [st.generator for _, _, st, _ in rows], masks)
    for (i, *_), t, qr in zip(rows, toks, q):
        if t is not None:
            out.tokens[i].append(t)
            qs[i].append(qr)
    return toks


def draft_live(drafter, live: list, out) -> None:
    """A model drafter's propose after its bookkeeping: `drafter._draft` over the `live` rows under
    their grammar masks (the masks' matchers rolled back however it ends), then each row's q."""
    qs: dict[int, list] = {i: [] for i, *_ in live}
    masks = drafter.draw.masks([inp for _, inp, _, _ in live])
    try:
        with torch.inference_mode():
            drafter._draft(live, out, qs, masks)
    finally:
        if masks is not None:
            masks.close()
    for i in qs:
        out.probs[i] = stack_q(qs[i])


def stack_q(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if not rows or any(r is None for r in rows) else torch.stack(rows)


@dataclass
class _DraftSeq:
    slot: int
    blocks: list[int] = field(default_factory=list)
    cached: int = 0                            # leading history tokens in the caches
    fed: list[int] = field(default_factory=list)   # drafts run past `cached`, not yet verified
    generator: torch.Generator | None = None


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, *, k_max: int, max_live: int, max_model_len: int,
                 block_size: int = 16, num_blocks: int | None = None, sample_drafts: bool = False,
                 draft_vocab: torch.Tensor | None = None):
        p = next(model.parameters())
        self.model, self.cfg, self.device, self.k_max = model, cfg, p.device, k_max
        self.block_size = block_size
        self.draw = drawer(model, cfg, draft_vocab, sample_drafts)
        nb = num_blocks or max_live * -(-(max_model_len + k_max) // block_size)
        self.cache = ModelCache.allocate(cfg, num_blocks=nb, block_size=block_size, num_slots=max_live,
                                         max_q=k_max, dtype=p.dtype, device=self.device,
                                         layers=range(cfg.num_hidden_layers))
        self.blocks = BlockList(nb)
        self.free_slots = list(range(max_live - 1, -1, -1))
        self.seqs: dict[str, _DraftSeq] = {}
        log.info("draft model: %d layers, %d cache blocks x %d, %d slots, k <= %d", cfg.num_hidden_layers, nb,
                 block_size, max_live, k_max)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, *, target_cfg: ModelConfig | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        draft_vocab: Callable[[int], torch.Tensor | None] | None = None,
                        **kw) -> "DraftModelDrafter":
        """`draft_vocab`: the reduced draft vocabulary for the checkpoint's vocabulary size, or None."""
        cfg, model = load_model(ckpt_dir, dtype=dtype, device=device)
        if target_cfg is not None and cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"draft checkpoint {ckpt_dir} has vocab_size {cfg.vocab_size} but the target has "
                             f"{target_cfg.vocab_size}: a draft model must share the target's tokenizer")
        return cls(model, cfg, draft_vocab=None if draft_vocab is None else draft_vocab(cfg.vocab_size), **kw)

    # ------------------------------------------------------------------------ drafter API
    def propose(self, inputs: Sequence[DraftInput], k: int) -> Proposal:
        k = min(k, self.k_max)
        out = Proposal.empty(len(inputs))
        live: list[tuple[int, DraftInput, _DraftSeq, int]] = []
        for i, inp in enumerate(inputs):
            want, L = inp.limit(k), len(inp.token_ids)
            st = self._seq(inp) if want else None
            if st is None:
                continue
            if st.fed:                      # no on_commit since the last propose: reconcile on the history
                self._rollback(st, inp.token_ids[st.cached:])
            if st.cached >= L:              # nothing left to run for logits (history not append-only)
                st.cached = 0
            if not self.blocks.grow(st.blocks, L + want - 1, self.block_size):
                log.debug("draft cache full: no drafts for %s this step", inp.request_id)
                continue
            live.append((i, inp, st, want))
        if not live:
            return out
        draft_live(self, live, out)
        return out

    def _draft(self, live: list, out: Proposal, qs: dict[int, list], masks: DraftMasks | None) -> None:
        """The draft steps of propose (module doc); a row whose draw gives no token drafts no further."""
        steps = [SeqStep(inp.token_ids[st.cached:], st.cached, st.blocks, st.slot) for _, inp, st, _ in live]
        for _, inp, st, _ in live:
            st.cached = len(inp.token_ids)
        rows = live
        for j in range(max(w for *_, w in live)):
            if j:
                rows = [r for r in rows if r[3] > j and len(out.tokens[r[0]]) == j]
                if not rows:
                    return
                steps = [SeqStep([out.tokens[i][-1]], st.cached + j - 1, st.blocks, st.slot) for i, _, st, _ in rows]
                for i, _, st, _ in rows:
                    st.fed.append(out.tokens[i][-1])
            logits = self._logits(steps)
            self._save_state([st.slot for _, _, st, _ in rows], j)
            pick_into(self.draw, logits, rows, masks, out, qs)

    def on_commit(self, request_id: str, tokens: Sequence[int]) -> None:
        st = self.seqs.get(request_id)
        if st is not None and st.fed:
            self._rollback(st, tokens)

    def release(self, request_id: str) -> None:
        st = self.seqs.pop(request_id, None)
        if st is not None:
            self.blocks.give(st.blocks)
            self.free_slots.append(st.slot)

    def stats(self) -> dict[str, int]:
        return self.draw.stats()

    # ------------------------------------------------------------------------ internals
    def _seq(self, inp: DraftInput) -> _DraftSeq | None:
        st = self.seqs.get(inp.request_id)
        if st is None:
            if not self.free_slots:
                return None
            st = self.seqs[inp.request_id] = _DraftSeq(self.free_slots.pop())
        if st.generator is None and self.draw.sample_drafts and inp.params is not None and not inp.params.greedy:
            st.generator = sampling.make_generator(inp.seed, self.device)
        return st

    def _logits(self, steps: list[SeqStep]) -> torch.Tensor:
        """Logits fp32 over the draft head's columns at each step's last row [S, head.size]."""
        ids, ctx = step_context(steps, self.block_size, self.device)
        hidden = self.model(ids, ctx, self.cache)
        last = torch.tensor(ctx.cu_q[1:], device=self.device) - 1
        return self.draw.head(self.model.model.norm(hidden[last]))

    def _save_state(self, slots: list[int], j: int) -> None:
        s = torch.tensor(slots, device=self.device)
        for layer in self.cache.kda.values():
            layer.step_state[s, j] = layer.state[s]
            layer.step_conv[s, j] = layer.conv[s]

    def _rollback(self, st: _DraftSeq, committed: Sequence[int]) -> None:
        """Keep the fed drafts that `committed` confirms (see module doc), restore that KDA state."""
        m = min(common_prefix(st.fed, committed), max(len(committed) - 1, 0))
        with torch.inference_mode():    # one slot, host ints: basic indexing, no copy to the device
            for layer in self.cache.kda.values():
                layer.state[st.slot] = layer.step_state[st.slot, m]
                layer.conv[st.slot] = layer.step_conv[st.slot, m]
        st.cached += m
        st.fed = []


def drawer(model: torch.nn.Module, cfg: ModelConfig, draft_vocab: torch.Tensor | None, sample_drafts: bool) -> Drawer:
    """The Drawer over `model`'s lm_head, reduced to `draft_vocab` when given (draft_vocab.py)."""
    if draft_vocab is not None and getattr(model, "vocab_parallel", False):
        raise ValueError("a reduced draft vocabulary needs the drafter's whole lm_head on one rank "
                         "(this model's is vocab-parallel); leave draft_vocab_size unset")
    return Drawer(DraftHead(model.lm_head, draft_vocab, full=getattr(model, "_head", None)), cfg.vocab_size,
                  sample_drafts)
