"""Plain-torch side of ``k3trt::mla_verify`` (mla_verify.py has the op, its layouts and semantics):
the oracle, the visibility and sparse-policy helpers it is built from, the argument checks and what
the Triton kernel covers. Imported by the op, the DCP simulation and the tests alike.
"""

from __future__ import annotations

import torch

from .dcp import local_len

FP8 = torch.float8_e4m3fn


def visible_lengths(seq_len: int, q_per_req: int, dcp_size: int = 1, dcp_rank: int = 0,
                    dcp_interleave: int = 1) -> list[int]:
    """Local visible length of each of a request's Q rows (spec test vector:
    L=17, Q=4, D=4, r=3, I=2 → [2, 3, 4, 4])."""
    return [local_len(max(seq_len - (q_per_req - 1 - j), 0), dcp_size, dcp_rank, dcp_interleave)
            for j in range(q_per_req)]


def sparse_keep(n_tokens: int, chunk: int, sink: int, stride: int, recent: int) -> torch.Tensor:
    """Bool [n_tokens]: which local tokens the sparse policy keeps (all when chunk == 0)."""
    if chunk <= 0:
        return torch.ones(n_tokens, dtype=torch.bool)
    c = torch.arange(n_tokens) // chunk
    n_chunks = -(-n_tokens // chunk)
    return (c < sink) | (c >= n_chunks - recent) | ((c - sink) % stride == 0)


def mla_verify_ref(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale=1.0,
                   d_v=512, dcp_size=1, dcp_rank=0, dcp_interleave=1, sparse_chunk=0,
                   sparse_sink=1, sparse_stride=1, sparse_recent=1):
    """The oracle: per request, gather the visible cache, softmax in fp32."""
    rows, heads, _ = q.shape
    page = kv_cache.shape[1]
    out = torch.zeros(rows, heads, d_v, dtype=torch.float32, device=q.device)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b, length in enumerate(seq_lens.tolist()):
        vis = visible_lengths(length, q_per_req, dcp_size, dcp_rank, dcp_interleave)
        n = max(vis)
        if n == 0:
            continue
        pages = block_table[b, : -(-n // page)].long()
        if pages.numel() * page < n:
            raise ValueError(f"mla_verify: request {b} needs {n} cache tokens but its block-table "
                             f"row holds {block_table.shape[1]} pages of {page}")
        kv = gather_pages(kv_cache, pages).reshape(-1, kv_cache.shape[2])[:n].float() * kv_scale
        lo = b * q_per_req
        s = torch.einsum("jhd,nd->jhn", q[lo:lo + q_per_req].float(), kv) * softmax_scale
        pos = torch.arange(n, device=q.device)
        mask = pos[None, :] < torch.tensor(vis, device=q.device)[:, None]
        mask &= sparse_keep(n, sparse_chunk, sparse_sink, sparse_stride, sparse_recent).to(q.device)
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        m = s.amax(-1)
        m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[..., None])
        total = p.sum(-1)
        o = torch.einsum("jhn,nd->jhd", p, kv[:, :d_v])
        seen = (total > 0)[..., None]
        out[lo:lo + q_per_req] = torch.where(seen, o / total.clamp_min(1e-30)[..., None], 0.0)
        lse[lo:lo + q_per_req] = torch.where(total > 0, m_safe + torch.log(total), float("-inf"))
    return out.to(q.dtype), lse


def gather_pages(kv_cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """kv_cache[pages], through a byte view for fp8 (not every backend indexes fp8 directly)."""
    if kv_cache.element_size() == 1:
        return kv_cache.view(torch.uint8)[pages].view(kv_cache.dtype)
    return kv_cache[pages]


def check_mla_verify(q, kv_cache, block_table, seq_lens, q_per_req, d_v, dcp_size, dcp_rank, dcp_interleave,
                     sparse_stride) -> None:
    if q.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(f"mla_verify: q must be [B*Q, H, D] and kv_cache [blocks, page, D]; got "
                         f"{tuple(q.shape)} and {tuple(kv_cache.shape)}")
    if kv_cache.shape[2] != q.shape[2] or not 0 < d_v <= q.shape[2]:
        raise ValueError(f"mla_verify: q width {q.shape[2]}, cache width {kv_cache.shape[2]}, "
                         f"d_v {d_v}: need equal widths and 0 < d_v <= width")
    if kv_cache.shape[1] % 16:
        raise ValueError(f"mla_verify: page size {kv_cache.shape[1]} is not a multiple of 16")
    if kv_cache.dtype not in (q.dtype, FP8):
        raise ValueError(f"mla_verify: kv_cache dtype {kv_cache.dtype} must be q's ({q.dtype}) "
                         "or float8_e4m3fn")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("mla_verify: block_table and seq_lens must be int32")
    batch = block_table.shape[0]
    if q_per_req < 1 or q.shape[0] != batch * q_per_req or seq_lens.shape != (batch,):
        raise ValueError(f"mla_verify: {q.shape[0]} query rows, {batch} block-table rows, "
                         f"seq_lens {tuple(seq_lens.shape)}, q_per_req {q_per_req} disagree")
    if dcp_size < 1 or not 0 <= dcp_rank < dcp_size or dcp_interleave < 1 or sparse_stride < 1:
        raise ValueError(f"mla_verify: bad DCP ({dcp_size}, {dcp_rank}, {dcp_interleave}) or "
                         f"sparse stride {sparse_stride}")


def mla_verify_unsupported(q, kv_cache, block_table, seq_lens, d_v) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can)."""
    rope = q.shape[2] - d_v
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {q.dtype}"
    if kv_cache.dtype not in (q.dtype, FP8):
        return f"kv dtype {kv_cache.dtype} with q {q.dtype}"
    if not (_pow2(d_v) and _pow2(rope)):
        return f"d_v={d_v}, rope={rope} (need powers of two >= 16)"
    if not all(t.is_contiguous() for t in (q, kv_cache, block_table, seq_lens)):
        return "non-contiguous input"
    return None


def _pow2(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0
