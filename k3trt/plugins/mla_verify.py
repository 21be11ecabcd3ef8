"""``torch.ops.k3trt.mla_verify``: absorbed-MLA attention of several query rows per request over a
paged latent cache, one pass over the cache for all rows and heads (speculative verification).

    out, lse = torch.ops.k3trt.mla_verify(
        q,              # [B·Q, H, D]  bf16 | fp16 | fp32; rows of request b are b·Q .. b·Q+Q-1
        kv_cache,       # [num_blocks, page_size, D]  q's dtype, or float8_e4m3fn (value = fp8·kv_scale)
        block_table,    # int32 [B, max_blocks_per_req]: page ids of request b, in token order
        seq_lens,       # int32 [B]: GLOBAL length incl. this step's Q rows (already in the cache)
        q_per_req,      # int Q: 1 = plain decode, K+1 = verification of K drafts
        softmax_scale,  # float
        kv_scale=1.0, d_v=512, dcp_size=1, dcp_rank=0, dcp_interleave=1,
        sparse_chunk=0, sparse_sink=1, sparse_stride=1, sparse_recent=1)
    -> out [B·Q, H, d_v] (q's dtype), lse [B·Q, H] fp32

Layout. D = kv_lora_rank + rope dim (K3: 512 + 64 = 576); each cache row is [kv_c (d_v) | k_rope]
and serves as key (all D columns) and value (first d_v columns). Token i of request b (local index
under DCP) is row ``i % page_size`` of page ``block_table[b, i // page_size]``; page_size is a
multiple of 16. Slots past a request's length are never read (may hold NaN); the block-table row
must cover the (local) length: the kernel does not bounds-check page ids.

Semantics. Row j (0..Q-1) of request b sees global positions < ``seq_lens[b] - (Q-1-j)`` (causal
over the drafts). ``lse`` is the natural log of the sum of exp(softmax_scale·q·k) over the keys the
row sees; a row that sees none gets out = 0, lse = -inf (so ``merge_attn_states`` ignores it).
DCP (``dcp_size`` D > 1): the cache holds only rank ``dcp_rank``'s tokens (token t on rank
``(t // I) % D``, dense in local order, see dcp.py) and row j sees the local length of its global
visible length; merging the D ranks' (out, lse) gives the unsharded result. q-rep needs nothing
from this op (dcp.py says what changes around it).

Dynamic sparse policy (opt-in: ``sparse_chunk`` > 0; 0 = dense, the default). The request's
local tokens are cut into chunks of ``sparse_chunk``; with n chunks (from the request's full local
length, so all Q rows share one selection) chunk c is kept when c < sparse_sink, or
c >= n - sparse_recent, or (c - sparse_sink) % sparse_stride == 0; rows stay causal within the kept
tokens. sparse_stride = 1 keeps every chunk and equals dense attention exactly.

Backends. The plain-torch reference (fp32 accumulation; CPU or GPU, syncs on seq_lens) is the
oracle. On CUDA a Triton kernel runs when the case is supported: q bf16/fp16, d_v and D - d_v
powers of two >= 16, contiguous inputs; anything else falls back to the reference. K3's own
shapes (q bf16, D 576, d_v 512, page 64, no DCP or sparse policy) take the SM90 CUDA kernel of
mla_cuda/ wherever it builds (``_sm90_kernel_takes``; K3TRT_MLA_KERNEL=triton overrides).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .dcp import local_len

log = logging.getLogger(__name__)

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


@torch.library.custom_op("k3trt::mla_verify", mutates_args=())
def mla_verify(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, q_per_req: int, softmax_scale: float,
               kv_scale: float = 1.0, d_v: int = 512, dcp_size: int = 1, dcp_rank: int = 0,
               dcp_interleave: int = 1, sparse_chunk: int = 0, sparse_sink: int = 1,
               sparse_stride: int = 1, sparse_recent: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, kv_cache, block_table, seq_lens, q_per_req, d_v, dcp_size, dcp_rank, dcp_interleave,
           sparse_stride)
    return mla_verify_ref(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale,
                          d_v, dcp_size, dcp_rank, dcp_interleave, sparse_chunk, sparse_sink,
                          sparse_stride, sparse_recent)


@mla_verify.register_kernel("cuda")
def _mla_verify_cuda(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale=1.0,
                     d_v=512, dcp_size=1, dcp_rank=0, dcp_interleave=1, sparse_chunk=0,
                     sparse_sink=1, sparse_stride=1, sparse_recent=1):
    args = (q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale, d_v, dcp_size,
            dcp_rank, dcp_interleave, sparse_chunk, sparse_sink, sparse_stride, sparse_recent)
    _check(q, kv_cache, block_table, seq_lens, q_per_req, d_v, dcp_size, dcp_rank, dcp_interleave,
           sparse_stride)
    reason = kernel_unsupported(q, kv_cache, block_table, seq_lens, d_v)
    if reason:
        _log_fallback(reason)
        return mla_verify_ref(*args)
    if dcp_size == 1 and sparse_chunk == 0 and _sm90_kernel_takes(q, kv_cache, block_table, seq_lens, d_v):
        from .mla_cuda import mla_verify_cuda
        return mla_verify_cuda(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale, d_v)
    from . import mla_triton  # lazy: triton is imported only on the CUDA path

    plan = plan_for(q.shape[0] // q_per_req, q_per_req, q.shape[1], q.shape[2], d_v,
                    kv_cache.dtype == FP8, q.device.index or 0)
    return mla_triton.mla_verify_fwd(plan, *args)


@mla_verify.register_fake
def _mla_verify_fake(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale=1.0,
                     d_v=512, dcp_size=1, dcp_rank=0, dcp_interleave=1, sparse_chunk=0,
                     sparse_sink=1, sparse_stride=1, sparse_recent=1):
    out = q.new_empty(q.shape[0], q.shape[1], d_v)
    return out, q.new_empty(q.shape[:2], dtype=torch.float32)


@functools.lru_cache(maxsize=256)
def plan_for(capacity, q_per_req, num_heads, d_qk, d_v, kv_fp8, device_index):
    from .plans import make_plan

    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return make_plan(capacity, q_per_req, num_heads, d_qk, d_v, kv_fp8=kv_fp8, num_sms=sms)


# Which kernel a CUDA call takes: K3TRT_MLA_KERNEL=auto (default) | triton | cuda ("cuda" is now the
# same as "auto", kept so that existing settings stay valid). "auto" takes the
# SM90 CUDA kernel (mla_cuda/) wherever it runs: on the H200 it was faster than the Triton kernel in
# 69 of 72 cells (heads 12/48/96, batch 1/8/32/128, context 1K/8K/32K, bf16/fp8; mla_cuda_h200.json
# run 10), e.g. 0.77-1.00 of the roofline vs 0.44-0.48 at 12 heads and batch >= 32, and at batch 1
# 28 vs 39 us (12 heads, 32K) or 68 vs 147 us (96 heads, 32K). The three: bf16, 1K context, batch
# 1-8, where Triton's split-d_v config is 1.5-1.8 us faster. A captured graph replays one kernel
# at every length, so the choice cannot follow the context.
KERNEL_ENV = "K3TRT_MLA_KERNEL"


def _sm90_kernel_takes(q, kv_cache, block_table, seq_lens, d_v) -> bool:
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in ("auto", "triton", "cuda"):
        raise ValueError(f"{KERNEL_ENV}={choice!r}: choose auto, triton or cuda")
    if choice == "triton":
        return False
    from . import mla_cuda
    return mla_cuda.unsupported(q, kv_cache, block_table, seq_lens, d_v) is None and _sm90_builds()


@functools.lru_cache(maxsize=1)
def _sm90_builds() -> bool:
    """Whether the CUDA extension builds here (nvcc and ninja at run time); logged once if not."""
    from . import mla_cuda
    try:
        mla_cuda.load_extension()
        return True
    except Exception as e:      # no nvcc, a compiler error: the Triton kernel serves every call
        log.warning("mla_verify: the SM90 CUDA kernel did not build (%s: %s); using the Triton kernel",
                    type(e).__name__, str(e)[:500])
        return False


def kernel_unsupported(q, kv_cache, block_table, seq_lens, d_v) -> str | None:
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


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    log.warning("mla_verify: Triton kernel does not cover %s; using the torch reference", reason)


def _check(q, kv_cache, block_table, seq_lens, q_per_req, d_v, dcp_size, dcp_rank, dcp_interleave,
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
