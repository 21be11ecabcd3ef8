"""``build_engine``: a checkpoint in, an engine directory out.

torch            the "engine" is a copy of the checkpoint (config + safetensors shards; a reflink where
                 the filesystem allows, never a hard link: engine/writer.copy_owned) under rank0/,
                 loaded at run time by the one strict loader (k3trt.model.loader), plus the build
                 options and capacity plan; with `parallel` over several ranks, one rank{r}/ per
                 rank holding only its slices of the weights (builder/split.py).
onnx             rank0/ holds one ONNX graph per capacity (k3trt ops as custom nodes) and the shared
                 weights, the graphs the TensorRT backends build from; run by onnxruntime on the CPU.
tensorrt(-rtx)   rank0/ holds one ONNX graph and one engine per capacity and the shared weights
                 (builder/rank.py); every check that can fail runs before the long work (builder/backends.py).

Rebuilding into an existing engine dir (engine backends): each capacity's files carry a content
key (rank.capacity_key) over everything they are made from: the checkpoint's weight files
(sha256 each; a file whose size and mtime equal the previous build's record is not hashed
again), the k3trt version and a digest of the code that shapes the graphs (CODE_PACKAGES),
the torch/onnx/onnxscript versions, the graph (capacity, rows, block size, table width,
dtypes, kv scale: the build options that matter to it), the backend, its version and target.
Capacities whose key is unchanged and whose files are intact are hard-linked from the previous
engine dir (files the engine made itself, whose old dir is removed once the new one is in place,
so the new dir ends up their only owner), the others built; ``force`` rebuilds everything. ``workers`` > 1 builds capacities in
spawned worker processes (rank.build_rank). The new dir replaces the old one only once
complete (engine/writer.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import k3trt
from k3trt.builder import backends as checks
from k3trt.builder import rank, split
from k3trt.builder.tensorrt import BuildOptions
from k3trt.engine import backends as registry
from k3trt.engine.backends import BACKENDS
from k3trt.engine.build_config import DTYPES, BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.engine.engine_dir import EngineDir, EngineDirError, is_engine_dir, read_engine_dir, sha256_file
from k3trt.engine.vision_io import encoder_specs
from k3trt.engine.writer import check_output, copy_owned, write_engine_dir
from k3trt.model.checkpoint_check import validate_weights
from k3trt.model.checkpoint_io import INDEX_NAME, SHARD_RE, SINGLE_NAME, CheckpointReader
from k3trt.model.footprint import Footprint, footprint, local_device_memory
from k3trt.parallel.config import ParallelConfig
from k3trt.trt_plugin.build import PluginBuildError
from k3trt.trt_plugin.loader import library_for, target_archs

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "generation_config.json",
                   "special_tokens_map.json")
WEIGHT_FILES = (INDEX_NAME, SINGLE_NAME, "config.json")
# the parts of k3trt whose code shapes an exported graph or engine (their digest is in every content key)
CODE_PACKAGES = ("__init__.py", "config.py", "vision_config.py", "engine", "builder", "model", "plugins")


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
                 max_seq_len: int | None = None, target: str | None = None, check_onnx: bool = False,
                 force: bool = False, workers: int = 1, parallel: ParallelConfig | None = None,
                 device_memory_gb: float | None = None, echo: Callable[[str], None] | None = None,
                 rtx_lowering: str = "plugin", encoder_capacities: Sequence[int] | None = None) -> Path:
    """Build an engine dir. `capacities`: verify batch capacities (default: powers of two up to 32,
    the largest being the live-request limit); prefill token capacities are the powers of two up
    to max_num_tokens (engine/capacities.py). `output` may be an existing engine dir: it is
    replaced once the new one is complete, reusing unchanged capacities' engines unless `force`
    (module doc). `workers`: processes building capacities in parallel (engine backends).
    `parallel` (torch backend): the ranks the engine is split over, one rank dir each; checked
    against the model before anything else.
    Before any long work the build reports the model's footprint (parameters, weight bytes per
    device, or per rank of `parallel`; the cache plan) through the log and `echo`, and stops with
    DoesNotFitError when the weights exceed `device_memory_gb` (GiB; default: the visible GPU's memory;
    no GPU, no check). `rtx_lowering`: "plugin" (k3trt ops as plugin layers of the k3trt plugin library) or "native"
    (TensorRT-RTX's fallback: the ops lowered to standard ONNX, prefill capacities <= 64)."""
    checkpoint, output = Path(checkpoint), Path(output)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if backend == "auto":
        backend = "tensorrt" if "tensorrt" in registry.installed_backends() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    cfg = checks.check_checkpoint(checkpoint)          # a K3 config.json and weights, or a message saying why not
    pc = ParallelConfig(parallel.tp, parallel.dcp, parallel.ep, parallel.dcp_interleave) if parallel else ParallelConfig()
    split.check_layout(cfg, pc, backend, block_size)
    validate_weights(checkpoint, cfg)                  # names, shapes, dtypes from the headers, before long work
    model_raw = json.loads((checkpoint / "config.json").read_text())
    build = BuildConfig(dtype=_dtype_name(dtype), kv_dtype=kv_dtype, block_size=block_size,
                        max_num_tokens=max_num_tokens,
                        max_seq_len=min(max_seq_len or cfg.max_position_embeddings, cfg.max_position_embeddings))
    report_footprint(footprint(cfg, dtype=build.torch_dtype, kv_dtype=build.kv_torch_dtype, pc=parallel),
                     device_memory_gb, echo)
    caps = Capacities.plan(max_batch=DEFAULT_MAX_BATCH, max_num_tokens=max_num_tokens, spec_tokens=spec_tokens,
                           verify=capacities or None)
    if encoder_capacities:
        caps = dataclasses.replace(caps, encoder=_encoder_capacities(cfg, backend, encoder_capacities, build))
    if backend != "torch" and caps.prefill[-1] > build.max_seq_len:
        # a prefill graph holds one sequence's chunk: a capacity past max_seq_len could never run (nor export)
        caps = dataclasses.replace(caps, prefill=tuple(t for t in caps.prefill if t <= build.max_seq_len))
        log.info("prefill capacities up to max_seq_len %d: %s", build.max_seq_len, list(caps.prefill))
    check_output(output)
    if backend == "onnx":
        return _build_onnx(checkpoint, output, cfg=cfg, target=target, model_raw=model_raw, build=build, caps=caps,
                           check_onnx=check_onnx, workers=workers)
    if backend != "torch":
        return _build_trt(checkpoint, output, backend=backend, target=target, model_raw=model_raw,
                          build=build, caps=caps, check_onnx=check_onnx, force=force, workers=workers,
                          lowering=rtx_lowering)
    if workers > 1:
        log.info("--workers applies to engine backends; the torch backend copies the checkpoint")
    if pc.world_size > 1:
        return _build_split(checkpoint, output, cfg=cfg, pc=pc, model_raw=model_raw, build=build, caps=caps)
    with CheckpointReader(checkpoint) as reader:     # headers and index only: cheap, catches broken shards
        weights = set(reader.shards)
    _check_copy_disk(checkpoint, output)
    log.info("building torch engine from %s: %d weight files, verify capacities %s, prefill capacities %s",
             checkpoint, len(weights), list(caps.verify), list(caps.prefill))

    def populate(tmp: Path) -> None:
        (tmp / "rank0").mkdir()
        (tmp / "tokenizer").mkdir()
        for f in sorted(p for p in checkpoint.iterdir() if p.is_file()):
            is_weight = f.name in WEIGHT_FILES or SHARD_RE.fullmatch(f.name)
            if is_weight and f.name.endswith(".safetensors") and f.name not in weights:
                continue             # a stray shard the index does not name
            copy_owned(f, tmp / ("rank0" if is_weight else "tokenizer") / f.name)

    return write_engine_dir(output, backend=backend, target=target, model_raw=model_raw, build=build,
                            capacities=caps, populate=populate)


def _encoder_capacities(cfg, backend: str, capacities: Sequence[int], build: BuildConfig) -> tuple[int, ...]:
    """The vision encoder's patch capacities, checked: the onnx backend exports one graph each
    (builder/export_vision.py), the torch backend records them (the runtime pads encoder calls to them)."""
    if cfg.vision is None:
        raise ValueError("--encoder-capacities: this checkpoint has no vision tower (no vision_config in config.json)")
    if backend not in ("torch", "onnx"):
        raise ValueError(f"--encoder-capacities: the {backend} backend does not build the vision encoder; build with "
                         "--backend torch or onnx")
    caps = tuple(capacities)
    encoder_specs(cfg.vision, caps, build.torch_dtype)       # multiples of the merge kernel, or a clear error
    return caps


def _build_split(checkpoint: Path, output: Path, *, cfg, pc: ParallelConfig, model_raw: dict, build: BuildConfig,
                 caps: Capacities) -> Path:
    """A torch engine over pc.world_size ranks: rank{r}/ with rank r's slices, and the tokenizer."""
    split.check_split_disk(checkpoint, output, pc)
    log.info("building a %d-rank torch engine from %s (tp %d, dcp %d, ep %d, dcp interleave %d)", pc.world_size,
             checkpoint, pc.tp, pc.dcp, pc.ep, pc.dcp_interleave)

    def populate(tmp: Path) -> None:
        split.write_ranks(checkpoint, tmp, cfg, pc)
        (tmp / "tokenizer").mkdir()
        for f in sorted(p for p in checkpoint.iterdir() if p.is_file()):
            if not (f.name in WEIGHT_FILES or SHARD_RE.fullmatch(f.name)):
                copy_owned(f, tmp / "tokenizer" / f.name)

    return write_engine_dir(output, backend="torch", target=None, model_raw=model_raw, build=build,
                            capacities=caps, populate=populate, parallel=pc)


def report_footprint(fp: Footprint, device_memory_gb: float | None, echo: Callable[[str], None] | None) -> None:
    """Log (and echo) the footprint; raise DoesNotFitError if it exceeds the target device's memory."""
    for line in fp.lines():
        log.info("%s", line)
        if echo is not None:
            echo(line)
    device_bytes = int(device_memory_gb * 2**30) if device_memory_gb is not None else local_device_memory()
    if device_bytes is None:
        log.info("no GPU visible and no --device-memory: the fit to a device is not checked")
        return
    fp.check_fits(device_bytes)


def _check_copy_disk(checkpoint: Path, output: Path) -> None:
    """The torch backend copies the checkpoint: room for it (a reflink may need less; a plain copy
    needs all of it)."""
    size = sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file())
    checks.check_disk(output, int(size * 1.05))


