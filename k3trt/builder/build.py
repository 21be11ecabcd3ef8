"""``build_engine``: a checkpoint in, an engine directory out.

torch            the "engine" is the checkpoint itself (config + safetensors shards, hard-linked when
                 the filesystem allows, else copied) under rank0/, loaded at run time by the one
                 strict loader (k3trt.model.loader), plus the build options and capacity plan.
tensorrt(-rtx)   rank0/ holds one ONNX graph and one engine per capacity and the shared weights
                 (builder/tensorrt.py); every check that can fail runs before the long work.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch

from k3trt.builder.capacities import Capacities
from k3trt.builder.engine_dir import DTYPES, BuildConfig, write_engine_dir
from k3trt.config import ModelConfig
from k3trt.model.checkpoint_io import INDEX_NAME, SHARD_RE, SINGLE_NAME, CheckpointReader

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 32
BACKENDS = ("torch", "tensorrt", "tensorrt-rtx")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "generation_config.json",
                   "special_tokens_map.json")
WEIGHT_FILES = (INDEX_NAME, SINGLE_NAME, "config.json")


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"build option dtype={dtype}: choose one of {sorted(DTYPES)}")
        return names[dtype]
    return dtype


def build_engine(checkpoint: str | Path, output: str | Path, *, backend: str = "torch",
                 capacities: Sequence[int] | None = None, max_num_tokens: int = 8192, spec_tokens: int = 3,
                 kv_dtype: str = "auto", dtype: str | torch.dtype = "bf16", block_size: int = 64,
                 max_seq_len: int | None = None, target: str | None = None, check_onnx: bool = False) -> Path:
    """Build an engine dir. `capacities`: verify batch capacities (default: powers of two up to 32,
    the largest being the live-request limit); prefill token capacities are the powers of two up
    to max_num_tokens (builder/capacities.py)."""
    checkpoint, output = Path(checkpoint), Path(output)
    if backend == "auto":
        from k3trt.builder.tensorrt import installed_backends
        backend = "tensorrt" if "tensorrt" in installed_backends() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    cfg = ModelConfig.from_json(checkpoint)
    model_raw = json.loads((checkpoint / "config.json").read_text())
    build = BuildConfig(dtype=_dtype_name(dtype), kv_dtype=kv_dtype, block_size=block_size,
                        max_num_tokens=max_num_tokens,
                        max_seq_len=min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings))
    caps = Capacities.plan(max_batch=DEFAULT_MAX_BATCH, max_num_tokens=max_num_tokens, spec_tokens=spec_tokens,
                           verify=capacities or None)
    if backend != "torch":
        return _build_trt(checkpoint, output, backend=backend, target=target, model_raw=model_raw,
                          build=build, caps=caps, check_onnx=check_onnx)
    with CheckpointReader(checkpoint) as reader:     # headers and index only: cheap, catches broken shards
        weights = set(reader.shards)
    log.info("building torch engine from %s: %d weight files, verify capacities %s, prefill capacities %s",
             checkpoint, len(weights), list(caps.verify), list(caps.prefill))

    def populate(tmp: Path) -> None:
        (tmp / "rank0").mkdir()
        (tmp / "tokenizer").mkdir()
        for f in sorted(p for p in checkpoint.iterdir() if p.is_file()):
            is_weight = f.name in WEIGHT_FILES or SHARD_RE.fullmatch(f.name)
            if is_weight and f.name.endswith(".safetensors") and f.name not in weights:
                continue             # a stray shard the index does not name
            _link_or_copy(f, tmp / ("rank0" if is_weight else "tokenizer") / f.name)

    return write_engine_dir(output, backend=backend, target=target, model_raw=model_raw, build=build,
                            capacities=caps, populate=populate)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        log.info("copying %s (%.1f MiB)", src.name, src.stat().st_size / 2**20)
        shutil.copy2(src, dst)


def _build_trt(checkpoint: Path, output: Path, *, backend: str, target: str | None, model_raw: dict,
               build: BuildConfig, caps: Capacities, check_onnx: bool) -> Path:
    """One ONNX graph + engine per capacity under rank0/ (see builder/tensorrt.py)."""
    from k3trt.builder import tensorrt as trt
    from k3trt.model.loader import load_model

    cfg = trt.preflight(checkpoint, output, backend=backend, target=target, capacities=caps, dtype=build.dtype)
    if check_onnx and build.dtype != "fp32":
        raise ValueError("--check-onnx compares with onnxruntime in fp32: build with --dtype fp32")
    target = trt.check_target(backend, target)
    reports = []

    def populate(tmp: Path) -> None:
        _, model = load_model(checkpoint, dtype=build.torch_dtype)
        reports.extend(trt.build_rank(model, cfg, caps, tmp / "rank0", backend=backend, block_size=build.block_size,
                                      max_seq_len=build.max_seq_len, kv_dtype=build.kv_torch_dtype,
                                      kv_scale=build.kv_scale, check=check_onnx,
                                      options=trt.BuildOptions(target=target)))
        (tmp / "tokenizer").mkdir()
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                _link_or_copy(checkpoint / name, tmp / "tokenizer" / name)

    path = write_engine_dir(output, backend=backend, target=target, model_raw=model_raw, build=build,
                            capacities=caps, populate=populate)
    rows = [f"{'engine':<16}{'MiB':>9}{'seconds':>9}"] + [
        f"{r.name:<16}{r.bytes / 2**20:>9.1f}{r.seconds:>9.1f}" for r in reports]
    log.info("built %d %s engines (target %s):\n%s", len(reports), backend, target, "\n".join(rows))
    return path
