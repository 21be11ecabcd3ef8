"""A rank's caches: KDA state for its heads, and the MLA cache addressing of its DCP shard.

Under DCP each rank has its own block pool and stores its tokens densely in local order
(k3trt/plugins/dcp.py: token t on rank ``(t // I) % D`` at local index
``(t // (D·I))·I + t % I``); a sequence's block-table row on a rank lists that rank's pages. The
step context a rank's model sees keeps the GLOBAL q_lens / ctx_lens (so ``seq_lens()`` is global,
as ``k3trt::mla_verify`` wants) with a LOCAL block_table and a slot_mapping that is -1 for the
tokens other ranks store (``k3trt::mla_cache_write`` skips them).
"""

from __future__ import annotations

import dataclasses

import torch

from k3trt.config import ModelConfig
from k3trt.model.context import ModelCache
from k3trt.parallel.config import ParallelConfig
from k3trt.plugins.dcp import local_index, token_rank


def allocate_cache(cfg: ModelConfig, pc: ParallelConfig, **kwargs) -> ModelCache:
    """``ModelCache.allocate`` for rank pc.rank: KDA state and conv windows for its
    linear_attn_config.num_heads / tp heads; MLA caches of ``num_blocks`` (its own pool)."""
    la = cfg.linear_attn_config
    local = dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(la, num_heads=la.num_heads // pc.tp))
    return ModelCache.allocate(local, **kwargs)


def dcp_slot_mapping(ctx_lens, q_lens, block_table: torch.Tensor, block_size: int,
                     pc: ParallelConfig) -> torch.Tensor:
    """int64 [T]: the local cache row of each of the step's new tokens on DCP rank pc.dcp_rank, or
    -1 where another rank stores it. block_table int32 [S, max_blocks] is this rank's (local order)."""
    D, I = pc.dcp, pc.dcp_interleave
    out = []
    for i, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        t = torch.arange(c, c + n)
        mine = token_rank(t, D, I) == pc.dcp_rank
        li = local_index(t[mine], D, I)
        rows = torch.full((n,), -1, dtype=torch.long)
        rows[mine] = block_table[i].long().cpu()[li // block_size] * block_size + li % block_size
        out.append(rows)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)
