"""One rank's slice of a checkpoint, written as a checkpoint of its own: the ``rank{r}/`` of a
multi-rank engine dir. The sharding table (parallel/shard.py) is applied once, at build time, so
that at run time a rank opens and reads only its own bytes.

The rank dir's index carries the marker ``metadata["k3trt_shard"] = {"tp", "dcp", "ep",
"dcp_interleave", "rank"}``; the loader (model/weights.py) then reads every tensor as it is (local
shapes, this rank's routed experts under their global numbers) instead of cutting it again, and
refuses a model built for another shard.

Per checkpoint tensor:
  replicated            copied as stored (any format)
  routed experts (ep)   this rank's experts copied as stored (mxfp4 stays mxfp4); the others dropped
  split (tp)            plain: the slice, in its dtype. fp8 blocks / mxfp4 groups: the slice of the
                        stored tensors when its bounds fall on block / group boundaries (decoding the
                        slice then equals slicing the decode); otherwise the decoded slice in fp32,
                        which is what the loader computes before casting to the model dtype.
The vision tower and projector are replicated (every rank runs the whole encoder). Dropped: the MTP
layers' copies of the embedding and lm_head (layout.COPIES), which the loader does not read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from k3trt.config import ModelConfig
from k3trt.model.checkpoint_check import linear_like, open_checkpoint, pick_name
from k3trt.model.checkpoint_io import CheckpointReader
from k3trt.model.checkpoint_write import write_checkpoint
from k3trt.model.k3 import K3ForCausalLM
from k3trt.model.layout import Source, source, tensor_prefix
from k3trt.model.quant import (FP8_BLOCK, MXFP4_GROUP, WEIGHT_SUFFIXES, WeightFormat, inspect_linear_weight,
                               read_linear_weight)
from k3trt.parallel.config import ParallelConfig
from k3trt.parallel.shard import Part, param_part

log = logging.getLogger(__name__)

SHARD_KEY = "k3trt_shard"
_FIELDS = ("tp", "dcp", "ep", "dcp_interleave", "rank")


def shard_marker(pc: ParallelConfig) -> dict[str, int]:
    return {f: getattr(pc, f) for f in _FIELDS}


def read_marker(reader: CheckpointReader) -> ParallelConfig | None:
    """The shard a rank dir holds, from its index's metadata; None for a whole checkpoint."""
    doc = reader.metadata.get(SHARD_KEY)
    if doc is None:
        return None
    try:
        return ParallelConfig(**{f: int(doc[f]) for f in _FIELDS})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{reader.path}: malformed {SHARD_KEY} marker {doc!r} in its index ({e}); rebuild the "
                         "engine dir") from None


def _stored(reader: CheckpointReader, name: str) -> list[str]:
    """The checkpoint tensors that hold `name` as stored (a linear weight: every tensor of its format)."""
    names = [name] if name in reader else []
    if name.endswith(".weight"):
        module = name.removesuffix(".weight")
        names += [n for n in (f"{module}.{s}" for s in WEIGHT_SUFFIXES) if n != name and n in reader]
    return names


def _aligned(r: range, block: int, full: int) -> bool:
    return r.start % block == 0 and (len(r) % block == 0 or r.stop == full)


