"""Plain-torch side of the KDA ops (kda.py has the ops and their layouts): the references (the ops'
bodies on every device), the argument checks, what the Triton kernels cover, and
``kda_reference_loop``, the oracle: the spec's recurrence written plainly, token by token with
explicit matrices, in fp64. Imported by the ops, the kernels (kda_triton.py, kda_chunk_triton.py)
and kda_front.py alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- helpers
def _batched(*xs: Tensor, rank: int) -> tuple[bool, list[Tensor]]:
    """Add a batch dimension to unbatched inputs (x.dim() == rank) so one code path serves both."""
    single = xs[0].dim() == rank
    return single, [x.unsqueeze(0) if single else x for x in xs]


def check_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> None:
    if q.dim() not in (3, 4):
        raise ValueError(f"kda: q must be [T, H, dk] or [B, T, H, dk], got {tuple(q.shape)}")
    lead, (h, dk), dv = q.shape[:-2], q.shape[-2:], v.shape[-1]
    for name, t, shape in (("k", k, (*lead, h, dk)), ("v", v, (*lead, h, dv)), ("g", g, (*lead, h, dk)),
                           ("beta", beta, (*lead, h)), ("state", state, (*lead[:-1], h, dk, dv))):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"kda: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                             f"(from q {tuple(q.shape)} and v {tuple(v.shape)})")


def _empty_states(ref: Tensor) -> Tensor:
    return ref.new_empty((0,), dtype=torch.float32)



# ----------------------------------------------------------------------------- recurrent form
def kda_recurrent_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                            scale: float, save_all: bool) -> tuple[Tensor, Tensor, Tensor]:
    check_kda(q, k, v, g, beta, state)
    single, (q, k, v, g, beta, state) = _batched(q, k, v, g, beta, state, rank=3)
    out_dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    B, T, H, dk = q.shape
    S = state.float().clone()
    o = q.new_empty(B, T, H, v.shape[-1])
    saved = []
    for t in range(T):
        k_t = k[:, t]
        # Diag(exp g) S, then the delta rule written as a rank-1 correction:
        # (I - b k k^T) D S + b k v^T = D S + b k (v - k^T D S)^T
        S = S * g[:, t].exp().unsqueeze(-1)
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)
        S = S + (beta[:, t, :, None, None] * k_t.unsqueeze(-1)) * (v[:, t] - pred).unsqueeze(-2)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S) * scale
        if save_all:
            saved.append(S)
    all_states = torch.stack(saved, 1) if save_all and T else (
        S.new_empty(B, 0, *S.shape[1:]) if save_all else _empty_states(S))
    o = o.to(out_dtype)
    if single:
        return o[0], S[0], all_states[0] if save_all else all_states
    return o, S, all_states



# ----------------------------------------------------------------------------- recurrent form over cache slots
def check_kda_recurrent_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_cache: Tensor,
                              slots: Tensor, fresh: Tensor, step_state_cache: Tensor, save: bool) -> None:
    """Shapes and dtypes only: nothing here reads a tensor's values (no host sync)."""
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"kda_recurrent_slots: q must be [B, n, H, dk] and v [B, n, H, dv], got "
                         f"{tuple(q.shape)} and {tuple(v.shape)}")
    B, n, H, dk = q.shape
    dv = v.shape[-1]
    for name, t, shape in (("k", k, (B, n, H, dk)), ("v", v, (B, n, H, dv)), ("g", g, (B, n, H, dk)),
                           ("beta", beta, (B, n, H)), ("state_cache", state_cache, (state_cache.shape[0], H, dk, dv)),
                           ("slots", slots, (B,)), ("fresh", fresh, (B,))):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"kda_recurrent_slots: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} "
                             f"(from q {tuple(q.shape)} and v {tuple(v.shape)})")
    if state_cache.dtype != torch.float32:
        raise ValueError(f"kda_recurrent_slots: state_cache must be fp32, got {state_cache.dtype}")
    if slots.dtype not in (torch.int64, torch.int32) or fresh.dtype != torch.bool:
        raise ValueError(f"kda_recurrent_slots: slots must be int64 (or int32) and fresh bool, got {slots.dtype} "
                         f"and {fresh.dtype}")
    if save:
        want = (state_cache.shape[0], H, dk, dv)
        st = step_state_cache
        if st.dim() != 5 or (st.shape[0], *st.shape[2:]) != want or st.shape[1] < n or st.dtype != torch.float32:
            raise ValueError(f"kda_recurrent_slots: save needs an fp32 step_state_cache [num_slots, max_q >= {n}, "
                             f"H, dk, dv] = [{want[0]}, >={n}, {H}, {dk}, {dv}], got {tuple(st.shape)} {st.dtype}")


