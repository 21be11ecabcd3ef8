"""Latent mixture of experts with the sigmoid, grouped top-k (``noaux_tc``) router.

Routing (fp32): scores = sigmoid(gate(x)). The correction bias only *chooses*: experts are picked
by scores + e_score_correction_bias (first the best topk_group groups, a group scored by the sum of
its two best experts, then top-k inside them), but they are *weighted* by their raw scores,
renormalised to sum 1, times routed_scaling_factor.

Latent path: x --routed_expert_down_proj--> width W (K3: 3584) --experts--> Σ w_e·expert_e
--RMSNorm (latent_moe_use_norm)--> routed_expert_up_proj --> hidden. Shared experts see x itself.
Experts are stored stacked ([E, I, W] and [E, W, I]) so a grouped GEMM can take them whole; the
checkpoint keeps one tensor per expert (``block_sparse_moe.experts.{e}.w1/w3/w2``, layout.py) and the
loader stacks them.

Expert parallel (ep > 1): rank e holds experts [e·E/ep, (e+1)·E/ep); every rank routes every token
(the router is replicated), runs its own experts on the tokens routed to them, and the latent
outputs are summed by an all-reduce over the EP group: simple and exact, ~2·T·W values per rank.
The alternative is an all-to-all that sends each token to the ranks of its k experts and back
(DeepEP; ~2·T_local·min(k, ep)·W per rank): it pays when tokens are split between ranks
(attention data parallel); with every token already on every rank, as under TP, it does not.
"""

from __future__ import annotations

import torch
from torch import nn

from k3trt.config import ModelConfig
from k3trt.model.fuse import fuse_params_
from k3trt.model.layers import GatedMLP, RMSNorm, fused_ops, gated_act
from k3trt.parallel.comm import SINGLE, Comm
from k3trt.plugins import moe_gemm, moe_route  # noqa: F401  (moe_route registers its ops)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids int64 [T, k], combine weights fp32 [T, k])."""
        return route(self.cfg, x.float() @ self.weight.float().t(), self.e_score_correction_bias.float())


def route(cfg: ModelConfig, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    T, E, k = logits.shape[0], cfg.num_experts, cfg.num_experts_per_token
    sigmoid, grouped = cfg.moe_router_activation_func == "sigmoid", cfg.use_grouped_topk and cfg.num_expert_group > 1
    bias = bias if (bias is not None and cfg.topk_method == "noaux_tc") else None
    if fused_ops(logits) and not grouped:
        # one kernel instead of ~8 (plugins/moe_route.py; the code below is its reference)
        return torch.ops.k3trt.moe_route(logits, bias, k, sigmoid, cfg.moe_renormalize, cfg.routed_scaling_factor)
    scores = torch.sigmoid(logits) if sigmoid else logits.softmax(-1)
    choice = scores + bias if bias is not None else scores
    if grouped:
        groups = choice.view(T, cfg.num_expert_group, -1)
        group_score = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1)          # [T, G]
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // cfg.num_expert_group, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.moe_renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    return ids, weights * cfg.routed_scaling_factor


