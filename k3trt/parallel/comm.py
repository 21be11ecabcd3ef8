"""Collectives over the named groups of a ParallelConfig ("tp", "dcp", "ep"), behind one small
interface. ``Comm`` itself is the single-process implementation: every group has one rank and
every collective returns its input unchanged (no op is added to a traced or exported graph).
A ``Comm`` with a multi-rank ParallelConfig builds and loads that rank's shard of the model (no
process group needed) but refuses to run a collective over a group of more than one rank.
``TorchComm`` runs them through torch.distributed (NCCL on GPUs, gloo on CPUs).

    all_reduce(x, group)           sum over the group; returns the result (x itself, reduced in place)
    all_gather(x, group, dim=0)    the group's tensors concatenated along `dim`, in group order
    reduce_scatter(x, group, dim)  sum over the group, then this rank's 1/size slice along `dim`
A group of size 1 is a no-op in every implementation.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from k3trt.parallel.config import GROUPS, ParallelConfig


class Comm:
    """No communication: the single-process implementation (and the interface)."""

    def __init__(self, pc: ParallelConfig | None = None):
        self.pc = pc or ParallelConfig()

    def all_reduce(self, x: torch.Tensor, group: str) -> torch.Tensor:
        return self._alone(x, group)

    def all_gather(self, x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
        return self._alone(x, group)

    def reduce_scatter(self, x: torch.Tensor, group: str, dim: int = 0) -> torch.Tensor:
        return self._alone(x, group)

    def _alone(self, x: torch.Tensor, group: str) -> torch.Tensor:
        if self.pc.size(group) != 1:
            raise RuntimeError(f"a collective over the {group} group ({self.pc.size(group)} ranks) "
                               f"needs a TorchComm, not {type(self).__name__}")
        return x

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pc})"


SINGLE = Comm()


# all_gather_single / reduce_scatter_single are the names since torch 2.13; older torch (the
# GPU machine has 2.11) calls them *_into_tensor / *_tensor.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchComm(Comm):
    """torch.distributed collectives. The default process group must be initialised with
    world size == pc.world_size and rank == pc.rank; constructing one is collective (every rank
    creates every subgroup, in the same order). `timeout`: the subgroups' collective timeout
    (None: torch's default for the backend)."""

    def __init__(self, pc: ParallelConfig, timeout: timedelta | None = None):
        super().__init__(pc)
        if not dist.is_initialized():
            raise RuntimeError("TorchComm needs torch.distributed.init_process_group first "
                               "(k3trt.parallel.launch does it)")
        if (dist.get_world_size(), dist.get_rank()) != (pc.world_size, pc.rank):
            raise ValueError(f"torch.distributed has world {dist.get_world_size()}, rank {dist.get_rank()}; "
                             f"{pc} wants world {pc.world_size}, rank {pc.rank}")
        self._groups: dict[str, dist.ProcessGroup] = {}
        for name in GROUPS:
            n = pc.size(name)
            if n == 1:
                continue
            if n == pc.world_size:
                self._groups[name] = dist.group.WORLD
                continue
            for ranks in pc.all_groups(name):
                g = dist.new_group(list(ranks), timeout=timeout)
                if pc.rank in ranks:
                    self._groups[name] = g

    def all_reduce(self, x, group):
        g = self._groups.get(group)
        if g is None:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=g)
        return x

    def all_gather(self, x, group, dim=0):
        g = self._groups.get(group)
        if g is None:
            return x
        n = self.pc.size(group)
        x = x.contiguous()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        _gather_into(out, x, group=g)
        if dim % x.dim() == 0:
            return out
        return torch.cat(out.chunk(n, 0), dim=dim)

    def reduce_scatter(self, x, group, dim=0):
        g = self._groups.get(group)
        if g is None:
            return x
        n = self.pc.size(group)
        xs = x.movedim(dim, 0).contiguous()
        if xs.shape[0] % n:
            raise ValueError(f"reduce_scatter: dim {dim} of size {xs.shape[0]} does not split {n} ways")
        out = xs.new_empty((xs.shape[0] // n, *xs.shape[1:]))
        _reduce_scatter_into(out, xs, group=g)
        return out.movedim(0, dim)