def _build_trt(checkpoint: Path, output: Path, *, backend: str, target: str | None, model_raw: dict,
               build: BuildConfig, caps: Capacities, check_onnx: bool, force: bool, workers: int,
               lowering: str) -> Path:
    """One ONNX graph + engine per capacity under rank0/ (see builder/rank.py); plugin graphs
    take the plugin library built for the target, recorded in config.json."""
    t_start = time.perf_counter()
    cfg = checks.preflight(checkpoint, output, backend=backend, target=target, capacities=caps, dtype=build.dtype,
                           lowering=lowering)
    if check_onnx and build.dtype != "fp32":
        raise ValueError("--check-onnx compares with onnxruntime in fp32: build with --dtype fp32")
    target = checks.check_target(backend, target)
    library = None
    if lowering == "plugin":
        try:
            library = library_for(target_archs(target or registry.local_gpu_target() or ""))
        except (PluginBuildError, ValueError) as e:
            fallback = (" (or build TensorRT-RTX's native fallback: --rtx-lowering native)"
                        if backend == "tensorrt-rtx" else "")
            raise checks.BuildError(f"the k3trt plugin library cannot be built: {e}{fallback}") from None
    options = BuildOptions(target=target, lowering=lowering, plugin_library=library.path if library else None)
    reports: list = []
    inputs: dict[str, Any] = {}

    def populate(tmp: Path) -> dict[str, str]:
        previous = _previous(output, force, backend, target)          # read under the build lock
        files = checkpoint_files(checkpoint, (previous.inputs.get("checkpoint_files") if previous else None) or {})
        code = code_digest()
        digest = inputs_digest(files, code)
        inputs.update(digest=digest, checkpoint_files=files, k3trt_version=k3trt.__version__, code_digest=code)
        prev = None
        if previous is not None:
            prev = rank.Previous(previous.rank_dir, {k[len("rank0/"):]: v for k, v in previous.files.items()
                                                     if k.startswith("rank0/")})
        known: dict[str, str] = {}
        reports.extend(rank.build_rank(
            rank.ModelSource(checkpoint, build.torch_dtype), cfg, caps, tmp / "rank0", backend=backend,
            block_size=build.block_size, max_seq_len=build.max_seq_len, kv_dtype=build.kv_torch_dtype,
            kv_scale=build.kv_scale, check=check_onnx, options=options, workers=workers,
            inputs_digest=digest, previous=prev, force=force, known_digests=known))
        inputs["capacities"] = {r.name: json.loads(Path(f"{r.engine}.json").read_text()).get("key") for r in reports}
        (tmp / "tokenizer").mkdir()
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                copy_owned(checkpoint / name, tmp / "tokenizer" / name)
        return {f"rank0/{k}": v for k, v in known.items()}

    path = write_engine_dir(output, backend=backend, target=target, model_raw=model_raw, build=build,
                            capacities=caps, populate=populate, inputs=inputs,
                            plugin_library=library.record() if library else None)
    log.info("%s", summary_table(reports, backend, target, time.perf_counter() - t_start))
    return path


