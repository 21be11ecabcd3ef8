"""Small shared building blocks: RMSNorm, the gated MLP and its activations (SiLU, SiTU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3trt.config import ModelConfig
from k3trt.model.fuse import fuse_params_
from k3trt.parallel.comm import SINGLE, Comm
from k3trt.plugins import norm_act


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def fused_ops(x: torch.Tensor) -> bool:
    """Whether the model calls the fused k3trt ops (one kernel each on the GPU) instead of their
    plain-torch references: on CUDA tensors, outside torch.export (whose ONNX/TensorRT translation
    knows the references' aten ops). The eager "no plugins" baseline disables the ops' kernels,
    which then run the references too."""
    return x.is_cuda and not torch.compiler.is_exporting()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (bf16 sums of squares lose too much), returned in x's dtype."""
    if fused_ops(x):
        return torch.ops.k3trt.rms_norm(x, weight, eps)
    return norm_act.rms_norm_reference(x, weight, eps)


# hidden_act -> the gated activation's reference (SiLU, SiTU; their math in plugins/norm_act.py)
ACTIVATIONS = norm_act.ACTIVATIONS


def gated_act(cfg: ModelConfig):
    kind, fn = cfg.hidden_act, ACTIVATIONS[cfg.hidden_act]
    beta, lb = cfg.activation_situ_beta, cfg.activation_situ_linear_beta

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if fused_ops(gate):
            return torch.ops.k3trt.gated_act(gate, up, kind, float(beta or 0.0), float(lb or 0.0))
        return fn(gate, up, beta, lb)
    return act


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
        self.gate_up: torch.Tensor | None = None    # [2·inter, width] once fused (model/fuse.py)

    def fuse_(self) -> bool:
        if self.gate_up is not None:
            return False
        self.gate_up = fuse_params_([self.gate_proj.weight, self.up_proj.weight], 0)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.comm.all_reduce(self.down_proj(self.act(gate, up)), "tp")
