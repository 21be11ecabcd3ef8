"""The byte-deterministic safetensors writer: Hugging Face shards plus model.safetensors.index.json
(the layout checkpoint_io.py describes and reads)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from k3trt.model.checkpoint_io import DTYPE_NAMES, INDEX_NAME, SHARD_RE, SINGLE_NAME, shard_name

log = logging.getLogger(__name__)

_WRITE_CHUNK = 64 << 20            # copy big tensors to disk in slices, never whole


def _write_file_atomic(path: Path, write) -> None:
    """Write through a temp name that never looks like a shard/index, then rename: an
    interrupted write leaves only a '.partial' file behind."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_tensor_bytes(f, t: torch.Tensor) -> None:
    # Raw little-endian bytes straight from the tensor's memory, in slices, so a huge tensor is
    # never copied whole into a Python bytes object.
    ptr, total = t.data_ptr(), t.numel() * t.element_size()
    for off in range(0, total, _WRITE_CHUNK):
        f.write(ctypes.string_at(ptr + off, min(_WRITE_CHUNK, total - off)))


def _write_shard(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    # Larger itemsizes first (stable, so ties keep the caller's order): with an 8-aligned header
    # every tensor then starts at a multiple of its own itemsize, like safetensors' own writer.
    ordered = sorted(tensors, key=lambda kv: -kv[1].element_size())
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, t in ordered:
        nb = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def write(f):
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in ordered:
            # Moved/compacted one at a time, so GPU or strided inputs never all sit in RAM.
            _write_tensor_bytes(f, t.detach().to("cpu").contiguous())
    _write_file_atomic(path, write)


def _check(name: str, t: torch.Tensor) -> int:
    """Validate one entry before anything is written; returns its byte size."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
    return t.numel() * t.element_size()


def write_checkpoint(out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor], *,
                     max_shard_bytes: int, metadata: dict | None = None) -> list[Path]:
    """Write `tensors` as Hugging Face safetensors shards plus model.safetensors.index.json.

    Shards are filled in the mapping's order; a new shard starts when the next tensor would
    push the current one past `max_shard_bytes` (a tensor larger than that gets a shard of its
    own). The index is {"metadata": {"total_size": <sum of tensor bytes>, **metadata},
    "weight_map": {name: shard}} with sorted keys. Same input, same bytes. Stale shards of an
    earlier write in `out_dir` are removed. Returns the paths written: shards, then the index.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not tensors:
        raise ValueError("write_checkpoint: no tensors to write")
    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; this writer assumes a little-endian host")
    if metadata and "total_size" in metadata:
        raise ValueError("metadata['total_size'] is computed by write_checkpoint")
    json.dumps(metadata or {})  # fail on unserialisable metadata before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Drop an earlier index first: an interrupted rewrite must not leave an old index that
    # points at a mix of old and new shards.
    (out / INDEX_NAME).unlink(missing_ok=True)

    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    fill = total = 0
    for name, t in tensors.items():
        nb = _check(name, t)
        if groups[-1] and fill + nb > max_shard_bytes:
            groups.append([])
            fill = 0
        groups[-1].append((name, t))
        fill += nb
        total += nb

    n = len(groups)
    written, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        path = out / shard_name(i, n)
        _write_shard(path, group)
        written.append(path)
        weight_map.update({name: path.name for name, _ in group})
        log.debug("wrote %s (%d tensors)", path.name, len(group))
    index = {"metadata": {**(metadata or {}), "total_size": total}, "weight_map": weight_map}
    raw = (json.dumps(index, sort_keys=True, indent=2) + "\n").encode()
    _write_file_atomic(out / INDEX_NAME, lambda f: f.write(raw))
    written.append(out / INDEX_NAME)

    keep = {p.name for p in written}
    for stale in sorted(out.iterdir()):
        if stale.name not in keep and (SHARD_RE.fullmatch(stale.name) or stale.name == SINGLE_NAME):
            log.info("removing stale %s from an earlier write", stale)
            stale.unlink()
    log.info("wrote %d tensors (%.1f MB) to %s in %d shard(s)", len(weight_map), total / 1e6, out, n)
    return written
