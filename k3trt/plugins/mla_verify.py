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
from this op (dcp_sim.py says what changes around it).

Dynamic sparse policy (opt-in: ``sparse_chunk`` > 0; 0 = dense, the default). The request's
local tokens are cut into chunks of ``sparse_chunk``; with n chunks (from the request's full local
length, so all Q rows share one selection) chunk c is kept when c < sparse_sink, or
c >= n - sparse_recent, or (c - sparse_sink) % sparse_stride == 0; rows stay causal within the kept
tokens. sparse_stride = 1 keeps every chunk and equals dense attention exactly.

Backends. The plain-torch reference (mla_verify_ref.py; fp32 accumulation; CPU or GPU, syncs on
seq_lens) is the oracle. On CUDA a Triton kernel runs when the case is supported: q bf16/fp16, d_v and D - d_v
powers of two >= 16, contiguous inputs; anything else falls back to the reference. K3's own
shapes (q bf16, D 576, d_v 512, page 64, no DCP or sparse policy) take the SM90 CUDA kernel of
mla_cuda/ wherever it builds (``_sm90_kernel_takes``; K3TRT_MLA_KERNEL=triton overrides).

Export: the ONNX node ``MlaVerify`` (``ONNX`` below, with a standard-ONNX lowering for dense
attention without DCP). Its TensorRT plugin is MlaVerify in the C++ library (k3trt/trt_plugin/).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from . import dispatch
from .mla_verify_ref import (FP8, check_mla_verify, gather_pages, mla_verify_ref, mla_verify_unsupported,
                             sparse_keep, visible_lengths)
from .onnx_spec import CACHE, F32, FLOATS, I32, OnnxOp, params
from .plans import make_plan

__all__ = ["mla_verify", "mla_verify_ref", "gather_pages", "sparse_keep", "visible_lengths", "KERNEL_ENV", "ONNX"]

log = logging.getLogger(__name__)


