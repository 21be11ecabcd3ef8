"""Small shared building blocks: RMSNorm, the gated MLP and its activations (SiLU, SiTU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3trt.config import ModelConfig
from k3trt.parallel.comm import SINGLE, Comm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (bf16 sums of squares lose too much), returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, beta: float | None = None,
             linear_beta: float | None = None) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def situ_mul(gate: torch.Tensor, up: torch.Tensor, beta: float | None = None,
             linear_beta: float | None = None) -> torch.Tensor:
    """SiTU: gate' = β·tanh(gate/β)·sigmoid(gate); up' = lb·tanh(up/lb) when lb is set; in fp32."""
    g, u = gate.float(), up.float()
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (g * u).to(gate.dtype)


# hidden_act -> the gated activation; a table, so a new activation is one line.
ACTIVATIONS = {"silu": silu_mul, "situ": situ_mul}


def gated_act(cfg: ModelConfig):
    fn = ACTIVATIONS[cfg.hidden_act]
    beta, lb = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    return lambda gate, up: fn(gate, up, beta, lb)


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense MLP, each shared expert block and (stacked) each expert.
    Tensor parallel: gate/up column-parallel, down row-parallel, then an all-reduce."""

    def __init__(self, cfg: ModelConfig, width: int, inter: int, comm: Comm = SINGLE):
        super().__init__()
        inter //= comm.pc.tp
        self.gate_proj = nn.Linear(width, inter, bias=False)
        self.up_proj = nn.Linear(width, inter, bias=False)
        self.down_proj = nn.Linear(inter, width, bias=False)
        self.act = gated_act(cfg)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.down_proj(self.act(self.gate_proj(x), self.up_proj(x))), "tp")
