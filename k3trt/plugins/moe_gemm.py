"""``k3trt::moe_gemm``: the routed experts' grouped GEMM for few rows per expert (decode, verify).

    moe_gemm(x [P, K], w [E, N, K], offs int32 [E], src_rows int64 [P]?, dst_rows int64 [P]?,
             out_rows: int = -1) -> y [P or out_rows, N]

Pair p (0 <= p < P) belongs to expert e when offs[e-1] <= p < offs[e] (offs[-1] = 0), and
y[dst(p)] = x[src(p)] @ w[e].T, where src(p) = src_rows[p] (p without src_rows) and dst(p) =
dst_rows[p] (p without). So the MoE gathers its tokens and scatters its results back to
(token, choice) order inside the GEMMs instead of in separate copies. Pairs at or past offs[E-1]
belong to no expert here (another EP rank's): their output rows are unspecified, as with
torch._grouped_mm, whose ``offs`` means the same. y has P rows, or out_rows when given.

Why a kernel of our own: at batch 1 to 32 an expert sees 1 to ~16 rows and the step is bound by
reading its weights once; torch's grouped GEMM (CUTLASS, 128-row tiles) reads them at 0.5-0.65 of
the copy bandwidth there on the H200. The Triton kernel (moe_gemm_triton.py) tiles N and streams
K, one program per (N tile, expert), with row tiles sized to the step's mean rows per expert;
experts without rows return at once. Larger batches keep torch's kernel (``use_kernel``).

For export, the MoE's routed experts are one functional node, ``k3trt::moe_experts`` (an
export-only op of builder/export.py); its ONNX description and plain-torch lowering are here.
"""

from __future__ import annotations

import torch

from . import dispatch
from .moe_gemm_ref import check_moe_gemm, moe_gemm_reference, pairs
from .norm_act_ref import ACTIVATIONS
from .onnx_spec import F32, FLOATS, I64, OnnxOp, params

__all__ = ["moe_gemm", "moe_gemm_reference", "use_kernel", "MAX_PAIRS_PER_EXPERT", "ONNX"]


@torch.library.custom_op("k3trt::moe_gemm", mutates_args=())
def moe_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, src_rows: torch.Tensor | None = None,
             dst_rows: torch.Tensor | None = None, out_rows: int = -1) -> torch.Tensor:
    check_moe_gemm(x, w, offs, src_rows, dst_rows)
    return moe_gemm_reference(x, w, offs, src_rows, dst_rows, out_rows)


@moe_gemm.register_fake
def _(x, w, offs, src_rows=None, dst_rows=None, out_rows=-1):
    return x.new_empty(out_rows if out_rows >= 0 else pairs(x, src_rows), w.shape[1])


@moe_gemm.register_kernel("cuda")
def _moe_gemm_cuda(x, w, offs, src_rows=None, dst_rows=None, out_rows=-1):
    check_moe_gemm(x, w, offs, src_rows, dst_rows)
    # no fallback: the kernel covers every call that passes the check (use_kernel picks the calls)
    return dispatch.call("moe_gemm", None, "moe_gemm_triton.moe_gemm_fwd", moe_gemm_reference,
                         x, w, offs, src_rows, dst_rows, out_rows)


# Up to this many (token, choice) pairs per expert on average the Triton kernel runs; above it
# torch's grouped GEMM, which is 2x faster at 512 tokens on the H200. Below it, at K3's expert sizes
# (benchmarks/moe_gemm.py, results/moe_gemm_h200.json), the sweep's best configs (the table
# moe_gemm_triton.CONFIGS follows) take 0.63-0.82x torch's time for one MoE layer's two GEMMs from
# 1 to 128 tokens (0.5 to 64 pairs per expert).
MAX_PAIRS_PER_EXPERT = 64


def use_kernel(pairs: int, experts: int, x: torch.Tensor) -> bool:
    """Whether Experts should call this op for a step of `pairs` (token, choice) pairs."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and pairs <= MAX_PAIRS_PER_EXPERT * experts


# ----------------------------------------------------------------------------- export
def native_moe_experts(x, ids, weights, w_gate, w_up, w_down, activation, beta, linear_beta):
    """moe_experts for standard ONNX: every expert for every token, weighted by a dense [T, E]
    combine matrix (exact in semantics, not in cost)."""
    combine = torch.zeros(x.shape[0], w_gate.shape[0], dtype=torch.float32, device=x.device)
    combine = combine.scatter(1, ids, weights.float())                                       # [T, E]
    g = torch.einsum("tw,eiw->eti", x, w_gate)
    u = torch.einsum("tw,eiw->eti", x, w_up)
    h = ACTIVATIONS[activation](g, u, beta or None, linear_beta or None)
    y = torch.einsum("eti,ewi->etw", h, w_down)
    return torch.einsum("te,etw->tw", combine, y.float()).to(x.dtype)


ONNX = (
    OnnxOp("moe_experts", "MoeExperts",
           params("x", FLOATS) + params("ids", I64) + params("weights", F32) + params("w_gate w_up w_down", FLOATS),
           params("y", FLOATS),
           "Routed experts: sum over the chosen experts of weight * down(act(gate(x), up(x))).",
           native=native_moe_experts),
)
