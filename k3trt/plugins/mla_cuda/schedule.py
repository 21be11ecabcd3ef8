"""Which SM90 MLA kernel a call runs and how its grid splits the KV sequence.

- ``pick_schedule``: the swap kernel for an fp8 cache from batch SWAP_MIN_BATCH when a request fits
  one CTA or fills its CTAs (SWAP_MAX_ROWS rows each), else the pair kernel.
- ``default_splits``: the split-K count that fills the GPU's SMs (plans.choose_splits, one CTA per
  SM).
- the split rule's Python half: how many splits a short request may spread over (``wave_splits``)
  and the page counts MIN_SPLIT_BLOCKS / FULL_SPLIT_BLOCKS; the kernel's half is active_splits /
  split_range in common.cuh.
"""

from __future__ import annotations

import functools

import torch

from ..plans import choose_splits
from .constants import FULL_SPLIT_BLOCKS, MIN_SPLIT_BLOCKS, SWAP_MAX_ROWS, SWAP_MIN_BATCH  # noqa: F401

FP8 = torch.float8_e4m3fn
DEFAULT_SCHEDULE = "pair"
# How a request spreads over the plan's splits (SplitRule in common.cuh): over all of them from
# FULL_SPLIT_BLOCKS pages per split; shorter, over at most as many as keep the grid in one wave of
# CTAs (wave_splits), with at least MIN_SPLIT_BLOCKS pages (one pair) each. Extra waves pay for
# themselves only on long requests: each extra CTA writes 64 KB of partials that the merge reads
# back, so at 48 heads, batch 32 and 1K context four splits take 75 us and one 51 us, and at batch
# 1 the request is spread as far as it goes.
# (MIN_SPLIT_BLOCKS, FULL_SPLIT_BLOCKS and SWAP_MIN_BATCH are in constants.py: plan.h, the rule's
# C++ copy for the TensorRT plugin, reads them from the generated header.)
# The swap kernel has the faster loop but a dearer CTA (batch 1, 1K: 16.1 us against the pair
# kernel's 13.0, each CTA a block or two). At 12 heads, fp8 it takes 3.7-16% off batch 32-128 from
# 2K context and 10% off batch 128 / 1K, but adds 6% at batch 32 / 1K and 16-24% at batch 1,
# whose plans spread a request over 113 CTAs. The choice is per plan (batch capacity), as a CUDA
# graph replays its plan at any length; batch 2-16 is not measured.


def swap_head_group(q_per_req: int, heads: int) -> int:
    """Heads a swap CTA takes: the most that divide `heads` with q_per_req x them <= SWAP_MAX_ROWS
    (0 when q_per_req alone is more). The launcher passes it to the kernel, whose grid has
    heads / this CTAs per request and split."""
    g = min(SWAP_MAX_ROWS // max(q_per_req, 1), heads)
    while g > 1 and heads % g:
        g -= 1
    return g


def pick_schedule(kv_dtype: torch.dtype, q_per_req: int, heads: int, batch: int) -> str:
    """The default kernel for a call: swap for an fp8 cache and a batch of at least SWAP_MIN_BATCH
    whose request fits one CTA or fills its CTAs (SWAP_MAX_ROWS rows each), else pair."""
    rows = q_per_req * swap_head_group(q_per_req, heads)
    if kv_dtype == FP8 and batch >= SWAP_MIN_BATCH and rows > 0 and \
            (rows == q_per_req * heads or rows == SWAP_MAX_ROWS):
        return "swap"
    return DEFAULT_SCHEDULE


@functools.lru_cache(maxsize=16)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tiles(batch: int, q_per_req: int, heads: int, schedule: str = DEFAULT_SCHEDULE) -> int:
    """CTAs per split: the batch's 64-row M tiles of folded Q·H rows, or its head groups (swap)."""
    if schedule == "swap":
        return batch * (heads // max(1, swap_head_group(q_per_req, heads)))
    return batch * -(-q_per_req * heads // 64)


def default_splits(batch: int, q_per_req: int, heads: int, device_index: int = 0,
                   schedule: str = DEFAULT_SCHEDULE) -> int:
    return choose_splits(max(1, tiles(batch, q_per_req, heads, schedule)), sm_count(device_index))


def default_plan(kv_dtype: torch.dtype, batch: int, q_per_req: int, heads: int,
                 device_index: int = 0, schedule: str | None = None) -> tuple[str, int]:
    """(schedule, splits) that mla_verify_cuda takes for a call left to its defaults (schedule None:
    pick_schedule's), for callers that report or pass the split count themselves."""
    schedule = schedule or pick_schedule(kv_dtype, q_per_req, heads, batch)
    return schedule, default_splits(batch, q_per_req, heads, device_index, schedule)


def wave_splits(batch: int, q_per_req: int, heads: int, splits: int, num_sms: int,
                schedule: str = DEFAULT_SCHEDULE) -> int:
    """The most splits (<= splits) whose grid is one wave of CTAs (one CTA per SM)."""
    return max(1, min(splits, num_sms // max(1, tiles(batch, q_per_req, heads, schedule))))