def _build_onnx(checkpoint: Path, output: Path, *, cfg, target: str | None, model_raw: dict, build: BuildConfig,
                caps: Capacities, check_onnx: bool, workers: int) -> Path:
    """rank0/ holds the per-capacity graphs the TensorRT backends build their engines from (k3trt
    ops as custom nodes, weights shared in weights.bin), run by onnxruntime (runtime/onnx_session.py).
    fp32 only: the onnxruntime custom ops are registered for fp32. Every capacity is exported anew."""
    t_start = time.perf_counter()
    if build.dtype != "fp32" or build.kv_dtype not in ("auto", "fp32"):
        raise ValueError(f"the onnx backend runs fp32 graphs (its onnxruntime custom ops are fp32): build with "
                         f"--dtype fp32 (got --dtype {build.dtype} --kv-dtype {build.kv_dtype})")
    if target is not None:
        log.info("--target %s: the onnx backend runs on the CPU; ignored", target)
    weight_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    checks.check_disk(output, int(weight_bytes * 2 * 1.2))      # fp32 weights.bin + one graph's data file
    log.info("building onnx engine dir from %s: verify capacities %s, prefill capacities %s, encoder capacities %s",
             checkpoint, list(caps.verify), list(caps.prefill), list(caps.encoder))

    def populate(tmp: Path) -> None:
        rank.build_rank(rank.ModelSource(checkpoint, build.torch_dtype), cfg, caps, tmp / "rank0", backend="onnx",
                        block_size=build.block_size, max_seq_len=build.max_seq_len, kv_dtype=build.kv_torch_dtype,
                        kv_scale=build.kv_scale, check=check_onnx, engines=False, workers=workers)
        (tmp / "tokenizer").mkdir()
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                copy_owned(checkpoint / name, tmp / "tokenizer" / name)

    path = write_engine_dir(output, backend="onnx", target=None, model_raw=model_raw, build=build, capacities=caps,
                            populate=populate)
    graphs = sorted((path / "rank0").glob("*.onnx"))
    size = sum(f.stat().st_size for f in (path / "rank0").iterdir())
    log.info("onnx engine dir %s: %d graphs, %.1f MiB, built in %.1fs", path, len(graphs), size / 2**20,
             time.perf_counter() - t_start)
    return path


