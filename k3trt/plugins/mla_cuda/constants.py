"""The numbers the SM90 MLA kernels and their Python front share, defined once here.

The build writes them to ``mla_constants.h`` (``header()``), which common.cuh includes, so Python
and CUDA cannot disagree: a generated header rather than template parameters because the values
are the kernels' compile-time shapes (tile sizes, shared-memory maps), fixed for every build, and
the launcher's schedule and error codes are plain host code.
"""

from __future__ import annotations

import dataclasses
import os

from ..plans import MAX_SPLITS


@dataclasses.dataclass(frozen=True)
class Constant:
    py: str      # the Python name (this module's attribute)
    c: str       # the C++ name (namespace k3mla)
    value: int
    why: str


TABLE = (
    Constant("PAGE", "kPage", 64, "tokens per cache page = per KV block"),
    Constant("D_QK", "kD", 576, "latent width: 512 value columns | 64 rope"),
    Constant("D_V", "kDV", 512, "value columns"),
    Constant("SWAP_MAX_ROWS", "kSwapMaxRows", 48, "rows a swap CTA takes: its MMA's N"),
    Constant("SWAP_MIN_BATCH", "kSwapMinBatch", 32, "the smallest batch given the swap kernel (schedule.py)"),
    Constant("MIN_SPLIT_BLOCKS", "kMinSplitBlocks", 2, "the split rule: fewest pages a split takes (schedule.py)"),
    Constant("FULL_SPLIT_BLOCKS", "kFullSplitBlocks", 16, "the split rule: pages per split to use all (schedule.py)"),
    Constant("MAX_SPLITS", "kMaxSplits", MAX_SPLITS, "most split-K splits a plan takes (plans.choose_splits)"),
    Constant("SCHEDULE_PAIR", "kSchedulePair", 0, "LaunchArgs::schedule of the pair kernel"),
    Constant("SCHEDULE_SWAP", "kScheduleSwap", 1, "LaunchArgs::schedule of the swap kernel"),
    Constant("ERR_KV_CHUNK", "kErrKvChunk", 1, "timeout: a KV chunk's TMA mbarrier"),
    Constant("ERR_Q_TILE", "kErrQTile", 2, "timeout: the pair kernel's Q tile mbarrier"),
    Constant("ERR_PT_READY", "kErrPtReady", 3, "timeout: swap, a P^T tile's ready mbarrier"),
    Constant("ERR_PT_FREE", "kErrPtFree", 4, "timeout: swap, a P^T tile's free mbarrier"),
    Constant("ERR_MAX_READY", "kErrMaxReady", 6, "timeout: swap, the running max's mbarrier"),
)
_VALUE = {k.py: k.value for k in TABLE}
PAGE, D_QK, D_V = _VALUE["PAGE"], _VALUE["D_QK"], _VALUE["D_V"]
SWAP_MAX_ROWS = _VALUE["SWAP_MAX_ROWS"]
SWAP_MIN_BATCH, MIN_SPLIT_BLOCKS, FULL_SPLIT_BLOCKS = (_VALUE[k] for k in ("SWAP_MIN_BATCH", "MIN_SPLIT_BLOCKS",
                                                                           "FULL_SPLIT_BLOCKS"))
SCHEDULES = {"pair": _VALUE["SCHEDULE_PAIR"], "swap": _VALUE["SCHEDULE_SWAP"]}
TIMEOUT_NAMES = {k.value: k.why.removeprefix("timeout: ") + " wait timed out"
                 for k in TABLE if k.py.startswith("ERR_")}
HEADER = "mla_constants.h"


def header() -> str:
    lines = ["// Generated from k3trt/plugins/mla_cuda/constants.py at build time; do not edit.",
             "#pragma once", "", "namespace k3mla {"]
    lines += [f"constexpr int {k.c} = {k.value};  // {k.why}" for k in TABLE]
    return "\n".join(lines + ["}  // namespace k3mla", ""])


def write_header(folder: str) -> str:
    """Writes mla_constants.h into folder (only when its text changes, so that a build tool
    tracking the header rebuilds only then); returns the folder."""
    os.makedirs(folder, exist_ok=True)
    path, text = os.path.join(folder, HEADER), header()
    try:
        with open(path) as f:
            if f.read() == text:
                return folder
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return folder
