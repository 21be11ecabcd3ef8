"""Kimi Delta Attention: the linear-attention mixer of K3's KDA layers (spec/K3_MODEL.md, KDA).

Tokens arrive flat (see k3trt/model/context.py); each sequence i carries its recurrent state and
conv window in slot ``ctx.kda_slots[i]`` of the layer's ``KDALayerCache``. A sequence with
``ctx_lens[i] == 0`` starts from zeros whatever its slot holds (slots are reused without being
cleared). The final state and window are written back to the slot; with ``ctx.save_kda_states``
also the state and window after every position j, into ``step_state[slot, j]`` /
``step_conv[slot, j]``, so that verification can roll back to any accepted length.

Parameter names are the checkpoint's, under ``model.layers.{i}.self_attn.``. Heads are
independent: under tensor parallelism each rank holds linear_attn_config.num_heads / tp of them
(every per-head projection, conv channel, A_log and dt_bias; the caches too) and o_proj's partial
outputs are all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3trt.config import ModelConfig
from k3trt.model.context import KDALayerCache, StepContext
from k3trt.model.fuse import fuse_params_
from k3trt.model.layers import fused_ops
from k3trt.parallel.comm import SINGLE, Comm
from k3trt.plugins import kda as _kda_ops  # noqa: F401  (registers torch.ops.k3trt.kda_*)
from k3trt.plugins.kda_front import kda_prep_reference  # (also registers short_conv_slots, kda_prep)

# Sequences with more new tokens than this use the chunked form (unless every per-position state
# is wanted, which only the recurrent form produces); decode and verification steps stay recurrent.
CHUNKED_MIN_TOKENS = 16
# Chunk of the chunked form. Its plain-torch body materialises [chunk, chunk, dk] decays per head, so
# traffic grows with the chunk and launches with the chunk count. On the H200 at K3 sizes (96 heads,
# 2048 tokens; benchmarks/kda_chunk.py, results/kda_chunk_h200.json): 37 ms per layer at 32 against
# 57 at 64 and 68 at 16. That is the torch body's chunk; on CUDA the Triton kernel
# (plugins/kda_chunk_triton.py) works in 16-token chunks whatever this says.
PREFILL_CHUNK = 32


class _RMSNorm(nn.Module):
    """Plain RMSNorm in fp32 (checkpoint name: ``<name>.weight``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


class _ConvWeight(nn.Module):
    """Holds a depthwise conv weight [channels, 1, kernel] under ``<name>.weight``; the conv itself
    runs through ``k3trt::short_conv`` with the q|k|v weights concatenated."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class KDA(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm = SINGLE):
        super().__init__()
        la = cfg.linear_attn_config
        self.comm = comm
        self.num_heads, self.head_dim = H, D = la.num_heads // comm.pc.tp, la.head_dim
        self.kernel = la.short_conv_kernel_size
        self.gate_lower_bound = la.gate_lower_bound
        self.use_full_rank_gate = la.use_full_rank_gate
        self.scale = D ** -0.5
        self.chunked_min_tokens = CHUNKED_MIN_TOKENS
        hidden, proj = cfg.hidden_size, H * D

        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        self.q_conv1d = _ConvWeight(proj, self.kernel)
        self.k_conv1d = _ConvWeight(proj, self.kernel)
        self.v_conv1d = _ConvWeight(proj, self.kernel)
        self.f_a_proj = nn.Linear(hidden, D, bias=False)
        self.f_b_proj = nn.Linear(D, proj, bias=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(proj, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, H, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(hidden, proj, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, D, bias=False)
            self.g_b_proj = nn.Linear(D, proj, bias=False)
        self.o_norm = _RMSNorm(D, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)
        # every projection of x (q|k|v, the output gate's first matrix, the decay's a, beta) as one
        # [rows, hidden] weight once fused (model/fuse.py); _IN_PROJ names them in order
        self.in_proj: Tensor | None = None
        self.conv_w: Tensor | None = None     # q|k|v conv weights [3·H·D, 1, K] once fused

    _IN_PROJ = ("q_proj", "k_proj", "v_proj", "g_proj", "g_a_proj", "f_a_proj", "b_proj")

    def fuse_(self) -> bool:
        if self.in_proj is not None:
            return False
        linears = [getattr(self, n) for n in self._IN_PROJ if hasattr(self, n)]
        self.in_proj = fuse_params_([m.weight for m in linears], 0)
        self._in_sizes = [m.weight.shape[0] for m in linears]
        self.conv_w = fuse_params_([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0)
        return True

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, hidden] -> (q|k|v [T, 3·H·D], the output gate before its sigmoid [T, H·D], the
        decay's raw f_b_proj(f_a_proj(x)) [T, H·D], beta's raw b_proj(x) [T, H]), in x's dtype.
        Fused, q|k|v and the others are column slices of one GEMM's output (no copies)."""
        if self.in_proj is None:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
            return qkv, self.output_gate(x), self.f_b_proj(self.f_a_proj(x)), self.b_proj(x)
        s = self._in_sizes
        qkv, gate, fa, b = F.linear(x, self.in_proj).split([s[0] + s[1] + s[2], s[3], s[4], s[5]], -1)
        if not self.use_full_rank_gate:
            gate = self.g_b_proj(gate)
        return qkv, gate.reshape(-1, self.num_heads, self.head_dim), self.f_b_proj(fa), b

    # ------------------------------------------------------------------------- per-token parts
    def output_gate(self, x: Tensor) -> Tensor:
        gate = self.g_proj(x) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        return gate.view(-1, self.num_heads, self.head_dim)

    # ------------------------------------------------------------------------- forward
    def forward(self, x: Tensor, ctx: StepContext, cache: KDALayerCache) -> Tensor:
        """x [T, hidden] in flat token order -> [T, hidden]; reads and writes `cache` (see module doc)."""
        if x.shape[0] != ctx.num_tokens:
            raise ValueError(f"KDA: x has {x.shape[0]} tokens but the step context has {ctx.num_tokens}")
        H, D = self.num_heads, self.head_dim
        conv_w = self.conv_w if self.conv_w is not None else \
            torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0)
        qkv, gate, f, b = self.project(x)                                         # qkv [T, 3·H·D]
        fresh = ctx.fresh(x.device)
        slots = ctx.kda_slots.to(x.device)

        # Sequences with equal q_len (decode, verification, uniform prefill) run as one batch;
        # otherwise one sequence at a time. Either way tokens stay in flat order.
        q_uniform = ctx.uniform_q
        if q_uniform is not None:
            groups = [(0, ctx.num_seqs, q_uniform)]
        else:
            groups = [(i, i + 1, n) for i, n in enumerate(ctx.q_lens)]
        cu = ctx.cu_q
        outs = []
        for s0, s1, n in groups:
            t0, t1 = cu[s0], cu[s1]
            if t1 == t0:
                continue
            outs.append(self._run(qkv[t0:t1].view(s1 - s0, n, -1), f[t0:t1], b[t0:t1], conv_w, slots[s0:s1],
                                  fresh[s0:s1], ctx.save_kda_states, cache).reshape(t1 - t0, H, D))
        o = torch.cat(outs, 0) if outs else x.new_zeros(0, H, D, dtype=torch.float32)

        if fused_ops(x):    # one kernel for the norm, the gate and the cast (plugins/norm_act.py)
            o = torch.ops.k3trt.kda_out_gate(o, gate.reshape(-1, H * D), self.o_norm.weight, self.o_norm.eps)
        else:
            o = (self.o_norm(o) * torch.sigmoid(gate.float())).to(x.dtype).reshape(-1, H * D)
        return self.comm.all_reduce(self.o_proj(o), "tp")

    def _run(self, qkv: Tensor, f: Tensor, b: Tensor, conv_w: Tensor, slots: Tensor, fresh: Tensor,
             save: bool, cache: KDALayerCache) -> Tensor:
        """One batch of equal-length sequences: qkv [B, n, 3·H·D], the decay's and beta's raw
        projections f [B·n, H·D] and b [B·n, H]. Returns o [B, n, H, D] fp32 and updates the slots."""
        B, n = qkv.shape[:2]
        H, D = self.num_heads, self.head_dim
        if save and (cache.step_state is None or cache.step_conv is None or cache.step_state.shape[1] < n):
            have = None if cache.step_state is None else cache.step_state.shape[1]
            raise ValueError(f"KDA: save_kda_states for {n} positions needs step_state/step_conv with "
                             f"max_q >= {n} (allocated: {have})")
        chunked = n > self.chunked_min_tokens and not save
        if not chunked and not torch.compiler.is_exporting():
            # decode / verification, in place on the cache slots (no state or window gather /
            # scatter): the conv, then q/k norms, decay and beta in one kernel, then the recurrence
            # (plugins/kda_front.py; on the CPU their references, the functional code below)
            step_conv = cache.step_conv if save else cache.conv.new_empty(0)
            y = torch.ops.k3trt.short_conv_slots(qkv, conv_w, cache.conv, slots, fresh, step_conv, save)
            q, k, v, g, beta = torch.ops.k3trt.kda_prep(y.view(B * n, -1), f, b, self.dt_bias, self.A_log, H, D,
                                                        self.gate_lower_bound)
            step_state = cache.step_state if save else cache.state.new_empty(0)
            shape = (B, n, H, D)
            return torch.ops.k3trt.kda_recurrent_slots(q.view(shape), k.view(shape), v.view(shape), g.view(shape),
                                                       beta.view(B, n, H), cache.state, slots, fresh, step_state,
                                                       self.scale, save)

        # functional ops around gathers and scatters: the chunked form (prefill), and every form
        # under torch.export, whose ONNX translation (builder/onnx_ops.py) knows short_conv and
        # kda_recurrent but not the in-place ops
        # torch.where (not a multiply) so that NaN garbage in a reused slot cannot leak through
        keep = ~fresh
        conv0 = torch.where(keep.view(B, 1, 1), cache.conv[slots].to(qkv.dtype), 0.0)
        y, conv1, conv_all = torch.ops.k3trt.short_conv(qkv, conv_w, conv0, save)
        # q/k L2 norms, the decay g (log-space, <= 0) and beta: kda_prep's math, its plain-torch form
        q, k, v, g, beta = kda_prep_reference(y.view(B * n, -1), f, b, self.dt_bias, self.A_log, H, D,
                                              self.gate_lower_bound)
        shape = (B, n, H, D)
        q, k, v, g, beta = q.view(shape), k.view(shape), v.view(shape), g.view(shape), beta.view(B, n, H)
        state0 = torch.where(keep.view(B, 1, 1, 1), cache.state[slots], 0.0)
        if chunked:
            o, state1 = torch.ops.k3trt.kda_chunked(q, k, v, g, beta, state0, self.scale, PREFILL_CHUNK)
        else:
            o, state1, states_all = torch.ops.k3trt.kda_recurrent(q, k, v, g, beta, state0, self.scale, save)
            if save:
                cache.step_state[slots, :n] = states_all
        cache.state[slots] = state1
        cache.conv[slots] = conv1.to(cache.conv.dtype)
        if save:
            cache.step_conv[slots, :n] = conv_all.to(cache.step_conv.dtype)
        return o
