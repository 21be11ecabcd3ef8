"""The engine directory: everything the runtime needs, described by one versioned config.json.

    ENGINE_DIR/config.json   {"format_version": 1, "k3trt_version", "backend", "target",
                              "model": the checkpoint's config.json (as read),
                              "build": BuildConfig, "capacities": builder.capacities.Capacities,
                              "files": {relative path: sha256 hex}}
    ENGINE_DIR/rank0/        backend files (torch: the checkpoint's config + safetensors shards)
    ENGINE_DIR/tokenizer/    tokenizer files + chat template (optional)

A directory is written under a temporary name beside the target and renamed into place, so a
crashed build never leaves something that looks finished. Reading checks the format version, the
backend and every listed file's checksum, and refuses with a message that says what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import k3trt
from k3trt.builder.capacities import Capacities
from k3trt.config import ModelConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
BACKENDS = ("torch", "tensorrt", "tensorrt-rtx")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_DTYPES = ("auto", "bf16", "fp8")
_REBUILD = "rebuild it with `k3trt build CHECKPOINT --output DIR`"


class EngineDirError(ValueError):
    """An engine directory this runtime cannot use; the message says what to do."""


@dataclass(frozen=True)
class BuildConfig:
    dtype: str = "bf16"            # weights and activations: fp32 | bf16 | fp16
    kv_dtype: str = "auto"         # MLA cache: auto (= dtype) | bf16 | fp8 (e4m3, per-tensor kv_scale)
    kv_scale: float = 1.0
    block_size: int = 64
    max_num_tokens: int = 8192     # tokens per step: prefill chunk + verify rows
    max_seq_len: int = 8192        # prompt + output per request

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"build option {name}={getattr(self, name)!r}: {msg}")

        need(self.dtype in DTYPES, "dtype", f"choose one of {sorted(DTYPES)}")
        need(self.kv_dtype in KV_DTYPES, "kv_dtype", f"choose one of {KV_DTYPES}")
        # the fused MLA op reads an unquantised cache in the query's dtype
        need(self.kv_dtype != "bf16" or self.dtype == "bf16", "kv_dtype",
             f"a bf16 cache needs dtype bf16 (dtype is {self.dtype}); use kv_dtype auto or fp8")
        need(self.kv_scale > 0, "kv_scale", "must be > 0")
        need(self.block_size > 0 and self.block_size % 16 == 0, "block_size", "must be a positive multiple of 16")
        need(self.max_num_tokens > 0, "max_num_tokens", "must be > 0")
        need(self.max_seq_len > 1, "max_seq_len", "must be > 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_dtype == "fp8" else self.torch_dtype


@dataclass(frozen=True)
class EngineDir:
    path: Path
    backend: str
    target: str | None
    model: ModelConfig
    model_raw: dict[str, Any]      # the checkpoint's config.json, kept verbatim
    build: BuildConfig
    capacities: Capacities
    files: dict[str, str]
    k3trt_version: str

    @property
    def rank_dir(self) -> Path:
        return self.path / "rank0"

    @property
    def tokenizer_dir(self) -> Path | None:
        d = self.path / "tokenizer"
        return d if d.is_dir() else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_engine_dir(output: str | Path, *, backend: str, target: str | None, model_raw: dict[str, Any],
                     build: BuildConfig, capacities: Capacities, populate: Callable[[Path], None]) -> Path:
    """`populate(tmp)` puts the backend and tokenizer files under tmp; then every file is hashed,
    config.json written, and tmp renamed to `output` (which must not exist or be empty)."""
    output = Path(output)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {BACKENDS}")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"{output} exists and is not empty; choose a new --output directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        populate(tmp)
        files = {}
        for p in sorted(q for q in tmp.rglob("*") if q.is_file()):
            rel = p.relative_to(tmp).as_posix()
            log.info("hashing %s (%.1f MiB)", rel, p.stat().st_size / 2**20)
            files[rel] = sha256_file(p)
        config = {"format_version": FORMAT_VERSION, "k3trt_version": k3trt.__version__, "backend": backend,
                  "target": target, "model": model_raw, "build": dataclasses.asdict(build),
                  "capacities": capacities.to_dict(),
                  "files": files}
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if output.exists():
            output.rmdir()
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("engine dir written: %s (%s backend, %d files)", output, backend, len(files))
    return output


def read_engine_dir(path: str | Path, *, backend: str | None = None, verify_checksums: bool = True) -> EngineDir:
    """Load and check an engine dir; `backend` is the backend the caller can run (None: any)."""
    path = Path(path)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise EngineDirError(f"{path} is not an engine directory (no {CONFIG_NAME}); {_REBUILD}")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise EngineDirError(f"{cfg_path} is not valid JSON ({e}); {_REBUILD}") from None
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineDirError(
            f"{path} has engine format version {version!r} (written by k3trt {raw.get('k3trt_version', '?')}); "
            f"this k3trt {k3trt.__version__} reads version {FORMAT_VERSION}: {_REBUILD}")
    got = raw.get("backend")
    if got not in BACKENDS:
        raise EngineDirError(f"{path}: unknown backend {got!r}; {_REBUILD}")
    if backend is not None and got != backend:
        raise EngineDirError(f"{path} was built for the {got!r} backend but this runtime runs {backend!r}: "
                             f"rebuild it with `k3trt build CHECKPOINT --output DIR --backend {backend}`")
    try:
        ed = EngineDir(path=path, backend=got, target=raw.get("target"),
                       model=ModelConfig.from_dict(raw["model"]), model_raw=raw["model"],
                       build=BuildConfig(**raw["build"]),
                       capacities=Capacities.from_dict(raw["capacities"]),
                       files=dict(raw["files"]), k3trt_version=raw.get("k3trt_version", "?"))
    except (KeyError, TypeError, ValueError) as e:
        raise EngineDirError(f"{cfg_path} is malformed ({type(e).__name__}: {e}); {_REBUILD}") from None
    for rel, digest in ed.files.items():
        f = path / rel
        if not f.is_file():
            raise EngineDirError(f"{path}: file {rel} listed in {CONFIG_NAME} is missing (incomplete copy?); "
                                 f"copy the whole directory again or {_REBUILD}")
        if verify_checksums:
            log.info("verifying %s (%.1f MiB)", rel, f.stat().st_size / 2**20)
            if sha256_file(f) != digest:
                raise EngineDirError(f"{path}: checksum of {rel} does not match {CONFIG_NAME} (the file was "
                                     f"modified or corrupted); copy it again or {_REBUILD}")
    return ed
