"""KDA plugin ops: the delta-rule recurrence (recurrent and chunked forms) and the short conv.

Ops (namespace ``k3trt``; every one takes one sequence or a batch of equal-length sequences):

``kda_recurrent(q, k, v, g, beta, state, scale, save_all) -> (o, final_state, all_states)``
``kda_chunked(q, k, v, g, beta, state, scale, chunk_size=64) -> (o, final_state)``
    q, k   [T, H, dk] or [B, T, H, dk]   already L2-normalised (any float dtype)
    v      [T, H, dv] or [B, T, H, dv]
    g      [T, H, dk] or [B, T, H, dk]   log-space decay, <= 0
    beta   [T, H]     or [B, T, H]
    state  [H, dk, dv] or [B, H, dk, dv] fp32, the state before the first token
    o      like v (v's dtype); final_state fp32 like state;
    all_states fp32 [T, H, dk, dv] / [B, T, H, dk, dv]: the state after every position
           (an empty tensor unless save_all).
    Per head: S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T ;
              o_t = S_t^T q_t * scale.      Everything is computed in fp32.

``short_conv(x, weight, conv_state, save_all=False) -> (y, new_state, all_states)``
    x      [T, C] or [B, T, C];   weight [C, 1, K] (or [C, K]);
    conv_state [C, K-1] or [B, C, K-1]: the last K-1 inputs, oldest first;
    y = SiLU(causal depthwise conv of the window followed by x), x's dtype (fp32 arithmetic);
    new_state like conv_state (its dtype); all_states [T, C, K-1] / [B, T, C, K-1]: the window
    after every position (empty unless save_all).

``kda_recurrent_slots(q, k, v, g, beta, state_cache, slots, fresh, step_state_cache, scale, save) -> o``
    The recurrent form run in place on a cache of per-sequence states (decode and verification):
    q, k   [B, n, H, dk] (any float dtype, any strides); v [B, n, H, dv]; g [B, n, H, dk] fp32;
    beta   [B, n, H];
    state_cache fp32 [num_slots, H, dk, dv]: row b starts from state_cache[slots[b]] and that slot
           receives the state after position n-1 (mutated);
    slots  int64 [B], in [0, num_slots) (the CUDA kernel cannot check without a host sync: it runs
           an out-of-range row from zeros and writes nothing; the torch body raises);
    fresh  bool [B]: True starts row b from zeros, whatever the slot holds (NaN included);
    step_state_cache fp32 [num_slots, max_q >= n, H, dk, dv] when save (mutated:
           step_state_cache[slots[b], j] <- the state after position j, j < n), else any tensor
           (conventionally empty) that is neither read nor written;
    o      fp32 [B, n, H, dv].
    Rows sharing one slot (padding rows on a trash slot, fresh=True) each compute; which one's
    state lands in the slot is unspecified. Equal to gather, ``torch.where(fresh, 0, state)``,
    ``kda_recurrent`` and a scatter, which is its torch body; the CUDA kernel (kda_triton.py)
    skips the gather/scatter copies, which at K3 sizes cost ~3x the recurrence's own traffic.

Apart from ``kda_recurrent_slots``, none of the ops mutates its inputs; the caller writes the
returned states into its cache.

The plain-torch references (kda_ref.py) are the ops' bodies on every device; on CUDA,
``kda_recurrent_slots`` and ``kda_chunked`` take their Triton kernels (kda_triton.py,
kda_chunk_triton.py) where those cover the call. ``kda_reference_loop`` (kda_ref.py) is the
oracle: the spec's recurrence in fp64, token by token. For export, ``kda_recurrent``,
``kda_chunked`` and ``short_conv`` are ONNX nodes (``ONNX`` below).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import dispatch
from .kda_ref import (check_kda, check_kda_recurrent_slots, kda_chunked_reference, kda_chunked_unsupported,
                      kda_recurrent_reference, kda_recurrent_slots_reference, kda_recurrent_slots_unsupported,
                      kda_reference_loop, short_conv_reference)
from .onnx_spec import F32, FLOATS, OnnxOp, params

__all__ = ["kda_recurrent", "kda_recurrent_slots", "kda_chunked", "short_conv", "kda_reference_loop", "ONNX"]


# ----------------------------------------------------------------------------- recurrent form
@torch.library.custom_op("k3trt::kda_recurrent", mutates_args=())
def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                  scale: float, save_all: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Token-by-token KDA (decode and verification); see the module docstring for layouts."""
    return kda_recurrent_reference(q, k, v, g, beta, state, scale, save_all)


