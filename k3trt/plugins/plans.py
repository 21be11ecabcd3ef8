"""Capacity plans for the fused MLA verification kernel.

A plan is made once per batch capacity (requests, each with ``q_per_req`` query rows) and fixes
everything the launch needs that must not depend on the step's lengths, so that a CUDA graph (or a
TensorRT engine) captured for the capacity stays valid: tile shapes, the split-K count, the grid
and the scratch for split partials. Lengths only change how much work each program finds at run
time (a split past the end of a short request exits at once).

Capacities are the powers of two below the largest batch, plus the largest itself (28 → 1, 2, 4,
8, 16, 28: ``power_of_two_capacities``, the engine's own rule); a step takes the smallest plan that
covers its live requests and pads; more live requests than the largest capacity is an error, never
a silent truncation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from k3trt.engine.capacities import power_of_two_capacities

H200_SMS = 132
MAX_SPLITS = 128
SMALL_GRID = 8  # (request, M-tile) pairs below which a plan splits d_v over program pairs


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch parameters of the Triton verification kernel."""
    block_m: int       # folded (row, head) pairs per program
    block_n: int       # cache tokens per inner step
    num_warps: int
    num_stages: int
    dv_split: int = 1  # programs sharing an M tile, each owning d_v / dv_split output columns


@dataclass(frozen=True)
class VerifyPlan:
    capacity: int          # requests
    q_per_req: int
    num_heads: int
    d_qk: int
    d_v: int
    config: KernelConfig
    num_splits: int        # split-K count fixed for the capacity; 1 = no merge pass
    min_split_tokens: int  # a request shorter than splits·this uses fewer splits at run time
    num_sms: int = field(default=H200_SMS, compare=False)

    @property
    def rows_per_req(self) -> int:
        return self.q_per_req * self.num_heads

    @property
    def m_tiles(self) -> int:
        return -(-self.rows_per_req // self.config.block_m)

    @property
    def grid(self) -> tuple[int, int, int]:
        # m-tiles vary fastest so the programs that share a request's KV chunk run side by side
        # and the repeats of a chunk come from L2
        return (self.m_tiles * self.config.dv_split, self.num_splits, self.capacity)

    @property
    def scratch_out_shape(self) -> tuple[int, ...]:
        """fp32 partial outputs [capacity·rows_per_req, splits, d_v]; empty without split-K."""
        if self.num_splits == 1:
            return (0, 1, self.d_v)
        return (self.capacity * self.rows_per_req, self.num_splits, self.d_v)

    @property
    def scratch_lse_shape(self) -> tuple[int, ...]:
        return self.scratch_out_shape[:2]

    @property
    def scratch_bytes(self) -> int:
        n = math.prod(self.scratch_out_shape)
        return 4 * (n + n // self.d_v)


def kernel_config(rows_per_req: int, d_v: int, kv_fp8: bool = False,
                  capacity: int | None = None) -> KernelConfig:
    """Tile shape for a head layout; the tile's M folds rows × heads of one request.

    d_v = 512 (K3), from the H200 sweeps in benchmarks/results/mla_verify_notes.md: 64-token
    steps on two warpgroups win once the grid has work for the whole GPU; a small grid (a few
    requests) does better with the value columns split over program pairs of one warpgroup each (twice the
    programs, no softmax exchange between warpgroups), up to 1.8x at short contexts."""
    block_m = min(64, max(16, 1 << (rows_per_req - 1).bit_length()))
    if d_v >= 512:
        m_tiles = -(-rows_per_req // block_m)
        if capacity is not None and capacity * m_tiles <= SMALL_GRID:
            return KernelConfig(block_m, 32, 4, 3, dv_split=2)
        # a 64×512 fp32 accumulator needs two warpgroups; q plus two 64-token KV stages fill
        # the 227 KB of shared memory
        return KernelConfig(block_m, 64, 8, 2)
    if d_v >= 256:
        return KernelConfig(block_m, 32, 8, 2)
    return KernelConfig(block_m, 64, 4, 2)


def choose_splits(programs: int, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Smallest split count whose grid fills the machine's waves to >= 85%; else the best fill."""
    best, best_eff = 1, 0.0
    for s in range(1, max_splits + 1):
        p = programs * s
        eff = p / (math.ceil(p / num_sms) * num_sms)
        if eff >= 0.85:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def make_plan(capacity: int, q_per_req: int, num_heads: int, d_qk: int, d_v: int, *,
              kv_fp8: bool = False, num_sms: int = H200_SMS,
              config: KernelConfig | None = None, num_splits: int | None = None) -> VerifyPlan:
    cfg = config or kernel_config(q_per_req * num_heads, d_v, kv_fp8, capacity)
    m_tiles = -(-q_per_req * num_heads // cfg.block_m)
    splits = num_splits or choose_splits(capacity * m_tiles * cfg.dv_split, num_sms)
    return VerifyPlan(capacity, q_per_req, num_heads, d_qk, d_v, cfg, splits,
                      min_split_tokens=4 * cfg.block_n, num_sms=num_sms)


def make_plans(max_batch: int, q_per_req: int, num_heads: int, d_qk: int, d_v: int,
               **kw) -> list[VerifyPlan]:
    return [make_plan(c, q_per_req, num_heads, d_qk, d_v, **kw) for c in power_of_two_capacities(max_batch)]


def pick_plan(plans: list[VerifyPlan], live: int) -> VerifyPlan:
    """The smallest plan covering `live` requests."""
    for plan in sorted(plans, key=lambda p: p.capacity):
        if plan.capacity >= live:
            return plan
    largest = max((p.capacity for p in plans), default=0)
    raise ValueError(f"{live} live requests exceed the largest verification plan ({largest}); "
                     "split the step or queue requests")


def split_scratch(rows: int, splits: int, d_v: int, device: torch.device,
                  poison: bool = False, o_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials of the MLA kernels: out [rows, splits, d_v] (fp32 for Triton; bf16, or fp16
    with an fp8 cache, for the SM90 CUDA kernel) and lse [rows, splits] fp32. `poison` fills them
    with NaN (tests: no unwritten partial may be read)."""
    alloc = torch.full if poison else torch.empty
    fill = (float("nan"),) if poison else ()
    return (alloc((rows, splits, d_v), *fill, dtype=o_dtype, device=device),
            alloc((rows, splits), *fill, dtype=torch.float32, device=device))
