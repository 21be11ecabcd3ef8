"""Plain-torch side of the fused norm / activation ops (norm_act.py has the ops and their layouts):
the references (the model's own math: model/layers.py calls them), the argument checks and what
the Triton kernels cover. Imported by the ops and the kernels alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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


def check_rms_norm(x: Tensor, weight: Tensor) -> None:
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight must be [{x.shape[-1] if x.dim() else '?'}] (x's last dim), "
                         f"got weight {tuple(weight.shape)} for x {tuple(x.shape)}")
    _same_device("rms_norm", ("x", x), ("weight", weight))


def check_gated_act(gate: Tensor, up: Tensor, kind: str, beta: float) -> None:
    if kind not in ACTIVATIONS:
        raise ValueError(f"gated_act: unknown kind {kind!r} (expected one of {sorted(ACTIVATIONS)})")
    if gate.shape != up.shape or gate.dim() < 1:
        raise ValueError(f"gated_act: gate and up must have one shape [..., I], got gate {tuple(gate.shape)} "
                         f"and up {tuple(up.shape)}")
    if kind == "situ" and not beta:
        raise ValueError("gated_act: situ needs a nonzero beta (it divides by it), got 0")
    _same_device("gated_act", ("gate", gate), ("up", up))


def check_kda_out_gate(o: Tensor, gate: Tensor, weight: Tensor) -> None:
    if o.dim() != 3:
        raise ValueError(f"kda_out_gate: o must be [T, H, D], got {tuple(o.shape)}")
    T, H, D = o.shape
    if gate.shape != (T, H * D):
        raise ValueError(f"kda_out_gate: gate must be [T, H*D] = [{T}, {H * D}] (from o {tuple(o.shape)}), "
                         f"got {tuple(gate.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"kda_out_gate: weight must be [D] = [{D}], got {tuple(weight.shape)}")
    _same_device("kda_out_gate", ("o", o), ("gate", gate), ("weight", weight))


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
