"""Triton kernels behind ``k3trt::rms_norm``, ``k3trt::gated_act`` and ``k3trt::kda_out_gate`` (imported
lazily by the ops' CUDA kernels in norm_act.py, so importing k3trt never needs triton).

    rms_norm_fwd(x [..., N], weight [N], eps, out=None, block=None) -> y [..., N] x.dtype
    gated_act_fwd(gate [..., I], up [..., I], kind, beta, linear_beta, out=None) -> y [..., I] gate.dtype
    kda_out_gate_fwd(o [T, H, D], gate [T, H*D], weight [D], eps, out=None, block=None) -> y [T, H*D] gate.dtype

Layouts and math are the ops' (norm_act.py). Inputs need last-dim stride 1 and leading dims that
norm_act_ref.row_layout folds into at most two strides (a column slice of a wider tensor, [T, S, H]
with a strided middle dim); outputs are contiguous. ``out`` (contiguous, right shape and dtype)
is written instead of a new tensor; ``block`` overrides the column block (tests use it to reach
the looped path). No host synchronisation and no allocation but the output: capturable in a CUDA
graph once an eager call has compiled the kernel.

rms_norm and kda_out_gate share one kernel: kda_out_gate is RMSNorm over the T·H rows of o
(row t·H + h at t·o.stride(0) + h·o.stride(1)), times sigmoid of the matching D columns of gate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_act_ref import row_layout

# Widest row a program holds in registers. A row up to this wide is loaded once, reduced and
# scaled from registers: one read of x from memory (K3's widest, 7168, fits with 1/8 of the lanes
# masked, 16 fp32 per thread). A second pass would re-read x, mostly from L2, for no gain at these
# widths (neither variant was timed on the H200). Wider rows loop over blocks of this size twice
# (sum of squares, then scale and store).
MAX_BLOCK = 8192
# Elements one program covers at least: rows narrower than this are grouped (K3's D = 128 heads
# go 16 to a program), so short rows do not each pay a program's fixed cost.
NORM_TILE = 2048
ACT_TILE = 1024
# fp32 elements per thread: 16 (norm) and 8 (activation) are two and one 16-byte bf16 loads, well
# under the register budget, and 16 warps x 16 covers a whole 8192-wide row.
NORM_PER_THREAD = 16
ACT_PER_THREAD = 8


@triton.jit
def _row_offsets(rows, inner, s_outer, s_inner):
    r = rows.to(tl.int64)                               # int64: row offsets pass 2^31 at long prefills
    return (r // inner) * s_outer + (r % inner) * s_inner


@triton.jit
def _scale(x, rstd, W, G, g_rows, cols, col_ok, mask, GATE: tl.constexpr):
    """x · rstd · weight (the reference's order), times sigmoid(gate) for kda_out_gate."""
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = x * rstd * w
    if GATE:
        y = y * tl.sigmoid(tl.load(G + g_rows + cols, mask=mask, other=0.0).to(tl.float32))
    return y


@triton.jit
def _rms_norm_kernel(X, W, G, Y, n_rows, N, eps,
                     x_inner, sx_outer, sx_inner, g_inner, sg_outer, sg_inner,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, GATE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < n_rows)[:, None]
    x_rows = X + _row_offsets(rows, x_inner, sx_outer, sx_inner)[:, None]
    g_rows = _row_offsets(rows, g_inner, sg_outer, sg_inner)[:, None]
    y_rows = Y + rows.to(tl.int64)[:, None] * N
    cols = tl.arange(0, BLOCK)[None, :]
    if ONE_PASS:
        col_ok = cols < N
        mask = row_ok & col_ok
        x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]
        y = _scale(x, rstd, W, G, g_rows, cols, col_ok, mask, GATE)
        tl.store(y_rows + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for c0 in range(0, N, BLOCK):
            mask = row_ok & (c0 + cols < N)
            x = tl.load(x_rows + c0 + cols, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)[:, None]
        for c0 in range(0, N, BLOCK):
            col_ok = c0 + cols < N
            mask = row_ok & col_ok
            x = tl.load(x_rows + c0 + cols, mask=mask, other=0.0).to(tl.float32)
            y = _scale(x, rstd, W, G, g_rows, c0 + cols, col_ok, mask, GATE)
            tl.store(y_rows + c0 + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _tanh(z):
    # tl has no tanh, and libdevice's does not run under the interpreter (the CPU tests). The
    # closed form (1 - e)/(1 + e), e = exp(-2|z|), cancels as |z| -> 0, so |z| < 1/4 takes the odd
    # Taylor series instead (truncation error < 1e-10 relative there); both stay within ~2 ulp.
    a = tl.abs(z)
    e = tl.exp(-2.0 * a)
    closed = (1.0 - e) / (1.0 + e)
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (
        62.0 / 2835.0 + a2 * (-1382.0 / 155925.0))))))
    t = tl.where(a < 0.25, series, closed)
    return tl.where(z < 0, -t, t)


