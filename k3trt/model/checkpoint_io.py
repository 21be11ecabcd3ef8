"""Safetensors checkpoint I/O in the Hugging Face layout: the format's names and header parser, and
a validating, memory-mapped reader that tracks which tensors were consumed (the byte-deterministic
sharded writer is checkpoint_write.py).

On-disk layout (both sides):
  DIR/model-00001-of-0000N.safetensors ...   shards, filled in the caller's order
  DIR/model.safetensors.index.json           {"metadata": {"total_size": bytes, ...},
                                              "weight_map": {tensor name: shard file name}}
or, read only, a single DIR/model.safetensors without an index.

A safetensors file is: 8-byte little-endian u64 N, then N bytes of UTF-8 JSON
{"__metadata__": {str: str}, name: {"dtype": "BF16", "shape": [...], "data_offsets": [b, e]}},
then the data region; offsets are relative to the data region, which the tensors must tile
exactly (no gaps, no overlap, nothing after the last one).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_MAX_HEADER_BYTES = 100 << 20      # safetensors' own limit; a larger length means garbage
_LARGE_CHECKPOINT = 1 << 30        # above this, shard progress is logged at INFO

# safetensors dtype string <-> torch dtype (the subset safetensors' torch loader accepts).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "U16": torch.uint16,
    "I16": torch.int16, "U32": torch.uint32, "I32": torch.int32, "U64": torch.uint64,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory or safetensors file that is missing, corrupt or inconsistent."""


class MissingTensorError(KeyError):
    """A tensor the caller asked for is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all
        return str(self.args[0])


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives; known from the headers alone, without reading data."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: str
    nbytes: int


def shard_name(i: int, n: int) -> str:
    """The Hugging Face shard file name, 1-based: model-00001-of-00003.safetensors."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


