"""Engine sessions: what runs one step's forward passes, behind one small interface.

    session.prefill(batch) -> logits [len(batch.logit_rows), V] fp32   (token-capacity engines)
    session.verify(batch)  -> logits [T, V] fp32, every row            (batch-capacity engines)
    session.copy_kda(pairs)                 KDA slot copies (prefix-cache checkpoints), in order
    session.rollback_kda(slots, positions)  KDA slot <- its state after position j of the last
                                            verify step (speculative rollback)
    session.hidden                          after a forward of a batch with keep_hidden: its hidden
                                            states [T, hidden] (pre-final-norm, every row; MTP
                                            drafting), else None
    session.encode_images(pixels, grids)    the vision tower on a step's images (sessions with
                                            ``takes_embeds``: a prefill Batch may carry ``embeds``)

A verify step holds S requests with 1 + len(drafts) rows each: decode is verify with no drafts.
``Batch`` carries the step in the flat token layout of k3trt/model/context.py, on the host, plus
the capacity it runs at; a graph- or engine-backed session pads to that capacity, the eager torch
session runs the live rows only.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import numpy as np
import torch

from k3trt.config import ModelConfig
from k3trt.model.context import ModelCache, StepContext
from k3trt.model.fuse import fuse_projections_
from k3trt.runtime.kv_cache import CachePlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: its new tokens after `ctx_len` cached ones."""
    tokens: list[int]
    ctx_len: int
    blocks: list[int]
    kda_slot: int
    num_logits: int                # logits wanted for this many trailing rows (prefill: 0 or 1)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor        # int64 [T]
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    slot_mapping: torch.Tensor     # int64 [T]: block · block_size + offset
    block_table: torch.Tensor      # int32 [S, max_blocks] (unused entries 0)
    kda_slots: torch.Tensor        # int64 [S]
    logit_rows: torch.Tensor       # int64 [R]: the rows whose logits are wanted
    capacity: int                  # the capacity bucket this step runs at
    save_kda_states: bool = False  # keep the KDA state after every row (verification with drafts)
    keep_hidden: bool = False      # keep every row's hidden state in session.hidden (MTP drafting)
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None   # (rows int64 [N], [N, hidden]): image
                                   # embeddings replacing those rows' token embeddings (prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def make_batch(seqs: list[Seq], block_size: int, *, capacity: int, save_kda_states: bool = False,
               keep_hidden: bool = False, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> Batch:
    """Flatten `seqs` into one step (host tensors). Built in numpy and turned into tensors once per
    field: at batch 128 a few torch calls per sequence cost milliseconds a step."""
    n = np.array([len(s.tokens) for s in seqs], dtype=np.int64)
    ctx = np.array([s.ctx_len for s in seqs], dtype=np.int64)
    width = max(len(s.blocks) for s in seqs)
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, :len(s.blocks)] = s.blocks
    seq = np.repeat(np.arange(len(seqs)), n)                            # each token's sequence
    ends = np.cumsum(n)
    pos = np.repeat(ctx - (ends - n), n) + np.arange(int(ends[-1]) if len(ends) else 0)
    slots = table[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    k = np.array([s.num_logits for s in seqs], dtype=np.int64)
    rows = np.repeat(ends - k, k) + np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
    return Batch(input_ids=torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int64),
                 q_lens=tuple(n.tolist()), ctx_lens=tuple(ctx.tolist()),
                 slot_mapping=torch.from_numpy(slots), block_table=torch.from_numpy(table),
                 kda_slots=torch.tensor([s.kda_slot for s in seqs], dtype=torch.int64),
                 logit_rows=torch.from_numpy(rows.astype(np.int64)), capacity=capacity,
                 save_kda_states=save_kda_states, keep_hidden=keep_hidden, embeds=embeds)


