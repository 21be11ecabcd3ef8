"""KDA front ops: what runs between a KDA layer's projections and ``kda_recurrent_slots`` on the
decode / verification path, as two ops whose CUDA kernels (kda_front_triton.py) replace ~70 small
torch launches per layer.

``short_conv_slots(x, weight, conv_cache, slots, fresh, step_conv, save) -> y``
        (mutates conv_cache and step_conv)
    x      [B, n, C]: the q|k|v projections of B rows of n positions (any float dtype, any strides)
    weight [C, 1, K]: the depthwise conv weights (the CUDA kernel takes K = 4, K3's)
    conv_cache [num_slots, C, K-1] (any float dtype): row b starts from the window
           conv_cache[slots[b]] (oldest first, cast to x's dtype) and that slot receives the window
           after position n-1;
    slots  int64 (or int32) [B], in [0, num_slots) (the CUDA kernel cannot check without a host
           sync: it runs an out-of-range row from a zero window and writes nothing; the torch body
           raises IndexError on CPU tensors and leaves CUDA tensors to torch's indexing);
    fresh  bool [B]: True starts row b from a zero window, whatever the slot holds (NaN included);
    step_conv [num_slots, max_q >= n, C, K-1] (any float dtype) when save (mutated:
           step_conv[slots[b], j] <- the window after position j, j < n), else any tensor
           (conventionally empty) that is neither read nor written;
    y      [B, n, C] contiguous, x's dtype: SiLU of the causal depthwise conv (fp32 arithmetic).
    Equal to the gather, ``torch.where(fresh, 0, window)``, ``k3trt::short_conv`` and the scatter
    around it (the KDA layer's unfused form). Rows sharing one slot (padding rows on a trash slot,
    fresh=True) each compute their y exactly, but what that slot (and its step_conv rows) holds
    afterwards is unspecified; a row that is not fresh must not share its slot.

``kda_prep(y, f, b, dt_bias, A_log, num_heads, head_dim, lower_bound) -> (q, k, v, g, beta)``
    y [T, 3·H·D] (q|k|v after the conv), f [T, H·D] (f_b_proj's output), b [T, H] (b_proj's
    output): any float dtype, any strides; dt_bias [H·D], A_log [H] (fp32 in the checkpoint).
    q, k = L2-normalised (x · rsqrt(sum x² + 1e-6)), v = y's v part, g = the log-space decay
    (lower_bound · sigmoid(e^A_log · (f + dt_bias)), or -e^A_log · softplus(f + dt_bias) when
    lower_bound is None): fp32 [T, H, D], contiguous; beta = sigmoid(b) fp32 [T, H].
    Five separate tensors: a custom op's outputs may not alias each other.

Both run their plain-torch reference (``*_reference``, kda_front_ref.py) on every device;
``register_kernel("cuda")`` adds the Triton kernels, imported on the first CUDA call (importing
k3trt never needs triton), and falls back to the reference, with one logged warning per reason,
on inputs they do not cover.
The kernels do no host synchronisation and allocate only their outputs: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .kda_front_ref import (check_kda_prep, check_short_conv_slots, kda_prep_reference, kda_prep_unsupported,
                            short_conv_slots_reference, short_conv_slots_unsupported)

__all__ = ["short_conv_slots", "kda_prep", "short_conv_slots_reference", "kda_prep_reference"]


# ----------------------------------------------------------------------------- short conv over cache slots
@torch.library.custom_op("k3trt::short_conv_slots", mutates_args=("conv_cache", "step_conv"))
def short_conv_slots(x: Tensor, weight: Tensor, conv_cache: Tensor, slots: Tensor, fresh: Tensor,
                     step_conv: Tensor, save: bool) -> Tensor:
    """Short conv + SiLU on cache slots, in place; see the module docstring for layouts."""
    check_short_conv_slots(x, weight, conv_cache, slots, fresh, step_conv, save)
    return short_conv_slots_reference(x, weight, conv_cache, slots, fresh, step_conv, save)


@short_conv_slots.register_fake
def _(x, weight, conv_cache, slots, fresh, step_conv, save):
    return x.new_empty(x.shape)


@short_conv_slots.register_kernel("cuda")
def _short_conv_slots_cuda(x, weight, conv_cache, slots, fresh, step_conv, save):
    check_short_conv_slots(x, weight, conv_cache, slots, fresh, step_conv, save)
    return dispatch.call("short_conv_slots", short_conv_slots_unsupported(x, weight, conv_cache, step_conv, save),
                         "kda_front_triton.short_conv_slots_fwd", short_conv_slots_reference,
                         x, weight, conv_cache, slots, fresh, step_conv, save)


# ----------------------------------------------------------------------------- q/k norm, decay, beta
@torch.library.custom_op("k3trt::kda_prep", mutates_args=())
def kda_prep(y: Tensor, f: Tensor, b: Tensor, dt_bias: Tensor, A_log: Tensor, num_heads: int, head_dim: int,
             lower_bound: float | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """L2-normalised q, k, fp32 v, decay g and beta; see the module docstring for layouts."""
    check_kda_prep(y, f, b, dt_bias, A_log, num_heads, head_dim)
    return kda_prep_reference(y, f, b, dt_bias, A_log, num_heads, head_dim, lower_bound)


@kda_prep.register_fake
def _(y, f, b, dt_bias, A_log, num_heads, head_dim, lower_bound):
    qkvg = [y.new_empty((y.shape[0], num_heads, head_dim), dtype=torch.float32) for _ in range(4)]
    return (*qkvg, y.new_empty((y.shape[0], num_heads), dtype=torch.float32))


@kda_prep.register_kernel("cuda")
def _kda_prep_cuda(y, f, b, dt_bias, A_log, num_heads, head_dim, lower_bound):
    check_kda_prep(y, f, b, dt_bias, A_log, num_heads, head_dim)
    return dispatch.call("kda_prep", kda_prep_unsupported(y, f, b, dt_bias, A_log, head_dim),
                         "kda_front_triton.kda_prep_fwd", kda_prep_reference,
                         y, f, b, dt_bias, A_log, num_heads, head_dim, lower_bound)