@torch.library.custom_op("k3trt::mla_verify", mutates_args=())
def mla_verify(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, q_per_req: int, softmax_scale: float,
               kv_scale: float = 1.0, d_v: int = 512, dcp_size: int = 1, dcp_rank: int = 0,
               dcp_interleave: int = 1, sparse_chunk: int = 0, sparse_sink: int = 1,
               sparse_stride: int = 1, sparse_recent: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    check_mla_verify(q, kv_cache, block_table, seq_lens, q_per_req, d_v, dcp_size, dcp_rank, dcp_interleave,
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
    check_mla_verify(q, kv_cache, block_table, seq_lens, q_per_req, d_v, dcp_size, dcp_rank, dcp_interleave,
                     sparse_stride)
    if dispatch.falls_back("mla_verify", mla_verify_unsupported(q, kv_cache, block_table, seq_lens, d_v)):
        return mla_verify_ref(*args)
    if dcp_size == 1 and sparse_chunk == 0 and _sm90_kernel_takes(q, kv_cache, block_table, seq_lens, d_v):
        return dispatch.kernel_module("mla_cuda").mla_verify_cuda(q, kv_cache, block_table, seq_lens, q_per_req,
                                                                  softmax_scale, kv_scale, d_v)
    plan = plan_for(q.shape[0] // q_per_req, q_per_req, q.shape[1], q.shape[2], d_v,
                    kv_cache.dtype == FP8, q.device.index or 0)
    return dispatch.kernel_module("mla_triton").mla_verify_fwd(plan, *args)


@mla_verify.register_fake
def _mla_verify_fake(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale=1.0,
                     d_v=512, dcp_size=1, dcp_rank=0, dcp_interleave=1, sparse_chunk=0,
                     sparse_sink=1, sparse_stride=1, sparse_recent=1):
    out = q.new_empty(q.shape[0], q.shape[1], d_v)
    return out, q.new_empty(q.shape[:2], dtype=torch.float32)


@functools.lru_cache(maxsize=256)
def plan_for(capacity, q_per_req, num_heads, d_qk, d_v, kv_fp8, device_index):
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return make_plan(capacity, q_per_req, num_heads, d_qk, d_v, kv_fp8=kv_fp8, num_sms=sms)


# Which kernel a CUDA call takes: K3TRT_MLA_KERNEL=auto (default) | triton | cuda ("cuda" means the
# same as "auto"). "auto" takes the SM90 CUDA kernel (mla_cuda/) wherever it runs: on the H200 it
# was faster than the Triton kernel in 69 of 72 cells (heads 12/48/96, batch 1/8/32/128, context
# 1K/8K/32K, bf16/fp8; benchmarks/results/mla_cuda_h200.json), e.g. 0.77-1.00 of the roofline vs
# 0.44-0.48 at 12 heads and batch >= 32, and at batch 1 28 vs 39 us (12 heads, 32K) or 68 vs 147 us
# (96 heads, 32K). The three: bf16, 1K context, batch 1-8, where Triton's split-d_v config is
# 1.5-1.8 us faster. A captured graph replays one kernel at every length, so the choice cannot
# follow the context.
KERNEL_ENV = "K3TRT_MLA_KERNEL"


def _sm90_kernel_takes(q, kv_cache, block_table, seq_lens, d_v) -> bool:
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in ("auto", "triton", "cuda"):
        raise ValueError(f"{KERNEL_ENV}={choice!r}: choose auto, triton or cuda")
    if choice == "triton":
        return False
    mla_cuda = dispatch.kernel_module("mla_cuda")
    return mla_cuda.unsupported(q, kv_cache, block_table, seq_lens, d_v) is None and _sm90_builds()


@functools.lru_cache(maxsize=1)
def _sm90_builds() -> bool:
    """Whether the CUDA extension builds here (nvcc and ninja at run time); logged once if not."""
    try:
        dispatch.kernel_module("mla_cuda").load_extension()
        return True
    except Exception as e:      # no nvcc, a compiler error: the Triton kernel serves every call
        log.warning("mla_verify: the SM90 CUDA kernel did not build (%s: %s); using the Triton kernel",
                    type(e).__name__, str(e)[:500])
        return False


# ----------------------------------------------------------------------------- export
# The plain-torch form that torch.export traces into standard ONNX (static shapes, no host syncs)
# for a backend that cannot load the plugin: exact in semantics, not in cost.
def native_mla_verify(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale=1.0, d_v=512,
                      dcp_size=1, dcp_rank=0, dcp_interleave=1, sparse_chunk=0, sparse_sink=1,
                      sparse_stride=1, sparse_recent=1):
    if dcp_size != 1 or sparse_chunk:
        raise NotImplementedError("the native mla_verify lowering covers dense attention without DCP")
    (B, pages), (rows, H, D), page = block_table.shape, q.shape, kv_cache.shape[1]
    Q, L = q_per_req, pages * page
    pos = torch.arange(L, device=q.device)
    kv = kv_cache[block_table.long()].reshape(B, L, D).float() * kv_scale
    # rows past a request's length may hold NaN (never read by the op): zero them, mask the scores
    kv = torch.where((pos[None, :] < seq_lens[:, None])[..., None], kv, 0.0)
    vis = seq_lens[:, None] - (Q - 1) + torch.arange(Q, device=q.device)[None, :]          # [B, Q]
    s = torch.einsum("bqhd,bld->bqhl", q.float().view(B, Q, H, D), kv) * softmax_scale
    s = s.masked_fill(~(pos[None, None, :] < vis[..., None]).unsqueeze(2), float("-inf"))
    m = s.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe[..., None])
    total = p.sum(-1)
    out = torch.einsum("bqhl,bld->bqhd", p, kv[..., :d_v]) / total.clamp_min(1e-30)[..., None]
    out = torch.where((total > 0)[..., None], out, 0.0)
    lse = torch.where(total > 0, m_safe + torch.log(total.clamp_min(1e-30)), float("-inf"))
    return out.reshape(rows, H, d_v).to(q.dtype), lse.reshape(rows, H)


ONNX = (
    OnnxOp("mla_verify", "MlaVerify",
           params("q", FLOATS) + params("kv_cache", CACHE) + params("block_table seq_lens", I32),
           params("out", FLOATS) + params("lse", F32),
           "Absorbed-MLA attention of q_per_req rows per request over the paged latent cache.",
           native=native_mla_verify),
)