def kda_recurrent_slots_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_cache: Tensor,
                                  slots: Tensor, fresh: Tensor, step_state_cache: Tensor, scale: float,
                                  save: bool) -> Tensor:
    """The reference: gather, zero the fresh rows, ``kda_recurrent``, scatter."""
    B, n = q.shape[:2]
    # a select, not a multiply: 0 * NaN garbage in a reused slot would be NaN
    state0 = torch.where(fresh.view(B, 1, 1, 1), 0.0, state_cache[slots])
    o, state1, states_all = kda_recurrent_reference(q, k, v.float(), g, beta, state0, scale, save)
    state_cache[slots] = state1
    if save:
        step_state_cache[slots, :n] = states_all
    return o


def kda_recurrent_slots_unsupported(q: Tensor, v: Tensor, state_cache: Tensor, step_state_cache: Tensor,
                                    save: bool) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can). Shapes and dtypes only."""
    dk, dv = q.shape[-1], v.shape[-1]
    if not (_pow2(dk) and _pow2(dv)) or dk > 256:
        return f"dk={dk}, dv={dv} (need powers of two >= 16, dk <= 256)"
    if q.dtype not in _FLOATS or v.dtype not in _FLOATS:
        return f"q/v dtypes {q.dtype}/{v.dtype}"
    # the kernel addresses the caches as dense arrays (the model's caches are)
    if not state_cache.is_contiguous() or (save and not step_state_cache.is_contiguous()):
        return "non-contiguous state_cache / step_state_cache"
    return None


def _pow2(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


# ----------------------------------------------------------------------------- chunked form
def kda_chunked_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                          scale: float, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The chunked (UT-transform / WY) form, chunk by chunk.

    Within a chunk, with G_t = cumsum(g) from the chunk start and S0 the state before it, every
    state is S_t = Diag(e^{G_t}) S0 + sum_{i<=t} Diag(e^{G_t - G_i}) k_i d_i^T, where
    d_i = b_i (v_i - k_i^T Diag(e^{g_i}) S_{i-1}) is the delta-rule correction. The d_i solve a unit
    lower-triangular system (I + diag(b) A) d = diag(b) (V - (K*e^G) S0) with
    A_ti = sum_c k_t[c] k_i[c] e^{G_t[c] - G_i[c]} (i < t); with T = (I + diag(b) A)^-1 diag(b),
    U = T V and W = T (K*e^G) (the UT transform), d = U - W S0. Then
    o = scale (Q*e^G) S0 + scale M d, M_ti = sum_c q_t[c] k_i[c] e^{G_t[c]-G_i[c]} (i <= t),
    and S_end = Diag(e^{G_end}) S0 + (K * e^{G_end - G})^T d.

    Stability: every exponent used is G_t - G_i with i <= t (or G_t itself), which is <= 0 since
    g <= 0, so nothing overflows however negative the decays. The pairwise exponents are formed per
    channel ([n, n, dk] per head) rather than factored as e^{G_t} e^{-G_i}, because e^{-G_i}
    overflows fp32 once a chunk's decay passes ~88 (a 64-chunk at the -5 gate bound reaches -320),
    and each is summed from i rather than taken as G_t - G_i, which would cancel catastrophically
    when a strong decay early in the chunk is followed by weak ones.
    """
    check_kda(q, k, v, g, beta, state)
    if chunk_size < 1:
        raise ValueError(f"kda_chunked: chunk_size must be >= 1, got {chunk_size}")
    single, (q, k, v, g, beta, state) = _batched(q, k, v, g, beta, state, rank=3)
    out_dtype = v.dtype
    # [B, H, T, d] so that each chunk is a contiguous slice of the time axis
    q, k, v, g = (t.float().transpose(1, 2) for t in (q, k, v, g))
    beta = beta.float().transpose(1, 2)
    B, H, T, dk = q.shape
    S = state.float().clone()
    o = q.new_empty(B, H, T, v.shape[-1])
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        n = e - s
        qc, kc, vc, bc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e]
        gc = g[:, :, s:e]
        G = gc.cumsum(-2)                                               # [B, H, n, dk]
        # span[i, t] = sum_{i < j <= t} g_j = G_t - G_i, summed from i rather than subtracted: the
        # difference of two large cumulative decays loses the small decay between them
        later = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)     # [i, t]: t > i
        span = torch.where(later[..., None], gc.unsqueeze(-3), 0.0).cumsum(-2)  # [B, H, i, t, dk]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()     # [t, i]: i <= t
        decay = torch.where(causal[..., None], span.transpose(-2, -3), float("-inf")).exp()  # [B, H, t, i, dk]
        kk = (kc.unsqueeze(-2) * decay * kc.unsqueeze(-3)).sum(-1).tril(-1)   # A, strictly lower
        qk = (qc.unsqueeze(-2) * decay * kc.unsqueeze(-3)).sum(-1)            # M, diagonal included
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        lower = eye + bc.unsqueeze(-1) * kk
        t_mat = torch.linalg.solve_triangular(lower, torch.diag_embed(bc), upper=False, unitriangular=True)
        eG = G.exp()
        u = t_mat @ vc                                                  # [B, H, n, dv]
        w = t_mat @ (kc * eG)                                           # [B, H, n, dk]
        delta = u - w @ S
        o[:, :, s:e] = scale * ((qc * eG) @ S + qk @ delta)
        to_end = span[..., -1, :]                                       # [B, H, i, dk]: G_end - G_i
        S = G[:, :, -1].exp().unsqueeze(-1) * S + (kc * to_end.exp()).transpose(-1, -2) @ delta
    o = o.transpose(1, 2).to(out_dtype).contiguous()
    return (o[0], S[0]) if single else (o, S)


