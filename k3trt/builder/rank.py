"""A whole rank's build: every capacity's graph exported into the rank dir (weights shared in
weights.bin), checked with onnxruntime on request, and built into an engine (builder/tensorrt.py).

Rebuilds: every engine's manifest carries its capacity's content key (capacity_key); build_rank
given the previous rank dir links the files of capacities whose key is unchanged and whose files
match their checksums, and exports and builds the rest. weights.json records the shared tensors
(name, sha256, file, offset, length), so that new graphs share the weights already in the linked
weights.bin; tensors it lacks go to a new weights.N.bin (never appended to a linked file).
Exports: one per graph family (builder/families.py: the capacities that run the same code share
one symbolic export, each member's graph stamped from it), checked per capacity.
Workers: ``workers`` > 1 runs exports and engine builds in spawned processes (each loads the
model once); weights are shared in capacity order in the parent, so the files equal the serial
build's. Engines are not byte-reproducible on TensorRT-RTX 1.7 even serially (the order of the
I/O tensors in the plan varies run to run; same size), which is why reuse links files rather
than comparing rebuilt ones.
Weights: the rank holds one copy. Every graph's initializers point into the shared data files
(export.share_weights), and every engine takes its large weights as inputs
(tensorrt.weights_to_inputs): no engine embeds a copy; the session binds the one device copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3trt.builder.backends import BuildError
from k3trt.builder.export import share_weights
from k3trt.builder.export_vision import check_encoder, export_encoder
from k3trt.builder.families import export_family, families, stamp
from k3trt.builder.onnx_ops import check_graph
from k3trt.builder.tensorrt import LOWERINGS, BuildOptions, EngineReport, build_engine
from k3trt.engine.backends import MODULES, Backend, load_backend, local_gpu_target
from k3trt.engine.engine_dir import sha256_file
from k3trt.engine.graph_io import GraphSpec, graph_specs
from k3trt.engine.vision_io import encoder_specs
from k3trt.engine.writer import copy_owned
from k3trt.model.loader import load_model
from k3trt.trt_plugin.loader import library_for, target_archs

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ a whole rank
@dataclass(frozen=True)
class ModelSource:
    """Where build_rank gets the model when (and only when) it must export a graph: loaded in this
    process, or once in each worker process (``workers`` > 1)."""
    checkpoint: Path
    dtype: Any                        # torch.dtype

    def load(self):
        return load_model(self.checkpoint, dtype=self.dtype)


@dataclass(frozen=True)
class Previous:
    """The rank dir of the engine dir being rebuilt, and its files' sha256 as its config.json lists
    them (relative to the rank dir): what an unchanged capacity's files are linked from."""
    rank_dir: Path
    digests: dict[str, str]


WEIGHT_TABLE = "weights.json"       # the shared tensors of the rank dir: name, sha256, file, offset, length


