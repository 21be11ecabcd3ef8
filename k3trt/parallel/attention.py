"""Absorbed-MLA attention over a DCP-sharded cache: each rank attends over its own tokens, the
partial (out, lse) merge exactly (spec/K3_MODEL.md, "KV cache and verification").

One DCP group of D ranks, per MLA layer and step (T query rows, H_l heads per rank):
1. q: with tp > 1 the group's ranks hold different heads, so q [T, H_l, 576] is all-gathered
   along heads to [T, D·H_l, 576] (slot j = DCP rank j's heads). With tp == 1 every rank already
   computes every head (q-rep by construction) and nothing is gathered.
2. ``k3trt::mla_verify`` with (dcp_size, dcp_rank, dcp_interleave) over the local cache: every
   row sees the local share of its global visible length. Steps whose sequences bring different
   numbers of tokens (chunked prefill) run one call per sequence (q_per_req = its q_len).
3. (out [T, Hg, 512], lse [T, Hg]) are all-gathered over the group, and each rank folds the D
   partials of its own heads with ``k3trt::merge_attn_states`` (fp32). The merge runs in the
   same order on every rank, so replicated ranks stay bit-identical.
Bytes received per rank and layer: q (D-1)·T·H_l·576·b, partials (D-1)·T·Hg·(512·b + 4).
Cheaper for step 3 (left for the multi-GPU runs to measure): vLLM's all-gather of lse only, then
a reduce-scatter over heads of the partial outs rescaled by exp(lse - LSE) (1/D of the out bytes),
or an all-to-all of head slots followed by the same merge.
"""

from __future__ import annotations

import torch

from k3trt.model.context import StepContext
from k3trt.parallel.comm import Comm


def dcp_mla_attention(q: torch.Tensor, ctx: StepContext, kv_cache: torch.Tensor, softmax_scale: float,
                      kv_scale: float, d_v: int, comm: Comm) -> torch.Tensor:
    """q [T, H_l, d_v + rope] (this rank's heads, absorbed) -> out_lat [T, H_l, d_v] in q's dtype.
    kv_cache / ctx.block_table: this rank's shard in local token order; ctx lengths are global."""
    pc = comm.pc
    heads = q.shape[1]
    if q.shape[0] == 0:                                      # the same on every rank: no collective
        return q.new_zeros(0, heads, d_v)
    gathered = pc.tp > 1
    qg = comm.all_gather(q, "dcp", dim=1) if gathered else q
    seq_lens = ctx.seq_lens().to(q.device)
    n = ctx.uniform_q
    groups = [(0, ctx.num_seqs, n)] if n is not None else [(i, i + 1, m) for i, m in enumerate(ctx.q_lens)]
    cu, outs, lses = ctx.cu_q, [], []
    for s0, s1, m in groups:
        if m == 0:
            continue
        o, s = torch.ops.k3trt.mla_verify(qg[cu[s0]:cu[s1]], kv_cache, ctx.block_table[s0:s1], seq_lens[s0:s1],
                                          m, softmax_scale, kv_scale, d_v, pc.dcp, pc.dcp_rank,
                                          pc.dcp_interleave)
        outs.append(o)
        lses.append(s)
    out, lse = torch.cat(outs), torch.cat(lses)
    parts_out = comm.all_gather(out[None], "dcp")            # [D, T, Hg, d_v]
    parts_lse = comm.all_gather(lse[None], "dcp")            # [D, T, Hg]
    if gathered:
        mine = slice(pc.dcp_rank * heads, (pc.dcp_rank + 1) * heads)
        parts_out, parts_lse = parts_out[:, :, mine], parts_lse[:, :, mine]
    parts_out, parts_lse = parts_out.float().contiguous(), parts_lse.contiguous()
    o, s = parts_out[0], parts_lse[0]
    for k in range(1, parts_out.shape[0]):
        o, s = torch.ops.k3trt.merge_attn_states(o, s, parts_out[k], parts_lse[k])
    return o.to(q.dtype)