def kda_chunked_unsupported(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            state: Tensor) -> str | None:
    """Why the Triton kernel cannot take this call (None when it can). Shapes, dtypes and devices only."""
    dk, dv = q.shape[-1], v.shape[-1]
    if not (_pow2_le_256(dk) and _pow2_le_256(dv)):
        return f"dk={dk}, dv={dv} (need powers of two in [16, 256])"
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, state=state)
    odd = [f"{n} {t.dtype}" for n, t in tensors.items() if t.dtype not in _FLOATS]
    if odd:
        return f"dtypes {', '.join(odd)} (need fp32, bf16 or fp16)"
    if any(t.device.type != "cuda" for t in tensors.values()):
        return "tensors not on CUDA"
    return None


def _pow2_le_256(x: int) -> bool:
    return 16 <= x <= 256 and x & (x - 1) == 0


# ----------------------------------------------------------------------------- short conv
def short_conv_reference(x: Tensor, weight: Tensor, conv_state: Tensor,
                         save_all: bool) -> tuple[Tensor, Tensor, Tensor]:
    w = weight.reshape(weight.shape[0], -1)                             # [C, K]
    C, K = w.shape
    if x.dim() not in (2, 3) or x.shape[-1] != C or tuple(conv_state.shape[-2:]) != (C, K - 1) \
            or conv_state.dim() != x.dim():
        raise ValueError(f"short_conv: x {tuple(x.shape)}, weight {tuple(weight.shape)} and conv_state "
                         f"{tuple(conv_state.shape)} do not fit ([B,] T, C), [C, 1, K], ([B,] C, K-1)")
    single, (x, conv_state) = _batched(x, conv_state, rank=2)
    B, T, _ = x.shape
    # the window followed by the new inputs, time-major: [B, K-1+T, C]
    full = torch.cat([conv_state.to(x.dtype).transpose(1, 2), x], 1)
    wf, ff = w.float(), full.float()
    acc = ff[:, 0:T] * wf[:, 0]
    for j in range(1, K):
        acc = acc + ff[:, j:j + T] * wf[:, j]
    y = F.silu(acc).to(x.dtype)
    new_state = full[:, T:].transpose(1, 2).to(conv_state.dtype).contiguous()
    if save_all:
        # the window after position t is full[t+1 : t+K]
        all_states = torch.stack([full[:, t + 1:t + K].transpose(1, 2) for t in range(T)], 1) if T else \
            full.new_empty(B, 0, C, K - 1)
        all_states = all_states.to(conv_state.dtype)
        if single:
            all_states = all_states[0]
    else:
        all_states = conv_state.new_empty((0,))
    return (y[0], new_state[0], all_states) if single else (y, new_state, all_states)


# ----------------------------------------------------------------------------- the oracle
def kda_reference_loop(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                       scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The spec's recurrence, one sequence ([T, H, ...]), token by token and head by head, with the
    transition matrix built explicitly, in fp64. Returns (o, final_state, all_states) in fp64."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, state))
    T, H, dk = q.shape
    S = S.clone()
    eye = torch.eye(dk, dtype=torch.float64)
    o = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    states = torch.zeros(T, *S.shape, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            kt = k[t, h].unsqueeze(1)                                   # column vector [dk, 1]
            transition = (eye - beta[t, h] * kt @ kt.T) @ torch.diag(g[t, h].exp())
            S[h] = transition @ S[h] + beta[t, h] * kt @ v[t, h].unsqueeze(0)
            o[t, h] = S[h].T @ q[t, h] * scale
        states[t] = S
    return o, S, states
