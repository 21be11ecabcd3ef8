"""A multi-rank torch engine dir: one ``rank{r}/`` per rank, each holding only that rank's slices
of the weights (model/rank_checkpoint.py) beside a copy of the checkpoint's config.json, and the
parallel layout in config.json (engine/engine_dir.py).

The layout is checked against the model (heads, experts, KDA heads, widths: the error names the
option and the config field) before anything is read or written. Ranks whose weights are the same
(equal TP and EP ranks: DCP splits the cache, not the weights) share their files as hard links
inside the engine dir, so a TP8 x DCP8 engine does not store eight copies of what a DCP-only
layout replicates.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from k3trt.builder.backends import BuildError, check_disk
from k3trt.config import ModelConfig
from k3trt.engine.writer import copy_owned
from k3trt.model.checkpoint_io import INDEX_NAME, CheckpointReader
from k3trt.model.layout import checkpoint_prefix
from k3trt.model.rank_checkpoint import SHARD_KEY, shard_marker, write_rank_checkpoint
from k3trt.parallel.config import ParallelConfig, ParallelConfigError

log = logging.getLogger(__name__)

OPTIONS = {"tp": "--tp", "dcp": "--dcp", "ep": "--ep"}


def check_layout(cfg: ModelConfig, pc: ParallelConfig, backend: str, block_size: int) -> None:
    """Refuse a layout the backend or the model cannot run, naming the option and the field."""
    if pc.world_size == 1:
        return
    if block_size % pc.dcp_interleave:
        raise BuildError(f"--dcp-interleave {pc.dcp_interleave} does not divide --block-size {block_size}: each "
                         "rank's cache page holds whole runs of interleaved tokens; pick an interleave that divides it")
    if backend != "torch":
        raise BuildError(f"--backend {backend} builds single-rank engines (its engines have no collectives yet: "
                         f"tensor parallelism needs an all-reduce plugin over NCCL); build the {pc.world_size}-rank "
                         "engine with --backend torch, or this backend without --tp/--dcp/--ep")
    try:
        pc.validate(cfg, prefix="text_config." if checkpoint_prefix(cfg) else "")
    except ParallelConfigError as e:
        group = next(g for g in OPTIONS if f"ParallelConfig.{g}=" in str(e))
        raise BuildError(f"{OPTIONS[group]}: {e}") from None


def weight_key(pc: ParallelConfig) -> tuple[int, int]:
    """Ranks with the same key hold the same weights."""
    return pc.tp_rank, pc.ep_rank


def check_split_disk(checkpoint: Path, output: Path, pc: ParallelConfig) -> None:
    """Room for the rank dirs: about one copy of the weights per distinct EP slice (routed experts
    dominate a K3 checkpoint and are split by EP only), times the distinct weight sets."""
    size = sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file())
    distinct = len({weight_key(pc.with_rank(r)) for r in range(pc.world_size)})
    check_disk(output, int(size * 1.05 * distinct / pc.ep))


def write_ranks(checkpoint: Path, tmp: Path, cfg: ModelConfig, pc: ParallelConfig) -> None:
    """rank0/ .. rank{world-1}/ under `tmp` (an engine dir being written)."""
    with CheckpointReader(checkpoint) as reader:      # the source's shard size for the ranks' shards
        shard_bytes = max((checkpoint / s).stat().st_size for s in reader.shards)
    written: dict[tuple[int, int], Path] = {}
    for r in range(pc.world_size):
        rp, out = pc.with_rank(r), tmp / f"rank{r}"
        same = written.get(weight_key(rp))
        if same is not None:
            log.info("rank %d/%d: the weights of %s (same TP and EP rank): hard links", r + 1, pc.world_size,
                     same.name)
            out.mkdir()
            for f in sorted(same.iterdir()):
                os.link(f, out / f.name)
            _remark(out, rp)
            continue
        log.info("rank %d/%d: writing its slices (tp rank %d, ep rank %d)", r + 1, pc.world_size, rp.tp_rank,
                 rp.ep_rank)
        write_rank_checkpoint(checkpoint, out, cfg, rp, max_shard_bytes=shard_bytes)
        copy_owned(checkpoint / "config.json", out / "config.json")
        written[weight_key(rp)] = out


def _remark(rank_dir: Path, pc: ParallelConfig) -> None:
    """A linked rank dir's own index: the same tensors, its own rank in the marker (the index is
    a file of its own, not a link)."""
    index = rank_dir / INDEX_NAME
    doc = json.loads(index.read_text())
    index.unlink()
    doc["metadata"][SHARD_KEY] = shard_marker(pc)
    index.write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")
