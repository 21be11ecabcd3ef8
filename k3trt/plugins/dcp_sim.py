"""A decode-context-parallel (DCP) group simulated on one process: shard a paged cache D ways
(dcp.py's placement), run ``mla_verify`` on every shard and merge the partial results. Host-side,
for tests and checks, not the serving path.

q-rep (opt-in, off by default). Without it, rank r holds the queries of its head shard only; the
group all-gathers q along heads, every rank runs ``mla_verify`` for all heads over its cache
shard, and the partial results are merged per head (``merge_attn_states``) so that each rank ends
with its own heads. With q-rep the queries are already computed replicated on every rank (the
q projection runs unsharded), so the all-gather is skipped; the op call, its arithmetic and the
merge are unchanged. ``simulate_dcp_group`` models both and logs the collectives it would run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dcp import token_rank
from .merge_ref import merge_attn_states_ref
from .mla_verify import mla_verify
from .mla_verify_ref import gather_pages


def shard_paged_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      size: int, interleave: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a global paged cache into `size` rank-local paged caches.

    kv_cache [num_blocks, page, D], block_table int32 [B, max_blocks], seq_lens int32 [B] (global).
    Returns per rank (kv_cache_r [num_blocks_r, page, D], block_table_r int32 [B, max_blocks_r]),
    pages allocated densely per request; unused slots of a rank's last page are NaN-filled (for
    float caches) so that a kernel reading past a length shows up in the tests. Host-side and
    meant for tests and the DCP simulation, not for the serving path.
    """
    page, width = kv_cache.shape[1], kv_cache.shape[2]
    lens = [int(x) for x in seq_lens.tolist()]
    shards = []
    for rank in range(size):
        rows, tables = [], []
        for b, length in enumerate(lens):
            t = torch.arange(length)
            mine = t[token_rank(t, size, interleave) == rank]  # already in local order
            nblk = -(-length // page)
            flat = gather_pages(kv_cache, block_table[b, :nblk].long()).reshape(-1, width)[mine]
            pages = -(-mine.numel() // page)
            padded = _nan_like(kv_cache, pages * page, width)
            padded[: mine.numel()] = flat
            start = sum(r.shape[0] for r in rows)
            rows.append(padded.view(pages, page, width))
            tables.append(list(range(start, start + pages)))
        width_bt = max(1, max(len(x) for x in tables))
        table = torch.zeros(len(lens), width_bt, dtype=torch.int32)
        for b, ids in enumerate(tables):
            table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        cache = torch.cat(rows) if rows else kv_cache.new_zeros(0, page, width)
        if cache.shape[0] == 0:  # a rank with no tokens still needs one addressable page
            cache = _nan_like(kv_cache, page, width).view(1, page, width)
        shards.append((cache.to(kv_cache.device), table.to(block_table.device)))
    return shards


def _nan_like(ref: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    if ref.dtype.is_floating_point and ref.element_size() > 1:
        return torch.full((rows, width), float("nan"), dtype=ref.dtype)
    # fp8 e4m3fn has a NaN encoding (0x7f); build it bytewise since full() may not cover fp8
    return torch.full((rows, width), 0x7F, dtype=torch.uint8).view(ref.dtype)


@dataclass
class DcpLog:
    """Collectives a DCP group would run, as (name, bytes per rank)."""
    collectives: list[tuple[str, int]] = field(default_factory=list)


def simulate_dcp_group(q_per_rank: list[torch.Tensor],
                       shards: list[tuple[torch.Tensor, torch.Tensor]],
                       seq_lens: torch.Tensor, q_per_req: int, softmax_scale: float, *,
                       kv_scale: float = 1.0, d_v: int = 512, interleave: int = 1,
                       q_rep: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor], DcpLog]:
    """Run one DCP group's attention on one process.

    Without q-rep, ``q_per_rank[r]`` is rank r's head shard [T, H/D, D_qk]; with q-rep, every
    entry is the full (identical) query [T, H, D_qk]. Returns per rank (out [T, H_r, d_v],
    lse [T, H_r]) for that rank's heads (H_r = H/D without q-rep, H with it) and the log.
    """
    size = len(shards)
    log = DcpLog()
    if q_rep:
        if any(not torch.equal(q, q_per_rank[0]) for q in q_per_rank):
            raise ValueError("q-rep expects the same full query on every rank")
        q_full = q_per_rank[0]
    else:
        q_full = torch.cat(q_per_rank, dim=1)
        log.collectives.append(("all_gather_q", q_full.numel() * q_full.element_size()))
    partial = [mla_verify(q_full, cache, table, seq_lens, q_per_req, softmax_scale,
                          kv_scale, d_v, size, r, interleave)
               for r, (cache, table) in enumerate(shards)]
    out, lse = partial[0]
    for o, s in partial[1:]:
        out, lse = merge_attn_states_ref(out, lse, o, s)
    log.collectives.append(("merge_partials", sum(o.numel() * o.element_size() + s.numel() * 4
                                                  for o, s in partial)))
    if q_rep:
        return [out] * size, [lse] * size, log
    heads = [q.shape[1] for q in q_per_rank]
    outs, lses, start = [], [], 0
    for h in heads:
        outs.append(out[:, start:start + h])
        lses.append(lse[:, start:start + h])
        start += h
    return outs, lses, log
