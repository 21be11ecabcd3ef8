"""Fused row-wise norm / activation ops (namespace ``k3trt``) for the decode path, where the torch
forms are 8-12 launches of tiny kernels each (launch-bound at batch 1).

``rms_norm(x, weight, eps) -> y``
    x [..., N] (bf16 / fp16 / fp32; last-dim stride 1, rows may be strided), weight [N];
    y = x · rsqrt(mean(x²) + eps) · weight in fp32, returned contiguous in x.dtype.
``gated_act(gate, up, kind, beta, linear_beta) -> y``
    gate, up [..., I] of equal shape (often the two halves of one [T, 2I] projection); kind "silu"
    (y = silu(gate) · up) or "situ" (y = β·tanh(gate/β)·sigmoid(gate) · lb·tanh(up/lb), the up
    clamp skipped when linear_beta is 0.0; beta is unused by silu); fp32 arithmetic, returned
    contiguous in gate.dtype.
``kda_out_gate(o, gate, weight, eps) -> y``
    o [T, H, D] (fp32 from the KDA recurrence), gate [T, H·D] (the model dtype), weight [D];
    y = rms_norm(o per head, fp32) · sigmoid(gate), returned [T, H·D] contiguous in gate.dtype.

The ``*_reference`` functions are the model's own math and the ops' bodies on every device (the
model imports them from here). On CUDA the op runs one Triton kernel (norm_act_triton.py, imported
on the first CUDA call so importing k3trt never needs triton); inputs the kernel does not cover
(fp64, leading dims that need more than two strides, ...) take the reference, with a warning once.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- references
def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in fp32 (bf16 sums of squares lose too much), returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def silu_mul_reference(gate: Tensor, up: Tensor, beta: float | None = None,
                       linear_beta: float | None = None) -> Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def situ_mul_reference(gate: Tensor, up: Tensor, beta: float | None = None,
                       linear_beta: float | None = None) -> Tensor:
    """SiTU: gate' = β·tanh(gate/β)·sigmoid(gate); up' = lb·tanh(up/lb) when lb is set; in fp32."""
    g, u = gate.float(), up.float()
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (g * u).to(gate.dtype)


# kind -> the gated activation; a table, so a new activation is one line (and one kernel branch)
ACTIVATIONS = {"silu": silu_mul_reference, "situ": situ_mul_reference}


def gated_act_reference(gate: Tensor, up: Tensor, kind: str, beta: float, linear_beta: float) -> Tensor:
    if kind not in ACTIVATIONS:
        raise ValueError(f"gated_act: unknown kind {kind!r} (expected one of {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[kind](gate, up, beta, linear_beta)


def kda_out_gate_reference(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    T, H, D = o.shape
    of = o.float()
    n = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (n * torch.sigmoid(gate.float().view(n.shape))).to(gate.dtype).reshape(T, H * D)


# ----------------------------------------------------------------------------- checks (shapes only: no host sync)
def _same_device(op: str, first: tuple[str, Tensor], *rest: tuple[str, Tensor]) -> None:
    for name, t in rest:
        if t.device != first[1].device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first[0]} on {first[1].device}")


def _check_rms_norm(x: Tensor, weight: Tensor) -> None:
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight must be [{x.shape[-1] if x.dim() else '?'}] (x's last dim), "
                         f"got weight {tuple(weight.shape)} for x {tuple(x.shape)}")
    _same_device("rms_norm", ("x", x), ("weight", weight))


def _check_gated_act(gate: Tensor, up: Tensor, kind: str, beta: float) -> None:
    if kind not in ACTIVATIONS:
        raise ValueError(f"gated_act: unknown kind {kind!r} (expected one of {sorted(ACTIVATIONS)})")
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"gated_act: gate and up must have one shape [..., I], got gate {tuple(gate.shape)} "
                         f"and up {tuple(up.shape)}")
    if kind == "situ" and not beta:
        raise ValueError("gated_act: situ needs a nonzero beta (it divides by it), got 0")
    _same_device("gated_act", ("gate", gate), ("up", up))


def _check_kda_out_gate(o: Tensor, gate: Tensor, weight: Tensor) -> None:
    if o.dim() != 3:
        raise ValueError(f"kda_out_gate: o must be [T, H, D], got {tuple(o.shape)}")
    T, H, D = o.shape
    if gate.shape != (T, H * D):
        raise ValueError(f"kda_out_gate: gate must be [T, H*D] = [{T}, {H * D}] (from o {tuple(o.shape)}), "
                         f"got {tuple(gate.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"kda_out_gate: weight must be [D] = [{D}], got {tuple(weight.shape)}")
    _same_device("kda_out_gate", ("o", o), ("gate", gate), ("weight", weight))


# ----------------------------------------------------------------------------- ops
# The bodies return .contiguous(): the reference follows a permuted input's layout, the kernel and
# the fake implementations do not, and the three must agree.
@torch.library.custom_op("k3trt::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check_rms_norm(x, weight)
    return rms_norm_reference(x, weight, eps).contiguous()


@rms_norm.register_fake
def _(x, weight, eps):
    _check_rms_norm(x, weight)
    return x.new_empty(x.shape)


@rms_norm.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps):
    _check_rms_norm(x, weight)
    reason = rms_norm_unsupported(x, weight)
    if reason:
        _log_fallback("rms_norm", reason)
        return rms_norm_reference(x, weight, eps).contiguous()
    from . import norm_act_triton  # lazy: triton is imported only on the CUDA path

    return norm_act_triton.rms_norm_fwd(x, weight, eps)


@torch.library.custom_op("k3trt::gated_act", mutates_args=())
def gated_act(gate: Tensor, up: Tensor, kind: str, beta: float, linear_beta: float) -> Tensor:
    _check_gated_act(gate, up, kind, beta)
    return gated_act_reference(gate, up, kind, beta, linear_beta).contiguous()


@gated_act.register_fake
def _(gate, up, kind, beta, linear_beta):
    _check_gated_act(gate, up, kind, beta)
    return gate.new_empty(gate.shape)


@gated_act.register_kernel("cuda")
def _gated_act_cuda(gate, up, kind, beta, linear_beta):
    _check_gated_act(gate, up, kind, beta)
    reason = gated_act_unsupported(gate, up)
    if reason:
        _log_fallback("gated_act", reason)
        return gated_act_reference(gate, up, kind, beta, linear_beta).contiguous()
    from . import norm_act_triton

    return norm_act_triton.gated_act_fwd(gate, up, kind, beta, linear_beta)


@torch.library.custom_op("k3trt::kda_out_gate", mutates_args=())
def kda_out_gate(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check_kda_out_gate(o, gate, weight)
    return kda_out_gate_reference(o, gate, weight, eps).contiguous()


@kda_out_gate.register_fake
def _(o, gate, weight, eps):
    _check_kda_out_gate(o, gate, weight)
    return gate.new_empty(gate.shape)


@kda_out_gate.register_kernel("cuda")
def _kda_out_gate_cuda(o, gate, weight, eps):
    _check_kda_out_gate(o, gate, weight)
    reason = kda_out_gate_unsupported(o, gate, weight)
    if reason:
        _log_fallback("kda_out_gate", reason)
        return kda_out_gate_reference(o, gate, weight, eps).contiguous()
    from . import norm_act_triton

    return norm_act_triton.kda_out_gate_fwd(o, gate, weight, eps)


# ----------------------------------------------------------------------------- what the kernels cover
def row_layout(t: Tensor) -> tuple[int, int, int] | None:
    """(inner, outer_stride, inner_stride): row r of t (its leading dims flattened in C order)
    starts (r // inner)·outer_stride + (r % inner)·inner_stride elements past t's data pointer.
    None when the leading dims need more than two strides. Reads metadata only."""
    merged: list[list[int]] = []                        # [size, stride], outermost first
    for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:   # dims i, i+1 walk memory as one dim
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if not merged:
        return 1, 0, 0
    if len(merged) == 1:
        return merged[0][0], 0, merged[0][1]
    if len(merged) == 2:
        return merged[1][0], merged[0][1], merged[1][1]
    return None


def _rows_unsupported(name: str, t: Tensor) -> str | None:
    if t.dtype not in KERNEL_DTYPES:
        return f"{name} dtype {t.dtype}"
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return f"{name} last-dim stride {t.stride(-1)}"
    if row_layout(t) is None:
        return f"{name} leading dims {tuple(t.shape[:-1])} with strides {t.stride()[:-1]} (more than two strides)"
    return None


def _weight_unsupported(weight: Tensor) -> str | None:
    if weight.dtype not in KERNEL_DTYPES:
        return f"weight dtype {weight.dtype}"
    if weight.shape[0] > 1 and weight.stride(0) != 1:
        return f"weight stride {weight.stride(0)}"
    return None


def rms_norm_unsupported(x: Tensor, weight: Tensor) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can). Metadata only."""
    return _rows_unsupported("x", x) or _weight_unsupported(weight)


def gated_act_unsupported(gate: Tensor, up: Tensor) -> str | None:
    return _rows_unsupported("gate", gate) or _rows_unsupported("up", up)


def kda_out_gate_unsupported(o: Tensor, gate: Tensor, weight: Tensor) -> str | None:
    # o [T, H, D] and gate viewed as [T, H, D] always fit two row strides
    return _rows_unsupported("o", o) or _rows_unsupported("gate", gate) or _weight_unsupported(weight)


@functools.lru_cache(maxsize=64)
def _log_fallback(op: str, reason: str) -> None:
    log.warning("%s: Triton kernel does not cover %s; using the torch reference", op, reason)
