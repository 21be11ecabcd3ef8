"""What every per-capacity engine session shares: the step of a ``Batch`` staged as the inputs of
the static graphs of engine/graph_io.py, and ``CapacitySession``, the EngineSession over them.

A session over per-capacity graphs (runtime/onnx_session.py: onnxruntime on the CPU;
runtime/trt_session.py: TensorRT engines on the GPU) keeps the graph contract of
engine/graph_io.py the same way:

- verify runs the smallest verify capacity B covering the live requests, B x Q rows (Q = the
  build's K + 1); padded requests use the scratch KDA slot (one slot past the plan's),
  slot_mapping -1 and seq_lens Q; a request with fewer than Q rows is padded at its end and its
  KDA state is then reset to the state after its last live row;
- prefill runs exactly T tokens of one sequence per graph run: a chunk of n tokens runs as
  PrefillSlices at the capacities ``split_prefill`` gives; a fresh sequence's KDA slot is zeroed
  first (the graph always continues from the slot's contents); prefill graphs with image inputs
  get the slice's rows of ``Batch.embeds`` (``image_embeds`` / ``image_mask``; other rows masked off);
- the caches are the graphs' cache inputs, shared by every capacity; a run hands back each cache
  it writes (``<name>_out``).

A subclass runs one graph (``_run``) and moves cache rows (``_zero_row``, ``_copy_row``); the
rest is here. The graphs give logits only: hidden states for MTP drafting need the torch backend.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from k3trt.config import ModelConfig
from k3trt.engine.capacities import pick, split_prefill
from k3trt.engine.graph_io import GraphSpec, cache_specs
from k3trt.runtime.engine import Batch, EngineSession


@dataclass(frozen=True)
class Binding:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_input: bool

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


def cache_bindings(cfg: ModelConfig, specs: list[GraphSpec], dims: dict[str, int]) -> dict[str, Binding]:
    """Every cache any of the graphs binds, with concrete shapes (`dims`: the DYNAMIC_DIMS)."""
    out = {}
    for spec in specs:
        for t in cache_specs(cfg, spec):
            out.setdefault(t.name, Binding(t.name, tuple(dims.get(d, d) for d in t.shape), t.dtype, True))
    return out


# ------------------------------------------------------------------------------ step -> graph inputs
def verify_inputs(batch: Batch, spec: GraphSpec, scratch_slot: int, *, positions: bool = False):
    """Host inputs of a verify graph for `batch` and the graph rows of the batch's logit rows."""
    S, Q, B = len(batch.q_lens), spec.q_per_req, spec.capacity
    if S > B or any(q > Q for q in batch.q_lens):
        raise ValueError(f"{spec.name} runs {B} requests x {Q} rows; the step has {S} requests with rows "
                         f"{batch.q_lens}")
    ids = torch.zeros(B * Q, dtype=torch.int64)
    slots = torch.full((B * Q,), -1, dtype=torch.int64)
    pos = torch.zeros(B * Q, dtype=torch.int64)
    table = torch.zeros(B, spec.max_blocks, dtype=torch.int32)
    seq_lens = torch.full((B,), Q, dtype=torch.int32)
    kda = torch.full((B,), scratch_slot, dtype=torch.int64)
    engine_row = torch.empty(batch.num_tokens, dtype=torch.int64)
    t = 0
    for i, (q, c) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
        rows = slice(i * Q, i * Q + q)
        ids[rows], slots[rows] = batch.input_ids[t:t + q], batch.slot_mapping[t:t + q]
        pos[rows] = torch.arange(c, c + q)
        engine_row[t:t + q] = torch.arange(i * Q, i * Q + q)
        width = min(batch.block_table.shape[1], spec.max_blocks)
        table[i, :width] = batch.block_table[i, :width]
        seq_lens[i], kda[i] = c + Q, batch.kda_slots[i]      # rows past q only feed padded rows
        t += q
    x = {"input_ids": ids, "slot_mapping": slots, "block_table": table, "seq_lens": seq_lens, "kda_slots": kda}
    if positions:
        x["positions"] = pos
    return x, engine_row[batch.logit_rows]


@dataclass(frozen=True)
class PrefillSlice:
    """One prefill graph run: exactly `capacity` tokens of one sequence's chunk."""
    seq: int          # sequence index in the batch
    start: int        # first token of the slice within the sequence's new tokens
    capacity: int     # tokens (exactly)
    last: bool        # the sequence's last slice: its logits are the sequence's


def prefill_slices(batch: Batch, capacities: tuple[int, ...]) -> list[PrefillSlice]:
    out = []
    for i, n in enumerate(batch.q_lens):
        start, parts = 0, split_prefill(capacities, n)
        for j, cap in enumerate(parts):
            out.append(PrefillSlice(i, start, cap, j == len(parts) - 1))
            start += cap
    return out