def capacity_key(spec, *, inputs_digest: str, backend: str, backend_version: str, native: bool,
                 options: BuildOptions) -> str:
    """The content key of one capacity's files: everything they are made from. `inputs_digest`
    covers the checkpoint and the code (builder/build.py); here: the graph (capacity, rows, block
    size and table width, dtypes, kv scale), the backend, its version and target, and the
    engine options that change the engine (not the timing cache)."""
    doc = {"inputs": inputs_digest, "graph": spec.name, "native": native,
           "spec": {f: str(getattr(spec, f)) for f in GraphSpec.__dataclass_fields__},
           "backend": backend, "backend_version": backend_version, "target": options.target,
           "weights_as_inputs": options.weights_as_inputs, "workspace_bytes": options.workspace_bytes,
           "num_blocks": list(options.num_blocks), "num_slots": list(options.num_slots),
           "plugin_library": options.plugin_library.name if options.plugin_library and not native else None}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def build_rank(model, cfg, capacities, rank_dir: str | Path, *, backend: str, block_size: int, max_seq_len: int,
               kv_dtype=None, kv_scale: float = 1.0, check: bool = False, engines: bool = True,
               options: BuildOptions = BuildOptions(), workers: int = 1, inputs_digest: str = "",
               previous: Previous | None = None, force: bool = False,
               known_digests: dict[str, str] | None = None) -> list[EngineReport]:
    """Export every capacity's graph into `rank_dir` (weights shared in weights.bin), check each
    with onnxruntime when `check`, and build its engine when `engines` (else export only, no
    TensorRT needed). The graphs carry plugin nodes (the k3trt plugin library, built for the
    target when `options.plugin_library` is unset), or for TensorRT-RTX with
    ``options.lowering="native"`` the native fallback; files: {name}.onnx, {name}.engine,
    {name}.engine.json (weight manifest, layer count,
    content key), weights.bin (+ weights.N.bin after a partial rebuild), weights.json.

    `model`: an nn.Module, or a ModelSource (loaded only if a graph must be exported; required
    for `workers` > 1: each worker process, spawned, loads it once and exports and builds
    capacities one at a time; the weights are shared in capacity order in this process, so the
    files equal a serial build's, engines aside: TensorRT-RTX's serialization order of I/O
    tensors varies from run to run, serial or not).
    `previous` (with `inputs_digest`): a capacity whose key (capacity_key) equals the one in its
    previous manifest, and whose previous files match their checksums, is linked, not rebuilt
    (unless `force`); the digests of linked files go into `known_digests` (rank-dir paths)."""
    if engines and backend not in MODULES:
        raise BuildError(f"unknown TensorRT backend {backend!r}; choose one of {sorted(MODULES)}")
    if workers > 1 and not isinstance(model, ModelSource):
        raise BuildError("build workers load the model themselves: pass a ModelSource, not a module")
    if options.lowering not in LOWERINGS:
        raise BuildError(f"lowering {options.lowering!r}: choose one of {LOWERINGS}")
    native = options.lowering == "native"          # the graphs that build parses, engines or not
    if native and backend != "tensorrt-rtx":
        raise BuildError("the native lowering is TensorRT-RTX's fallback; full TensorRT builds the plugin graphs")
    be = load_backend(backend) if engines else None
    if be is not None and not native and options.plugin_library is None:
        options = dataclasses.replace(options, plugin_library=library_for(_archs(be, options)).path)
    rank_dir = Path(rank_dir)
    rank_dir.mkdir(parents=True, exist_ok=True)
    dtype = model.dtype if isinstance(model, ModelSource) else next(model.parameters()).dtype
    specs = graph_specs(cfg, capacities, block_size=block_size, max_seq_len=max_seq_len, dtype=dtype,
                        kv_dtype=kv_dtype or dtype, kv_scale=kv_scale)
    keys = {s.name: capacity_key(s, inputs_digest=inputs_digest, backend=backend,
                                 backend_version=be.version if be else "", native=native, options=options)
            for s in specs}
    reports: dict[str, EngineReport] = {}
    table: dict = {}
    if previous is not None and engines and not force:
        reports, table = _adopt(previous, rank_dir, specs, keys, known_digests if known_digests is not None else {})
    todo = [s for s in specs if s.name not in reports]
    data_name = next(n for n in ("weights.bin", *(f"weights.{i}.bin" for i in range(1, 1 << 16)))
                     if not (rank_dir / n).exists())
    loaded: list = []

    def the_model():
        if not loaded:
            loaded.append(model.load()[1] if isinstance(model, ModelSource) else model)
        return loaded[0]

    jobs = dict(native=native, check=check, options=options, keys=keys, total=len(specs))
    position = {s.name: i for i, s in enumerate(specs, 1)}
    if todo and workers > 1 and len(todo) > 1:
        _build_parallel(model, cfg, todo, position, rank_dir, data_name, table, reports, backend=be,
                        workers=min(workers, len(todo)), jobs=jobs)
    else:
        for family in families(todo, native):
            t0 = time.perf_counter()
            for unit, graph in _export(the_model(), cfg, family, rank_dir, position, **jobs):
                share_weights([graph], data_name, table)
                paths = _stamp(graph, cfg, unit, rank_dir)
                if check:
                    for spec, path in zip(unit, paths):
                        _check(the_model(), cfg, spec, path, position[spec.name], **jobs)
                exported = (time.perf_counter() - t0) / len(unit)
                for spec, path in zip(unit, paths):
                    if be is not None:
                        r = _engine(be, path, rank_dir, spec.name, position[spec.name], **jobs)
                        reports[spec.name] = dataclasses.replace(r, export_seconds=exported)
                t0 = time.perf_counter()
    if capacities.encoder and cfg.vision is not None:
        _export_encoders(the_model(), cfg, capacities.encoder, dtype, rank_dir, data_name, table, check)
    if check:
        for spec in specs:
            if spec not in todo:
                log.info("%s: onnxruntime check (reused graph)", spec.name)
                check_graph(rank_dir / f"{spec.name}.onnx", the_model(), cfg, spec, native=native)
    (rank_dir / WEIGHT_TABLE).write_text(json.dumps(
        {"tensors": [[name, sha, loc, off, n] for (name, sha), (loc, off, n) in table.items()]}, indent=0) + "\n")
    return [reports[s.name] for s in specs] if engines else []