class EngineSession(abc.ABC):
    """One loaded model with its caches on one device."""
    cfg: ModelConfig
    plan: CachePlan
    device: torch.device
    hidden: torch.Tensor | None = None
    takes_embeds: bool = False     # prefill takes Batch.embeds and encode_images runs (image requests)

    @abc.abstractmethod
    def prefill(self, batch: Batch) -> torch.Tensor: ...

    @abc.abstractmethod
    def verify(self, batch: Batch, device_ids: torch.Tensor | None = None) -> torch.Tensor: ...

    @abc.abstractmethod
    def copy_kda(self, pairs: list[tuple[int, int]]) -> None: ...

    @abc.abstractmethod
    def rollback_kda(self, slots: list[int], positions: list[int]) -> None: ...

    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """The vision tower on a step's images: [sum image tokens, hidden] in image order."""
        raise NotImplementedError(f"{type(self).__name__} runs no vision encoder")


class TorchSession(EngineSession):
    """The eager torch backend: the model of k3trt/model run as is, live rows only (graphs.py adds
    the padded static steps and their CUDA graphs)."""
    takes_embeds = True

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, plan: CachePlan, *, device: torch.device | str,
                 dtype: torch.dtype, kv_dtype: torch.dtype, kv_scale: float = 1.0, max_q: int = 0,
                 spare_slots: int = 0, fuse: bool | None = None):
        self.model, self.cfg, self.plan, self.device = model, cfg, plan, torch.device(device)
        # fused projections (model/fuse.py): one GEMM where several read the same input; on the
        # GPU by default, where decode is launch- and bandwidth-bound
        if self.device.type == "cuda" if fuse is None else fuse:
            fuse_projections_(model)
        # spare KDA slots past the plan's: padding rows of static steps write there (graphs.py)
        self.cache = ModelCache.allocate(cfg, num_blocks=plan.num_blocks, block_size=plan.block_size,
                                         num_slots=plan.num_slots + spare_slots, max_q=max_q, dtype=dtype, kv_dtype=kv_dtype,
                                         kv_scale=kv_scale, device=self.device,
                                         layers=range(cfg.num_hidden_layers))
        log.info("torch session on %s: %d MLA + %d KDA layers, %s cache", self.device, len(self.cache.mla),
                 len(self.cache.kda), kv_dtype)

    def _forward(self, batch: Batch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        dev = self.device
        ctx = StepContext(batch.q_lens, batch.ctx_lens, batch.slot_mapping.to(dev), batch.block_table.to(dev),
                          batch.kda_slots.to(dev), batch.save_kda_states)
        logit_rows = batch.logit_rows.to(dev)     # before the forward: after it, the copy would wait for it
        embeds = None if batch.embeds is None else (batch.embeds[0].to(dev), batch.embeds[1].to(dev))
        with torch.inference_mode():
            ids = batch.input_ids.to(dev) if device_ids is None else device_ids
            hidden = self.model(ids, ctx, self.cache, embeds=embeds)
            self.hidden = hidden if batch.keep_hidden else None
            return self.model.logits(hidden[logit_rows])

    def prefill(self, batch: Batch) -> torch.Tensor:
        return self._forward(batch)

    def encode_images(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        tower = self.model.vision
        dtype = next(tower.parameters()).dtype
        with torch.inference_mode():
            return tower(pixel_values.to(self.device, dtype), grid_thws.to(self.device))

    def verify(self, batch: Batch, device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """device_ids: the step's token ids already on the device (int64 [T]), used instead of
        batch.input_ids (runtime/lookahead.py)."""
        return self._forward(batch, device_ids)

    def copy_kda(self, pairs: list[tuple[int, int]]) -> None:
        # one pair at a time, in order: a later pair may read a slot an earlier one wrote
        for src, dst in pairs:
            self.cache.copy_kda(src, dst)

    def rollback_kda(self, slots: list[int], positions: list[int]) -> None:
        self._restore_kda(torch.tensor(slots, device=self.device), torch.tensor(positions, device=self.device))

    def _restore_kda(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """KDA slot `slots[i]` <- its state after position `positions[i]` of the last verify step."""
        self.cache.restore_kda(slots, positions)