# --------------------------------------------------------------------------- header parsing
def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header without touching the data. Returns
    ({name: TensorInfo}, __metadata__). Raises CheckpointError naming the file and the fault,
    because safetensors' own errors ("MetadataIncompleteBuffer") do not say which file."""
    path = Path(path)
    size = path.stat().st_size

    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"{path}: corrupt safetensors file: {msg}")

    if size < 8:
        raise bad(f"truncated: {size} bytes, fewer than the 8-byte header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER_BYTES or n > size - 8:
            raise bad(f"header length {n} does not fit a {size}-byte file "
                      "(truncated, or not a safetensors file)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not valid UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise bad("__metadata__ is not an object")
    data_len = size - 8 - n
    infos: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, ent in header.items():
        if not isinstance(ent, dict) or not {"dtype", "shape", "data_offsets"} <= ent.keys():
            raise bad(f"entry {name!r} lacks dtype/shape/data_offsets")
        dtype = DTYPES.get(ent["dtype"])
        if dtype is None:
            raise bad(f"tensor {name!r} has unsupported dtype {ent['dtype']!r}")
        shape, offs = ent["shape"], ent["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r} has invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise bad(f"tensor {name!r} has invalid data_offsets {offs!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if offs[1] - offs[0] != nbytes:
            raise bad(f"tensor {name!r}: data_offsets {offs} span {offs[1] - offs[0]} bytes, "
                      f"but {ent['dtype']}{shape} needs {nbytes}")
        if offs[1] > data_len:
            raise bad(f"tensor {name!r}: data_offsets {offs} run past the end of the file "
                      f"(data region is {data_len} bytes; file truncated?)")
        infos[name] = TensorInfo(name, dtype, tuple(shape), path.name, nbytes)
        spans.append((offs[0], offs[1], name))
    # The tensors must tile the data region exactly, as safetensors itself requires.
    pos = 0
    for begin, end, name in sorted(spans):
        if begin != pos:
            raise bad(f"tensor {name!r} starts at {begin}, expected {pos} "
                      "(overlapping or non-contiguous data)")
        pos = end
    if pos != data_len:
        raise bad(f"{data_len - pos} trailing bytes after the last tensor")
    return infos, {str(k): str(v) for k, v in meta.items()}


# --------------------------------------------------------------------------- reader
class CheckpointReader:
    """A validated, memory-mapped view of a safetensors checkpoint directory.

    Every header is parsed and checked when the reader opens (missing shard, a weight_map entry
    absent from its shard, corrupt or truncated files), so errors surface before any loading.
    Data is read lazily through safetensors' mmap; `get` marks a tensor consumed, so a strict
    loader can ask `unconsumed()` at the end.
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        self.dir = p if p.is_dir() else p.parent
        self.metadata: dict = {}
        self._infos: dict[str, TensorInfo] = {}
        self._handles: dict[str, object] = {}
        self._consumed: set[str] = set()
        self._stored: dict[str, str] = {}       # name presented -> name in the file (alias_prefixes)
        self._closed = False
        if p.is_file():
            shards = [p.name]
            self._load_single(p)
        elif (p / INDEX_NAME).is_file():
            shards = self._load_indexed(p / INDEX_NAME)
        elif (p / SINGLE_NAME).is_file():
            shards = [SINGLE_NAME]
            self._load_single(p / SINGLE_NAME)
        else:
            raise CheckpointError(f"{p}: no {INDEX_NAME} or {SINGLE_NAME} found "
                                  "(not a Hugging Face safetensors checkpoint)")
        self.shards: tuple[str, ...] = tuple(shards)
        self._order = sorted(self._infos)
        total = sum(i.nbytes for i in self._infos.values())
        self._progress_level = logging.INFO if total >= _LARGE_CHECKPOINT else logging.DEBUG
        log.info("checkpoint %s: %d tensors, %.1f MB in %d shard(s)",
                 self.dir, len(self._infos), total / 1e6, len(self.shards))

    def _load_single(self, path: Path) -> None:
        self._infos, _ = read_safetensors_header(path)

    def _load_indexed(self, index_path: Path) -> list[str]:
        try:
            index = json.loads(index_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index_path}: unreadable index ({e})") from None
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index_path}: no 'weight_map' of tensor name -> shard file")
        self.metadata = dict(index.get("metadata") or {})
        by_shard: dict[str, list[str]] = {}
        for name, shard in wmap.items():
            by_shard.setdefault(shard, []).append(name)
        shards = sorted(by_shard)
        for k, shard in enumerate(shards, 1):
            path = self.dir / shard
            if Path(shard).name != shard:
                raise CheckpointError(f"{index_path}: shard {shard!r} is not a plain file name")
            if not path.is_file():
                raise CheckpointError(f"{index_path}: shard file {path} is missing "
                                      f"(it should hold {len(by_shard[shard])} tensors, "
                                      f"e.g. {by_shard[shard][0]!r})")
            log.debug("validating shard %d/%d %s", k, len(shards), shard)
            infos, _ = read_safetensors_header(path)
            absent = [n for n in by_shard[shard] if n not in infos]
            if absent:
                raise CheckpointError(f"{index_path}: tensor {absent[0]!r} is mapped to {path} "
                                      f"but that shard does not contain it "
                                      f"({len(absent)} such tensor(s))")
            unlisted = sorted(set(infos) - set(by_shard[shard]))
            if unlisted:
                raise CheckpointError(f"{path}: holds tensor {unlisted[0]!r} that {INDEX_NAME} "
                                      f"does not list ({len(unlisted)} such tensor(s))")
            self._infos.update(infos)
        return shards

    @property
    def path(self) -> Path:
        """The checkpoint directory (alias of `dir`)."""
        return self.dir

    # -- queries that never read data
    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return list(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            hint = difflib.get_close_matches(name, self._order, n=3)
            raise MissingTensorError(
                f"tensor {name!r} is not in checkpoint {self.dir}"
                + (f"; close names: {', '.join(hint)}" if hint else "")) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self.info(name).dtype

    # -- data
    def _handle(self, shard: str):
        if self._closed:
            raise RuntimeError(f"CheckpointReader for {self.dir} is closed")
        h = self._handles.get(shard)
        if h is None:
            k = self.shards.index(shard) + 1
            log.log(self._progress_level, "loading shard %d/%d %s", k, len(self.shards), shard)
            h = self._handles[shard] = safe_open(str(self.dir / shard), framework="pt")
        return h

    def get(self, name: str) -> torch.Tensor:
        """The tensor (a view of the memory-mapped file; copy it before writing to it).
        Marks it consumed."""
        info = self.info(name)
        t = self._handle(info.shard).get_tensor(self._stored.get(name, name))
        self._consumed.add(name)
        return t

    def alias_prefixes(self, aliases: Iterable[tuple[str, str]]) -> int:
        """Present every tensor stored under prefix `old` as `new` + the rest, for each (old, new)
        of `aliases` (one checkpoint family's spellings of the same tensors); returns how many
        names changed. A name that would collide with a stored one is an error."""
        renamed = 0
        for old, new in aliases:
            for name in [n for n in self._order if n.startswith(old)]:
                canon = new + name[len(old):]
                if canon in self._infos:
                    raise CheckpointError(f"{self.dir}: holds both {name!r} and {canon!r} (the same tensor)")
                info = self._infos.pop(name)
                self._infos[canon] = TensorInfo(canon, info.dtype, info.shape, info.shard, info.nbytes)
                self._stored[canon] = self._stored.pop(name, name)
                renamed += 1
        self._order = sorted(self._infos)
        return renamed

    def unconsumed(self) -> list[str]:
        """Names not yet returned by `get` nor skipped, sorted."""
        return [n for n in self._order if n not in self._consumed]

    def skip_prefixes(self, prefixes: Iterable[str]) -> list[str]:
        """Mark every tensor whose name starts with one of `prefixes` as consumed without
        reading it (for parts of a checkpoint a model does not use), log what was
        skipped, and return those names. Prefixes match literally: end them with '.'."""
        if isinstance(prefixes, str):
            raise TypeError(f"skip_prefixes wants a list of prefixes, got the string {prefixes!r}")
        prefixes = tuple(prefixes)
        if not all(isinstance(p, str) and p for p in prefixes):
            raise TypeError(f"skip_prefixes wants non-empty strings, got {prefixes!r}")
        skipped = [n for n in self._order if n.startswith(prefixes)]
        self._consumed.update(skipped)
        counts = {p: sum(n.startswith(p) for n in skipped) for p in prefixes}
        mb = sum(self._infos[n].nbytes for n in skipped) / 1e6
        log.info("skipped %d tensors (%.1f MB) of %s by prefix: %s", len(skipped), mb, self.dir,
                 ", ".join(f"{p}* ({c})" for p, c in counts.items()))
        return skipped

    # -- lifetime
    def close(self) -> None:
        """Drop the memory maps held by the reader. Tensors already returned stay valid."""
        self._handles.clear()
        self._closed = True

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.dir)!r}, {len(self)} tensors, {len(self.shards)} shards)"