def _export_encoders(model, cfg, capacities, dtype, rank_dir: Path, data_name: str, table: dict, check: bool) -> None:
    """The vision encoder's graph for every encoder capacity (engine/vision_io.py), weights shared
    with the step graphs' data file; checked by onnxruntime when `check`."""
    for i, spec in enumerate(encoder_specs(cfg.vision, capacities, dtype), 1):
        log.info("[%d/%d] %s: export", i, len(capacities), spec.name)
        path = export_encoder(model.vision, spec, rank_dir / f"{spec.name}.onnx")
        share_weights([path], data_name, table)
        if check:
            log.info("[%d/%d] %s: onnxruntime check", i, len(capacities), spec.name)
            check_encoder(path, model.vision, spec)


def _archs(be: Backend, options: BuildOptions) -> tuple[str, ...]:
    """The plugin library's architectures: the engine target's (full TensorRT: the local GPU's)."""
    target = options.target or local_gpu_target()
    if target is None:
        raise BuildError(f"{be.name}: no target to build the plugin library for (pass --target)")
    return target_archs(target)


def _export(model, cfg, family: list, rank_dir: Path, position: dict[str, int], *, native: bool, total: int,
            **_) -> list[tuple[list, Path]]:
    """A family's graph (builder/families.py), its weights in its own data file, as [(members,
    graph)]; if the symbolic export fails, each member's own graph instead."""
    first = family[0]
    log.info("[%d/%d] %s: export (%s graph%s)", position[first.name], total, first.name,
             "native" if native else "plugin", f", family of {len(family)}" if len(family) > 1 else "")
    if len(family) == 1:
        return [(family, export_family(model, cfg, family, rank_dir / f"{first.name}.onnx", native=native))]
    try:
        return [(family, export_family(model, cfg, family, rank_dir / f"family_{first.name}.onnx", native=native))]
    except Exception as e:        # noqa: BLE001 (any trace failure: the members' own exports say what is wrong)
        log.warning("the symbolic export of %s failed (%s: %s); exporting them one by one",
                    ", ".join(s.name for s in family), type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return [([s], export_family(model, cfg, [s], rank_dir / f"{s.name}.onnx", native=native)) for s in family]


def _stamp(graph: Path, cfg, unit: list, rank_dir: Path) -> list[Path]:
    """The members' graphs from their family's (weights already shared); the family's file removed."""
    if len(unit) == 1 and graph.name == f"{unit[0].name}.onnx":
        return [graph]
    paths = [stamp(graph, cfg, spec, rank_dir / f"{spec.name}.onnx") for spec in unit]
    graph.unlink()
    return paths


def _check(model, cfg, spec, path: Path, i: int, *, native: bool, total: int, **_) -> None:
    log.info("[%d/%d] %s: onnxruntime check", i, total, spec.name)
    check_graph(path, model, cfg, spec, native=native)


def _engine(be: Backend, path: Path, rank_dir: Path, name: str, i: int, *, options: BuildOptions, keys: dict,
            total: int, **_) -> EngineReport:
    """One capacity's engine from its (weight-shared) graph; its content key goes into its manifest."""
    log.info("[%d/%d] %s: engine", i, total, name)
    return build_engine(be, path, rank_dir / f"{name}.engine", options, meta={"key": keys[name]})


def _adopt(previous: Previous, rank_dir: Path, specs, keys: dict[str, str],
           known: dict[str, str]) -> tuple[dict[str, EngineReport], dict]:
    """Link the files of every capacity whose previous key matches and whose files are intact;
    returns their reports and the weight table restricted to the data files linked."""
    import onnx  # noqa: PLC0415 (optional: onnx)

    prev, digests = previous.rank_dir, previous.digests
    checked: dict[str, bool] = {}

    def intact(rel: str) -> bool:
        if rel not in checked:
            f = prev / rel
            checked[rel] = rel in digests and f.is_file() and sha256_file(f) == digests[rel]
        return checked[rel]

    if not intact(WEIGHT_TABLE):
        log.info("rebuilding every capacity: %s has no intact %s (built before content keys?)", prev, WEIGHT_TABLE)
        return {}, {}
    adopted: dict[str, tuple[list[str], dict]] = {}     # name -> (files to link, manifest)
    for spec in specs:
        name = spec.name
        try:
            manifest = json.loads((prev / f"{name}.engine.json").read_text())
        except (OSError, ValueError):
            continue                                 # a capacity the previous build did not have
        if manifest.get("key") != keys[name]:
            log.info("%s: inputs changed since the previous build: rebuilding", name)
            continue
        files = [f"{name}.onnx", f"{name}.engine", f"{name}.engine.json"]
        if not all(intact(f) for f in files):
            log.warning("%s: rebuilding: its files in %s are missing or do not match their checksums", name, prev)
            continue
        graph = onnx.load(str(prev / f"{name}.onnx"), load_external_data=False).graph
        data = {w["location"] for w in manifest["weights"]} | {
            e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
        if not all(intact(d) for d in sorted(data)):
            log.warning("%s: rebuilding: its weight files %s in %s do not match their checksums", name, sorted(data),
                        prev)
            continue
        adopted[name] = ([*files, *sorted(data)], manifest)
    linked: set[str] = set()
    reports = {}
    for name, (files, manifest) in adopted.items():
        for rel in files:
            if rel not in linked:
                _link_or_copy(prev / rel, rank_dir / rel)
                known[rel] = digests[rel]
                linked.add(rel)
        engine = rank_dir / f"{name}.engine"
        reports[name] = EngineReport(name, engine, 0.0, engine.stat().st_size, int(manifest.get("layers", 0)),
                                     tuple(w["name"] for w in manifest["weights"]), reused=True)
    table = {}
    if adopted:
        raw = json.loads((prev / WEIGHT_TABLE).read_text())
        table = {(n, sha): (loc, int(off), int(length)) for n, sha, loc, off, length in raw["tensors"] if loc in linked}
        log.info("reusing %d of %d capacities from the previous build (same content keys): %s", len(adopted),
                 len(specs), ", ".join(adopted))
    return reports, table


def _link_or_copy(src: Path, dst: Path) -> None:
    """A reused capacity's file from the previous engine dir: both dirs are engine-owned and the
    previous one is removed once the new one is in place (engine/writer.py), so a hard link leaves
    the new dir the file's only owner. Files from outside an engine dir are copied (copy_owned)."""
    try:
        os.link(src, dst)
    except OSError:
        copy_owned(src, dst)


# ------------------------------------------------------------------------------ worker processes
_WORKER: dict[str, Any] = {}


def _worker_init(source: ModelSource, cfg, level: int, threads: int) -> None:

    logging.basicConfig(level=level, stream=sys.stderr, datefmt="%H:%M:%S",
                        format=f"%(asctime)s %(levelname)s [worker {os.getpid()}] %(name)s: %(message)s")
    logging.getLogger("k3trt").setLevel(level)
    torch.set_num_threads(threads)
    _WORKER.update(source=source, cfg=cfg)


def _worker_model():
    if "model" not in _WORKER:
        _WORKER["model"] = _WORKER["source"].load()[1]
    return _WORKER["model"]


def _worker_export(family, rank_dir: Path, position: dict[str, int], jobs: dict) -> tuple[list, float]:
    t0 = time.perf_counter()
    units = _export(_worker_model(), _WORKER["cfg"], family, rank_dir, position, **jobs)
    return units, time.perf_counter() - t0


def _worker_check(spec, path: Path, i: int, jobs: dict) -> None:
    _check(_worker_model(), _WORKER["cfg"], spec, path, i, **jobs)


def _worker_engine(backend: str, path: Path, rank_dir: Path, name: str, i: int, jobs: dict) -> EngineReport:
    if "backend" not in _WORKER:
        _WORKER["backend"] = load_backend(backend)
    return _engine(_WORKER["backend"], path, rank_dir, name, i, **jobs)


def _build_parallel(source: ModelSource, cfg, todo, position: dict[str, int], rank_dir: Path, data_name: str,
                    table: dict, reports: dict[str, EngineReport], *, backend: Backend | None, workers: int,
                    jobs: dict) -> None:
    """Exports, then engines, on `workers` spawned processes; the weights are shared here, in
    capacity order, as each export arrives (the serial build's order, so the same files)."""

    threads = max(1, (os.cpu_count() or 1) // workers)
    level = logging.getLogger("k3trt").getEffectiveLevel()
    log.info("building %d capacities on %d worker processes (%d torch threads each)", len(todo), workers, threads)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init, initargs=(source, cfg, level, threads))
    try:
        exports = [pool.submit(_worker_export, f, rank_dir, position, jobs) for f in families(todo, jobs["native"])]
        engines, export_time, checks = {}, {}, []
        for fut in exports:
            units, seconds = fut.result()
            for unit, graph in units:
                share_weights([graph], data_name, table)
                for spec, path in zip(unit, _stamp(graph, cfg, unit, rank_dir)):
                    export_time[spec.name] = seconds / sum(len(u) for u, _ in units)
                    if jobs["check"]:
                        checks.append(pool.submit(_worker_check, spec, path, position[spec.name], jobs))
                    if backend is not None:
                        engines[spec.name] = pool.submit(_worker_engine, backend.name, path, rank_dir, spec.name,
                                                         position[spec.name], jobs)
        for fut in checks:
            fut.result()
        for name, fut in engines.items():
            reports[name] = dataclasses.replace(fut.result(), export_seconds=export_time[name])
    except BaseException as e:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):   # do not wait for long work
            proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(e, BrokenProcessPool):
            raise BuildError(f"a build worker process died ({e}); rerun with --workers 1 to see where") from None
        raise
    pool.shutdown(wait=True)