def prefill_inputs(batch: Batch, piece: PrefillSlice, spec: GraphSpec, *, positions: bool = False,
                   hidden_size: int = 0) -> dict[str, torch.Tensor]:
    """One slice's graph inputs; `hidden_size`: the width of image_embeds (graphs that take them)."""
    t0 = sum(batch.q_lens[:piece.seq]) + piece.start
    ctx = batch.ctx_lens[piece.seq] + piece.start
    table = torch.zeros(1, spec.max_blocks, dtype=torch.int32)
    width = min(batch.block_table.shape[1], spec.max_blocks)
    table[0, :width] = batch.block_table[piece.seq, :width]
    x = {"input_ids": batch.input_ids[t0:t0 + piece.capacity].clone(),
         "slot_mapping": batch.slot_mapping[t0:t0 + piece.capacity].clone(), "block_table": table,
         "seq_lens": torch.tensor([ctx + piece.capacity], dtype=torch.int32),
         "kda_slots": batch.kda_slots[piece.seq:piece.seq + 1].clone()}
    if positions:
        x["positions"] = torch.arange(ctx, ctx + piece.capacity)
    if spec.image_embeds:
        x["image_embeds"] = torch.zeros(piece.capacity, hidden_size, dtype=spec.dtype)
        x["image_mask"] = torch.zeros(piece.capacity, dtype=torch.bool)
        if batch.embeds is not None:
            rows, values = batch.embeds
            here = (rows >= t0) & (rows < t0 + piece.capacity)
            x["image_embeds"][rows[here] - t0] = values[here].to("cpu", spec.dtype)
            x["image_mask"][rows[here] - t0] = True
    elif batch.embeds is not None and bool(((batch.embeds[0] >= t0) & (batch.embeds[0] < t0 + piece.capacity)).any()):
        raise NotImplementedError(f"{spec.name} takes token ids only, not image embeddings (media.NO_EMBEDS)")
    return x


# ------------------------------------------------------------------------------ the shared session
class CapacitySession(EngineSession):
    """An EngineSession over per-capacity graphs (module doc). A subclass sets ``specs`` (graph
    name -> GraphSpec), ``verify_caps``, ``prefill_caps``, ``scratch_slot``, ``rope`` (the graphs
    take positions) and ``cache_names``, and implements the three primitives."""
    specs: dict[str, GraphSpec]
    verify_caps: tuple[int, ...]
    prefill_caps: tuple[int, ...]
    scratch_slot: int
    rope: bool
    cache_names: frozenset[str]

    @abc.abstractmethod
    def _run(self, name: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run graph `name` on these step inputs and the caches (which it advances); its logits
        [rows, V] fp32 on self.device (valid until the next run)."""

    @abc.abstractmethod
    def _zero_row(self, cache: str, row: int) -> None: ...

    @abc.abstractmethod
    def _copy_row(self, dst: str, drow: int, src: str, srow: int, sub: int | None = None) -> None:
        """cache dst[drow] = cache src[srow] (or src[srow, sub] for per-position states)."""

    def _sync(self) -> None:
        """Wait for queued row copies (a device stream); nothing to wait for by default."""

    @staticmethod
    def _no_hidden(batch: Batch) -> None:
        if batch.keep_hidden:
            raise NotImplementedError("engine graphs give logits only, not hidden states: MTP drafting needs "
                                      "a torch engine dir (--speculative ngram or draft:DIR run on any)")

    def verify(self, batch: Batch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        if device_ids is not None:
            raise NotImplementedError("a per-capacity engine session takes token ids from the batch only")
        self._no_hidden(batch)
        name = f"verify_b{pick(self.verify_caps, len(batch.q_lens), 'verify')}"
        spec = self.specs[name]
        x, rows = verify_inputs(batch, spec, self.scratch_slot, positions=self.rope)
        logits = self._run(name, x)[rows.to(self.device)]
        short = [(int(s), q - 1) for s, q in zip(batch.kda_slots, batch.q_lens) if q < spec.q_per_req]
        if short:                 # padded rows advanced these states: back to the last live row
            self.rollback_kda([s for s, _ in short], [p for _, p in short])
        return logits

    def prefill(self, batch: Batch) -> torch.Tensor:
        self._no_hidden(batch)
        ends = {i: sum(batch.q_lens[:i + 1]) - 1 for i in range(len(batch.q_lens))}
        wanted = {int(r): i for i, e in ends.items() for r in batch.logit_rows.tolist() if r == e}
        if len(wanted) != len(batch.logit_rows):
            raise ValueError("prefill graphs give logits of a sequence's last token only; "
                             f"asked for rows {batch.logit_rows.tolist()}")
        for i, c in enumerate(batch.ctx_lens):
            if c == 0:                # the graph continues from the slot: a fresh sequence starts at zero
                self._zero_kda_slot(int(batch.kda_slots[i]))
        last = {}
        for piece in prefill_slices(batch, self.prefill_caps):
            name = f"prefill_t{piece.capacity}"
            logits = self._run(name, prefill_inputs(batch, piece, self.specs[name], positions=self.rope,
                                                    hidden_size=self.cfg.hidden_size))
            if piece.last:
                last[piece.seq] = logits[0].clone()
        return torch.stack([last[wanted[int(r)]] for r in batch.logit_rows.tolist()]) if wanted else \
            torch.empty(0, self.cfg.vocab_size, device=self.device)

    def _zero_kda_slot(self, slot: int) -> None:
        for layer in self.cfg.kda_layers:
            for kind in ("kda_state", "kda_conv"):
                self._zero_row(f"{kind}_{layer}", slot)

    def copy_kda(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:        # in order: a later pair may read a slot an earlier one wrote
            for layer in self.cfg.kda_layers:
                for kind in ("kda_state", "kda_conv"):
                    self._copy_row(f"{kind}_{layer}", dst, f"{kind}_{layer}", src)

    def rollback_kda(self, slots: list[int], positions: list[int]) -> None:
        for layer in self.cfg.kda_layers:
            for kind in ("state", "conv"):
                step = f"kda_step_{kind}_{layer}"
                if step not in self.cache_names:
                    raise RuntimeError("rollback_kda needs a verify graph with per-position KDA states")
                for s, p in zip(slots, positions):
                    self._copy_row(f"kda_{kind}_{layer}", s, step, s, sub=p)
        self._sync()