def summary_table(reports, backend: str, target: str | None, seconds: float) -> str:
    """The end-of-build table: capacity, file, size, seconds (export, engine), built or reused."""
    rows = [f"{'capacity':<14}{'file':<22}{'MiB':>8}{'export s':>10}{'engine s':>10}  status"]
    for r in reports:
        kind, cap = ("verify", f"B={r.name[8:]}") if r.name.startswith("verify_b") else ("prefill", f"T={r.name[9:]}")
        rows.append(f"{kind + ' ' + cap:<14}{r.engine.name:<22}{r.bytes / 2**20:>8.1f}{r.export_seconds:>10.1f}"
                    f"{r.seconds:>10.1f}  {'reused' if r.reused else 'built'}")
    built = sum(not r.reused for r in reports)
    rows.append(f"{'total':<36}{sum(r.bytes for r in reports) / 2**20:>8.1f}"
                f"{sum(r.export_seconds for r in reports):>10.1f}{sum(r.seconds for r in reports):>10.1f}  "
                f"{built} built, {len(reports) - built} reused; {seconds:.1f}s in all")
    return f"{len(reports)} {backend} engines (target {target}):\n" + "\n".join(rows)


def _previous(output: Path, force: bool, backend: str, target: str | None) -> EngineDir | None:
    """The engine dir being rebuilt, if it is one this k3trt reads (checksums are checked later,
    for the files a rebuild reuses)."""
    if not is_engine_dir(output):
        return None
    try:
        ed = read_engine_dir(output, verify_checksums=False)
    except EngineDirError as e:
        log.warning("%s will be replaced and nothing in it reused: %s", output, e)
        return None
    if force:
        log.info("--force: rebuilding every capacity of %s", output)
        return None
    if ed.backend != backend or ed.target != target:
        log.info("%s was built for %s (target %s): nothing in it is reused", output, ed.backend, ed.target)
        return None
    return ed


