"""Plain-torch side of the KDA front ops (kda_front.py has the ops and their layouts): the
references (the ops' bodies; model/kda.py calls ``kda_prep_reference`` on the paths that do not take
the op), the argument checks and what the Triton kernels cover. Imported by the ops and the kernels
(kda_front_triton.py) alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .kda_ref import short_conv_reference

L2_EPS = 1e-6        # as in fla's l2norm: x / sqrt(sum(x^2) + eps)
CONV_KERNEL = 4      # the only conv width the Triton kernel is written for (K3's)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- short conv over cache slots
def check_short_conv_slots(x: Tensor, weight: Tensor, conv_cache: Tensor, slots: Tensor, fresh: Tensor,
                           step_conv: Tensor, save: bool) -> None:
    """Shapes and dtypes only: nothing here reads a tensor's values (no host sync)."""
    if x.dim() != 3:
        raise ValueError(f"short_conv_slots: x must be [B, n, C], got {tuple(x.shape)}")
    B, n, C = x.shape
    if weight.dim() != 3 or weight.shape[0] != C or weight.shape[1] != 1 or weight.shape[2] < 2:
        raise ValueError(f"short_conv_slots: weight must be [C={C}, 1, K >= 2], got {tuple(weight.shape)}")
    K = weight.shape[2]
    if conv_cache.dim() != 3 or tuple(conv_cache.shape[1:]) != (C, K - 1):
        raise ValueError(f"short_conv_slots: conv_cache must be [num_slots, C={C}, K-1={K - 1}], "
                         f"got {tuple(conv_cache.shape)}")
    for name, t in (("x", x), ("weight", weight), ("conv_cache", conv_cache)):
        if not t.is_floating_point():
            raise ValueError(f"short_conv_slots: {name} must be floating point, got {t.dtype}")
    if tuple(slots.shape) != (B,) or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"short_conv_slots: slots must be int64 [B={B}], got {slots.dtype} {tuple(slots.shape)}")
    if tuple(fresh.shape) != (B,) or fresh.dtype != torch.bool:
        raise ValueError(f"short_conv_slots: fresh must be bool [B={B}], got {fresh.dtype} {tuple(fresh.shape)}")
    if save:
        st = step_conv
        if st.dim() != 4 or st.shape[0] != conv_cache.shape[0] or st.shape[1] < n \
                or tuple(st.shape[2:]) != (C, K - 1) or not st.is_floating_point():
            raise ValueError(f"short_conv_slots: save needs a float step_conv [num_slots, max_q >= {n}, C, K-1] = "
                             f"[{conv_cache.shape[0]}, >={n}, {C}, {K - 1}], got {tuple(st.shape)} {st.dtype}")


def _check_slot_range(slots: Tensor, num_slots: int, op: str) -> None:
    # only where reading the values costs no device sync; CUDA tensors are left to torch's indexing
    if slots.device.type == "cpu" and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_slots:
            raise IndexError(f"{op}: slots must lie in [0, {num_slots}), got {lo}..{hi}")


def short_conv_slots_reference(x: Tensor, weight: Tensor, conv_cache: Tensor, slots: Tensor, fresh: Tensor,
                               step_conv: Tensor, save: bool) -> Tensor:
    """The torch body: gather, zero the fresh rows, ``short_conv``'s body, scatter."""
    _check_slot_range(slots, conv_cache.shape[0], "short_conv_slots")
    B, n = x.shape[:2]
    # a select, not a multiply: 0 * NaN garbage in a reused slot would be NaN
    conv0 = torch.where((~fresh).view(B, 1, 1), conv_cache[slots].to(x.dtype), 0.0)
    y, conv1, conv_all = short_conv_reference(x, weight, conv0, save)
    conv_cache[slots] = conv1.to(conv_cache.dtype)
    if save:
        step_conv[slots, :n] = conv_all.to(step_conv.dtype)
    return y


def short_conv_slots_unsupported(x: Tensor, weight: Tensor, conv_cache: Tensor, step_conv: Tensor,
                                 save: bool) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can). Shapes and dtypes only."""
    if weight.shape[-1] != CONV_KERNEL:
        return f"conv kernel size {weight.shape[-1]} (the kernel is written for {CONV_KERNEL})"
    dtypes = [x.dtype, weight.dtype, conv_cache.dtype] + ([step_conv.dtype] if save else [])
    if any(d not in _FLOATS for d in dtypes):
        return f"dtypes {dtypes}"
    return None


# ----------------------------------------------------------------------------- q/k norm, decay, beta
def check_kda_prep(y: Tensor, f: Tensor, b: Tensor, dt_bias: Tensor, A_log: Tensor, num_heads: int,
                   head_dim: int) -> None:
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"kda_prep: num_heads and head_dim must be >= 1, got {num_heads} and {head_dim}")
    H, D = num_heads, head_dim
    T = y.shape[0] if y.dim() == 2 else -1
    for name, t, shape in (("y", y, (T, 3 * H * D)), ("f", f, (T, H * D)), ("b", b, (T, H)),
                           ("dt_bias", dt_bias, (H * D,)), ("A_log", A_log, (H,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"kda_prep: {name} has shape {tuple(t.shape)}, expected {shape} "
                             f"(num_heads={H}, head_dim={D}, T from y {tuple(y.shape)})")
        if not t.is_floating_point():
            raise ValueError(f"kda_prep: {name} must be floating point, got {t.dtype}")


def _l2norm(x: Tensor) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def kda_prep_reference(y: Tensor, f: Tensor, b: Tensor, dt_bias: Tensor, A_log: Tensor, num_heads: int,
                       head_dim: int, lower_bound: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The torch body, and the KDA layer's own math for these (model/kda.py calls it on the paths
    that do not take the op: prefill's chunked form and torch.export)."""
    T, H, D = y.shape[0], num_heads, head_dim
    q, k, v = y.view(T, 3, H, D).unbind(1)
    # copy=True: with fp32 y, .float() would return a view of the input, which an op may not
    q, k, v = _l2norm(q).contiguous(), _l2norm(k).contiguous(), v.to(torch.float32, copy=True).contiguous()
    raw = f.float().view(T, H, D) + dt_bias.float().view(H, D)
    a = A_log.float().exp().view(H, 1)
    g = lower_bound * torch.sigmoid(a * raw) if lower_bound is not None else -a * F.softplus(raw)
    return q, k, v, g.contiguous(), torch.sigmoid(b.float()).contiguous()


def kda_prep_unsupported(y: Tensor, f: Tensor, b: Tensor, dt_bias: Tensor, A_log: Tensor,
                         head_dim: int) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can). Shapes and dtypes only."""
    # one program holds whole heads: [heads, next_pow2(D)] tiles
    if head_dim > 1024:
        return f"head_dim {head_dim} > 1024"
    dtypes = [t.dtype for t in (y, f, b, dt_bias, A_log)]
    if any(d not in _FLOATS for d in dtypes):
        return f"dtypes {dtypes}"
    return None
