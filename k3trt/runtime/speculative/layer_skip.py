"""Self-speculation by layer skipping: the target's first N decoder layers, its embedding, final
norm (and AttnRes output mix) and lm_head draft for it. No new weights: ``LayerSkipModel`` holds
the target's own modules; only its caches are new (the drafter's, as for any draft model).

    --speculative layerskip:N      (1 <= N < the target's num_hidden_layers)

``skip_config`` is the target's config cut to N layers: the KDA / full-attention layer lists keep
only the first N, AttnRes counts ceil(N / block_size) blocks, no MTP layers. Each kept layer
computes exactly what it computes in the target (same index, same AttnRes block it writes); the
output mix then reads the blocks written so far.

Drafting runs DraftModelDrafter's loop (draft_model.py). With ``graphs`` (default: on CUDA in
bf16/fp16), every forward goes through a GraphSession over the draft model and the drafter's
cache: steps of 1 token per request (the draft steps, the catch-up after a rejection) and of 2
(the catch-up after a fully accepted block) replay a CUDA graph captured per batch capacity, a
batch of uneven catch-ups padded to 2 (graphs.py); whole prompts run eagerly in that session. On the CPU ``graphs=True`` runs the same padded static steps uncaptured (tests).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from k3trt.config import ModelConfig
from k3trt.engine.capacities import power_of_two_capacities
from k3trt.model.k3 import K3ForCausalLM, K3Model
from k3trt.runtime.engine import Seq, make_batch
from k3trt.runtime.graphs import GraphSession, graphs_by_default
from k3trt.runtime.kv_cache import CachePlan
from k3trt.runtime.speculative.draft_model import BlockList, DraftModelDrafter, SeqStep, drawer

log = logging.getLogger(__name__)


def skip_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """`cfg` cut to its first n decoder layers, without MTP layers (derived fields follow)."""
    if not 1 <= n < cfg.num_hidden_layers:
        raise ValueError(f"layerskip:{n}: N must be in 1..{cfg.num_hidden_layers - 1} "
                         f"(the target has {cfg.num_hidden_layers} layers)")
    la = cfg.linear_attn_config
    la = dataclasses.replace(la, kda_layers=tuple(i for i in la.kda_layers if i <= n),
                             full_attn_layers=tuple(i for i in la.full_attn_layers if i <= n))
    return dataclasses.replace(cfg, num_hidden_layers=n, num_nextn_predict_layers=0, linear_attn_config=la,
                               first_k_dense_replace=min(cfg.first_k_dense_replace, n))


class _SkipModel(K3Model):
    """K3Model.forward over the target's modules, cut to cfg.num_hidden_layers layers."""

    def __init__(self, target: K3Model, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.embed_tokens = target.embed_tokens
        self.layers = nn.ModuleList(list(target.layers[:cfg.num_hidden_layers]))
        self.norm = target.norm
        if cfg.attn_res_block_size:
            self.output_attn_res_norm = target.output_attn_res_norm
            self.output_attn_res_proj = target.output_attn_res_proj


class LayerSkipModel(K3ForCausalLM):
    """A K3ForCausalLM whose modules are the target's (shared, not copied) and whose config has N
    layers and no MTP layers."""

    def __init__(self, target: K3ForCausalLM, n: int):
        nn.Module.__init__(self)
        self.cfg, self.comm = skip_config(target.cfg, n), target.comm
        self.model = _SkipModel(target.model, self.cfg)
        self.vocab_parallel = target.vocab_parallel
        self.lm_head = target.lm_head


class LayerSkipDrafter(DraftModelDrafter):
    name = "layerskip"

    def __init__(self, target: K3ForCausalLM, n: int, *, k_max: int, max_live: int, max_model_len: int,
                 block_size: int = 16, num_blocks: int | None = None, sample_drafts: bool = False,
                 graphs: bool | None = None, draft_vocab: torch.Tensor | None = None):
        model = LayerSkipModel(target, n)
        p = next(target.parameters())
        if graphs is None:
            graphs = graphs_by_default(p.device, p.dtype)
        if not graphs:
            super().__init__(model, model.cfg, k_max=k_max, max_live=max_live, max_model_len=max_model_len,
                             block_size=block_size, num_blocks=num_blocks, sample_drafts=sample_drafts,
                             draft_vocab=draft_vocab)
            self.session = None
        else:       # DraftModelDrafter's state, with the session's cache as the drafter's cache
            nb = num_blocks or max_live * -(-(max_model_len + k_max) // block_size)
            self.session = _graph_session(model, nb, block_size, max_live, k_max, max_model_len)
            self.model, self.cfg, self.device, self.k_max = model, model.cfg, p.device, k_max
            self.block_size = block_size
            self.draw = drawer(model, model.cfg, draft_vocab, sample_drafts)
            self.cache = self.session.cache
            self.blocks = BlockList(nb)
            self.free_slots = list(range(max_live - 1, -1, -1))
            self.seqs = {}
        self.num_blocks = len(self.blocks.free)
        log.info("layer-skip draft: the target's first %d of %d layers, CUDA graphs %s", n,
                 target.cfg.num_hidden_layers, "on" if self.session is not None and self.session.capture
                 else "static (uncaptured)" if self.session is not None else "off")

    def _logits(self, steps: list[SeqStep]) -> torch.Tensor:
        if self.session is None:
            return super()._logits(steps)
        seqs = [Seq(list(s.tokens), s.ctx_len, list(s.blocks), s.slot, 1) for s in steps]
        caps = self.session.capacities
        cap = next((c for c in caps if c >= len(seqs)), len(seqs))
        # the graphs score every id; a reduced draft vocabulary keeps its columns (no saving here)
        return self.draw.head.columns(self.session.verify(make_batch(seqs, self.block_size, capacity=cap)))


def _graph_session(model: LayerSkipModel, num_blocks: int, block_size: int, max_live: int, k_max: int,
                   max_model_len: int):
    """A GraphSession over the draft model: steps of 1 token per request (the draft steps) and of 2
    (the catch-up after a fully accepted block: the last draft and the bonus token) at power-of-two
    capacities up to max_live; its cache (max_q = k_max for the per-step KDA states) is the drafter's."""
    p = next(model.parameters())
    plan = CachePlan(block_size=block_size, num_blocks=num_blocks, max_live=max_live, num_checkpoints=0,
                     bytes_per_block=0, bytes_per_slot=0)
    caps = tuple(power_of_two_capacities(max_live))
    session = GraphSession(model, model.cfg, plan, device=p.device, dtype=p.dtype, kv_dtype=p.dtype,
                           max_q=k_max, capacities=caps, q_values=(1, 2) if k_max >= 2 else (1,),
                           max_blocks=-(-(max_model_len + k_max) // block_size))
    return session