def checkpoint_files(checkpoint: Path, recorded: dict[str, dict]) -> dict[str, dict]:
    """{file: {size, mtime_ns, sha256}} of the checkpoint's config and weight files. A file whose
    size and mtime equal its `recorded` entry (the previous build's) keeps that sha256 without
    being read again: hashing a K3 checkpoint takes minutes."""
    out, trusted = {}, []
    names = sorted(f.name for f in checkpoint.iterdir()
                   if f.is_file() and (f.name in WEIGHT_FILES or f.name.endswith(".safetensors")))
    for name in names:
        st = (checkpoint / name).stat()
        rec = recorded.get(name) or {}
        if rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns and rec.get("sha256"):
            out[name] = dict(rec)
            trusted.append(name)
            continue
        log.info("hashing checkpoint file %s (%.1f MiB)", name, st.st_size / 2**20)
        out[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(checkpoint / name)}
    if trusted:
        log.info("%d checkpoint files unchanged since the previous build (size and mtime): not hashed again; "
                 "--force hashes them", len(trusted))
    return out


def code_digest() -> str:
    """sha256 over the source of the k3trt parts that shape graphs and engines (CODE_PACKAGES)."""
    root = Path(k3trt.__file__).parent
    h = hashlib.sha256()
    for part in CODE_PACKAGES:
        base = root / part
        for f in sorted([base] if base.is_file() else base.rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def inputs_digest(files: dict[str, dict], code: str) -> str:
    """One digest of everything a build reads besides its own options: checkpoint, code, versions."""
    import onnx  # noqa: PLC0415 (optional: onnx)
    import onnxscript  # noqa: PLC0415 (optional: onnxscript)

    doc = {"checkpoint": {k: v["sha256"] for k, v in files.items()}, "k3trt": k3trt.__version__, "code": code,
           "torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