@kda_recurrent.register_fake
def _(q, k, v, g, beta, state, scale, save_all):
    o = v.new_empty(v.shape)
    final = state.new_empty(state.shape, dtype=torch.float32)
    if save_all:
        all_states = state.new_empty((*q.shape[:-2], *state.shape[-3:]), dtype=torch.float32)
    else:
        all_states = state.new_empty((0,), dtype=torch.float32)
    return o, final, all_states


# ----------------------------------------------------------------------------- recurrent form over cache slots
@torch.library.custom_op("k3trt::kda_recurrent_slots", mutates_args=("state_cache", "step_state_cache"))
def kda_recurrent_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_cache: Tensor,
                        slots: Tensor, fresh: Tensor, step_state_cache: Tensor, scale: float,
                        save: bool) -> Tensor:
    """Token-by-token KDA on cache slots, in place; see the module docstring for layouts."""
    check_kda_recurrent_slots(q, k, v, g, beta, state_cache, slots, fresh, step_state_cache, save)
    return kda_recurrent_slots_reference(q, k, v, g, beta, state_cache, slots, fresh, step_state_cache, scale, save)


@kda_recurrent_slots.register_fake
def _(q, k, v, g, beta, state_cache, slots, fresh, step_state_cache, scale, save):
    return q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=torch.float32)


@kda_recurrent_slots.register_kernel("cuda")
def _kda_recurrent_slots_cuda(q, k, v, g, beta, state_cache, slots, fresh, step_state_cache, scale, save):
    check_kda_recurrent_slots(q, k, v, g, beta, state_cache, slots, fresh, step_state_cache, save)
    return dispatch.call("kda_recurrent_slots",
                         kda_recurrent_slots_unsupported(q, v, state_cache, step_state_cache, save),
                         "kda_triton.kda_recurrent_slots_fwd", kda_recurrent_slots_reference,
                         q, k, v, g, beta, state_cache, slots, fresh, step_state_cache, scale, save)


# ----------------------------------------------------------------------------- chunked form
@torch.library.custom_op("k3trt::kda_chunked", mutates_args=())
def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                scale: float, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Chunked KDA for prefill; equal to ``kda_recurrent`` up to rounding."""
    return kda_chunked_reference(q, k, v, g, beta, state, scale, chunk_size)


@kda_chunked.register_fake
def _(q, k, v, g, beta, state, scale, chunk_size=64):
    return v.new_empty(v.shape), state.new_empty(state.shape, dtype=torch.float32)


@kda_chunked.register_kernel("cuda")
def _kda_chunked_cuda(q, k, v, g, beta, state, scale, chunk_size=64):
    check_kda(q, k, v, g, beta, state)
    return dispatch.call("kda_chunked", kda_chunked_unsupported(q, k, v, g, beta, state),
                         "kda_chunk_triton.kda_chunked_fwd", kda_chunked_reference,
                         q, k, v, g, beta, state, scale, chunk_size)


# ----------------------------------------------------------------------------- short conv
@torch.library.custom_op("k3trt::short_conv", mutates_args=())
def short_conv(x: Tensor, weight: Tensor, conv_state: Tensor,
               save_all: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Causal depthwise conv + SiLU over a rolling window; see the module docstring for layouts."""
    return short_conv_reference(x, weight, conv_state, save_all)


@short_conv.register_fake
def _(x, weight, conv_state, save_all=False):
    y = x.new_empty(x.shape)
    new_state = conv_state.new_empty(conv_state.shape)
    if save_all:
        all_states = conv_state.new_empty((*x.shape[:-1], *conv_state.shape[-2:]))
    else:
        all_states = conv_state.new_empty((0,))
    return y, new_state, all_states


# ----------------------------------------------------------------------------- export
def native_kda_chunked(q, k, v, g, beta, state, scale, chunk_size=64):
    """kda_chunked for standard ONNX: no triangular solve there, so the recurrence, unrolled (equal
    up to rounding)."""
    o, final, _ = kda_recurrent_reference(q, k, v, g, beta, state, scale, False)
    return o, final


ONNX = (
    OnnxOp("kda_recurrent", "KdaRecurrent",
           params("q k v g beta", FLOATS) + params("state", F32),
           params("o", FLOATS) + params("final_state all_states", F32),
           "Token-by-token KDA delta rule; all_states is empty unless save_all.",
           native=kda_recurrent_reference),
    OnnxOp("kda_chunked", "KdaChunked",
           params("q k v g beta", FLOATS) + params("state", F32),
           params("o", FLOATS) + params("final_state", F32),
           "Chunked (WY) KDA delta rule for prefill.",
           native=native_kda_chunked),
    OnnxOp("short_conv", "ShortConv",
           params("x weight conv_state", FLOATS),
           params("y new_state all_states", FLOATS),
           "Causal depthwise conv + SiLU over a rolling window.",
           native=short_conv_reference),
)