@triton.jit
def _gated_act_kernel(GATE, UP, Y, n_rows, I, beta, linear_beta,
                      g_inner, sg_outer, sg_inner, u_inner, su_outer, su_inner,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, SITU: tl.constexpr, CLAMP_UP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < I)
    g_rows = GATE + _row_offsets(rows, g_inner, sg_outer, sg_inner)[:, None]
    u_rows = UP + _row_offsets(rows, u_inner, su_outer, su_inner)[:, None]
    g = tl.load(g_rows + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_rows + cols, mask=mask, other=0.0).to(tl.float32)
    if SITU:
        # IEEE division, as the reference's g / beta
        g = beta * _tanh(tl.math.div_rn(g, beta)) * tl.sigmoid(g)
        if CLAMP_UP:
            u = linear_beta * _tanh(tl.math.div_rn(u, linear_beta))
        y = g * u
    else:
        y = g / (1.0 + tl.exp(-g)) * u                  # torch's silu: x / (1 + exp(-x))
    tl.store(Y + rows.to(tl.int64)[:, None] * I + cols, y.to(Y.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def norm_config(N: int, block: int | None = None) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps) for rows N wide: BLOCK the row rounded up to a power of two (at
    most MAX_BLOCK, or `block`), ROWS rows per program to reach NORM_TILE, NORM_PER_THREAD
    elements per thread."""
    block = block or min(_pow2(N), MAX_BLOCK)
    rows = max(1, min(16, NORM_TILE // block))
    return rows, block, max(1, min(16, rows * block // (32 * NORM_PER_THREAD)))


def act_config(I: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps): column blocks of up to ACT_TILE (elementwise: a wide row is split
    over programs, 18 for K3's I = 18432), narrow rows grouped to ACT_TILE."""
    block = min(_pow2(I), ACT_TILE)
    rows = max(1, min(16, ACT_TILE // block))
    return rows, block, max(1, min(4, rows * block // (32 * ACT_PER_THREAD)))


def _output(out: torch.Tensor | None, shape, dtype: torch.dtype, device: torch.device, fn: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"{fn}: out must be a contiguous {tuple(shape)} {dtype} tensor on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device} (contiguous={out.is_contiguous()})")
    return out


def _layout(t: torch.Tensor, name: str, fn: str) -> tuple[int, int, int]:
    layout = row_layout(t)
    if layout is None or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"{fn}: {name} {tuple(t.shape)} with strides {t.stride()} is not rows of stride-1 "
                         f"elements at two strides at most (the op falls back to the reference for it)")
    return layout


def _launch_norm(x, n_rows, N, x_layout, weight, gate, g_layout, eps, y, block):
    """The norm kernel over n_rows rows of x (gate None: no gating, and its pointer is x's, never read)."""
    rows, blk, warps = norm_config(N, block)
    if blk & (blk - 1):
        raise ValueError(f"norm_act_triton: block {blk} must be a power of two")
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x, weight, x if gate is None else gate, y, n_rows, N, float(eps), *x_layout, *g_layout,
        ROWS=rows, BLOCK=blk, ONE_PASS=blk >= N, GATE=gate is not None, num_warps=warps,
    )


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                 block: int | None = None) -> torch.Tensor:
    """Launch the norm kernel over x's rows (shapes are checked by the op)."""
    y = _output(out, x.shape, x.dtype, x.device, "rms_norm_fwd")
    N = x.shape[-1]
    n_rows = x.numel() // N if N else 0
    if n_rows == 0:
        return y
    layout = _layout(x, "x", "rms_norm_fwd")
    _launch_norm(x, n_rows, N, layout, weight, None, (1, 0, 0), eps, y, block)
    return y


def kda_out_gate_fwd(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """Launch the norm kernel over o's T·H head rows, gated (shapes are checked by the op)."""
    T, H, D = o.shape
    y = _output(out, (T, H * D), gate.dtype, gate.device, "kda_out_gate_fwd")
    if T * H * D == 0:
        return y
    _layout(o, "o", "kda_out_gate_fwd")
    _layout(gate, "gate", "kda_out_gate_fwd")
    g_layout = (H, gate.stride(0), D)                   # gate as [T, H, D]: head h at column h·D
    _launch_norm(o, T * H, D, (H, o.stride(0), o.stride(1)), weight, gate, g_layout, eps, y, block)
    return y


def gated_act_fwd(gate: torch.Tensor, up: torch.Tensor, kind: str, beta: float, linear_beta: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the activation kernel (shapes and kind are checked by the op)."""
    if kind not in ("silu", "situ"):
        raise ValueError(f"gated_act_fwd: unknown kind {kind!r}")
    y = _output(out, gate.shape, gate.dtype, gate.device, "gated_act_fwd")
    I = gate.shape[-1]
    n_rows = gate.numel() // I if I else 0
    if n_rows == 0:
        return y
    g_layout = _layout(gate, "gate", "gated_act_fwd")
    u_layout = _layout(up, "up", "gated_act_fwd")
    rows, block, warps = act_config(I)
    situ = kind == "situ"
    _gated_act_kernel[(triton.cdiv(n_rows, rows), triton.cdiv(I, block))](
        gate, up, y, n_rows, I, float(beta) if situ else 1.0, float(linear_beta) if situ else 1.0,
        *g_layout, *u_layout,
        ROWS=rows, BLOCK=block, SITU=situ, CLAMP_UP=situ and bool(linear_beta), num_warps=warps,
    )
    return y