class Experts(nn.Module):
    """E gated MLPs at width W, stacked. An id equal to E (the number of experts held here) is
    another EP rank's: it contributes nothing.

    The (token, choice) pairs are sorted by expert and run as three grouped GEMMs whose group
    boundaries stay on the device, so a step needs no host synchronisation (CUDA graphs) and reads
    each chosen expert's weights once. Where torch's grouped GEMM does not take the dtype or the
    shapes (fp32 on CUDA; widths not 16-byte aligned) a per-expert loop runs instead, eager only."""

    def __init__(self, cfg: ModelConfig, width: int, num_experts: int | None = None):
        super().__init__()
        E, inter = num_experts or cfg.num_experts, cfg.moe_intermediate_size
        self.w_gate = nn.Parameter(torch.empty(E, inter, width))
        self.w_up = nn.Parameter(torch.empty(E, inter, width))
        self.w_down = nn.Parameter(torch.empty(E, width, inter))
        self.act = gated_act(cfg)
        self.gate_up: torch.Tensor | None = None    # [E, 2·inter, width] once fused (model/fuse.py)

    def fuse_(self) -> bool:
        if self.gate_up is not None:
            return False
        self.gate_up = fuse_params_([self.w_gate, self.w_up], 1)
        return True

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if grouped_mm_ok(x, self.w_gate, self.w_down):
            return self._grouped(x, ids, weights)
        return self._loop(x, ids, weights)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        (T, k), E = ids.shape, self.w_gate.shape[0]
        flat = ids.flatten()
        order = flat.argsort(stable=True)                 # pairs grouped by expert; id E (elsewhere) last
        counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts[:E].cumsum(0, dtype=torch.int32)   # group ends; pairs past offs[-1] get no GEMM
        src = order // k                                  # each pair's token
        if moe_gemm.use_kernel(T * k, E, x):
            # few rows per expert: our kernel, which also gathers the tokens and scatters the
            # results back to (token, choice) order, then one kernel for the weighted sum
            gemm = torch.ops.k3trt.moe_gemm
            if self.gate_up is not None:
                h = self.act(*gemm(x, self.gate_up, offs, src).chunk(2, -1))
            else:
                h = self.act(gemm(x, self.w_gate, offs, src), gemm(x, self.w_up, offs, src))
            y = gemm(h, self.w_down, offs, None, order, T * k)
            return torch.ops.k3trt.moe_combine(y, ids, weights, E)
        xs = x[src]
        if self.gate_up is not None:
            h = self.act(*_grouped_mm(xs, self.gate_up, offs).chunk(2, -1))
        else:
            h = self.act(_grouped_mm(xs, self.w_gate, offs), _grouped_mm(xs, self.w_up, offs))
        ys = _grouped_mm(h, self.w_down, offs)
        y = torch.empty_like(ys)
        y[order] = ys                                     # back to (token, choice) order: a permutation
        # other ranks' pairs got no GEMM: their rows are unwritten (maybe NaN), so select, not multiply
        y = torch.where((ids < E)[..., None], y.view(T, k, -1).float(), 0.0)
        return (y * weights.float()[..., None]).sum(1).to(x.dtype)

    def _loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.w_gate.shape[0]).tolist()[: self.w_gate.shape[0]]
        token_of = order // ids.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            tok = token_of[start:start + n]
            start += n
            xe = x[tok]
            h = self.act(xe @ self.w_gate[e].t(), xe @ self.w_up[e].t()) @ self.w_down[e].t()
            out.index_add_(0, tok, h.float() * weights.flatten()[sel, None])
        return out.to(x.dtype)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [P, K] @ w[e].T for each expert's rows: torch's grouped GEMM in moe_gemm's layout."""
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


def grouped_mm_ok(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands: every GEMM dimension 16-byte aligned, and on
    CUDA bf16 on SM90 or newer (what torch's grouped kernels cover); the CPU takes any float."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w_in.dtype:
        return False
    size = x.element_size()
    if any(d * size % 16 for d in (*w_in.shape[1:], *w_out.shape[1:])):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm = SINGLE):
        super().__init__()
        width = cfg.routed_expert_hidden_size or cfg.hidden_size
        self.comm, local = comm, cfg.num_experts // comm.pc.ep
        self.first_expert = comm.pc.ep_rank * local
        self.gate = Router(cfg)
        if cfg.routed_expert_hidden_size:
            self.routed_expert_down_proj = nn.Linear(cfg.hidden_size, width, bias=False)
            self.routed_expert_up_proj = nn.Linear(width, cfg.hidden_size, bias=False)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(width, cfg.rms_norm_eps)
        self.experts = Experts(cfg, width, local)
        if cfg.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts,
                                           comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        if self.comm.pc.ep > 1:     # global ids -> this rank's; other ranks' experts -> E_local (skipped)
            local = ids - self.first_expert
            E = self.experts.w_gate.shape[0]
            ids = torch.where((local >= 0) & (local < E), local, E)
        latent = self.routed_expert_down_proj(x) if hasattr(self, "routed_expert_down_proj") else x
        y = self.comm.all_reduce(self.experts(latent, ids, weights), "ep")
        if hasattr(self, "routed_expert_norm"):
            y = self.routed_expert_norm(y)
        if hasattr(self, "routed_expert_up_proj"):
            y = self.routed_expert_up_proj(y)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y