def _narrow_blocks(t: torch.Tensor, dim: int, r: range, block: int) -> torch.Tensor:
    start = r.start // block
    return t.narrow(dim, start, -(-r.stop // block) - start)


def slice_linear(reader: CheckpointReader, module: str, part: Part) -> dict[str, torch.Tensor]:
    """Rank `part` of linear weight `module` in its stored format where the cut falls on the
    format's blocks, else decoded to fp32 (module doc)."""
    fmt, shape, suffixes = inspect_linear_weight(reader, module)
    r, d = part.range(shape[part.dim]), part.dim
    t = {s: reader.get(f"{module}.{s}") for s in suffixes}
    if fmt is WeightFormat.PLAIN:
        return {f"{module}.weight": t["weight"].narrow(d, r.start, len(r))}
    if fmt is WeightFormat.FP8_BLOCK and _aligned(r, FP8_BLOCK[d], shape[d]):
        return {f"{module}.weight": t["weight"].narrow(d, r.start, len(r)),
                f"{module}.weight_scale_inv": _narrow_blocks(t["weight_scale_inv"], d, r, FP8_BLOCK[d])}
    if fmt is WeightFormat.MXFP4 and (d == 0 or _aligned(r, MXFP4_GROUP, shape[1])):
        out = {f"{module}.weight_packed": (t["weight_packed"].narrow(0, r.start, len(r)) if d == 0 else
                                           _narrow_blocks(t["weight_packed"], 1, r, 2)),
               f"{module}.weight_scale": (t["weight_scale"].narrow(0, r.start, len(r)) if d == 0 else
                                          _narrow_blocks(t["weight_scale"], 1, r, MXFP4_GROUP))}
        if "weight_shape" in t:
            local = [len(r), shape[1]] if d == 0 else [shape[0], len(r)]
            out[f"{module}.weight_shape"] = torch.tensor(local, dtype=t["weight_shape"].dtype)
        return out
    full = read_linear_weight(reader, module).dequantize(torch.float32)
    return {f"{module}.weight": full.narrow(d, r.start, len(r))}


def _slice_other(reader: CheckpointReader, name: str, part: Part, src: Source, full: tuple[int, ...]
                 ) -> dict[str, torch.Tensor]:
    """Rank `part` of a non-linear tensor (A_log, dt_bias, conv weights), in the form it is stored."""
    t = reader.get(name)
    stored = tuple(t.shape) != full
    local = part.take(t.reshape(full) if stored else t)
    return {name: local.reshape(src.stored_shape(tuple(local.shape))) if stored else local}


def rank_tensors(reader: CheckpointReader, cfg: ModelConfig, pc: ParallelConfig) -> dict[str, torch.Tensor]:
    """Every tensor rank `pc.rank`'s checkpoint holds, by checkpoint name (views of `reader`'s
    memory maps where nothing had to be decoded)."""
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)               # whole shapes: the cuts are taken from them
    out: dict[str, torch.Tensor] = {}
    for pname, p in model.named_parameters():
        src, part = source(pname, cfg), param_part(pname, pc)
        prefix = tensor_prefix(src, cfg)
        if src.combine == "stack":
            names = [src.names[e] for e in (part.range(len(src.names)) if part.dim == 0 else range(len(src.names)))]
        elif src.combine == "cat":
            names = list(src.names)              # fused latent projections: replicated (shard.py)
        else:
            names = [pick_name(reader, [prefix + n for n in (*src.names, *src.also)]).removeprefix(prefix)]
        for n in names:
            name = prefix + n
            if part.dim is None or src.combine == "stack":
                out.update({s: reader.get(s) for s in _stored(reader, name)})
            elif linear_like(name, p.shape):
                out.update(slice_linear(reader, name.removesuffix(".weight"), part))
            else:
                out.update(_slice_other(reader, name, part, src, tuple(p.shape)))
    return out


def write_rank_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, cfg: ModelConfig, pc: ParallelConfig, *,
                          max_shard_bytes: int) -> list[Path]:
    """Write rank `pc.rank`'s checkpoint (shards + index with the marker) into `out_dir`; the
    caller copies config.json beside it."""
    with open_checkpoint(ckpt_dir, cfg) as reader:
        tensors = rank_tensors(reader, cfg, pc)
        log.info("rank %d of %d: %d tensors, %.1f MiB", pc.rank, pc.world_size, len(tensors),
                 sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20)
        return write_checkpoint(out_dir, tensors, max_shard_bytes=max_shard_bytes,
                                metadata={SHARD_KEY: shard_marker(pc)})
