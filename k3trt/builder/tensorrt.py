"""TensorRT and TensorRT-RTX engines from the exported ONNX graphs, one module for both.

Backends (imported lazily; neither is needed to import k3trt):
    tensorrt       full TensorRT >= 10.8 (``pip install tensorrt``; not installable in this
                   workplace, so this path is written to NVIDIA's documentation and was not run).
                   Parses the *plugin* graphs: each k3trt node becomes the plugin registered under
                   its op_type in namespace ``k3trt`` by the op's ``k3trt.plugins.<op>_trt``
                   module (``tensorrt.plugin``: register + aot_impl, so engines need no Python).
                   Builds for the GPU it runs on.
    tensorrt-rtx   TensorRT-RTX 1.7 (module ``tensorrt_rtx_bindings``). Builds on a CPU-only
                   machine (AOT) for SM75/80/86/89/120/121. Parses the *native* graphs (the k3trt
                   ops lowered to standard ONNX, onnx_ops.native_lowerings), because it cannot take
                   the plugins from Python (measured 2026-12-02, tests/test_tensorrt_rtx.py keeps
                   the reproductions):
                   - a Python ``IPluginCreatorV3One`` registers (True) and its ``create_plugin`` runs,
                     then the ONNX parser calls std::terminate inside libtensorrt_onnxparser_rtx
                     ("terminate called without an active exception", no plugin method called);
                   - a ``IPluginCreatorV3Quick`` (what ``tensorrt.plugin`` uses) is refused: "TensorRT-RTX
                     imports IPluginV3 plugins registered with an IPluginCreatorV3One creator only";
                   - the network API has no add_plugin*, and creators report APILanguage.PYTHON
                     (read-only). Only C++ IPluginCreatorV3One libraries remain, and the wheel ships
                     no headers to build one against.
                   Timing caches are no-ops in RTX 1.2+ (it compiles kernels at first run).

Engines: one per capacity, because the graphs are static in their step dimension (the model's
StepContext carries lengths as Python ints, so torch.export cannot make B or T symbolic) and
TensorRT profiles cannot join different networks. What would make per-capacity engines costly,
a copy of the weights in each, is avoided by binding the weights as engine inputs: every engine
reads the one device copy the session loads from ``weights.bin``. Measured on the tiny preset,
RTX 1.7, SM120, verify_b2 (67.6 MB of fp32 weights): embedded weights 78.7 MB engine / 3.8 s
build; weights as inputs 11.8 MB / 1.4 s. (A weight-stripped plan, STRIP_PLAN + refit, needs a
CUDA device to build on RTX: "MyelinCheckException ... status == CUDA_SUCCESS".)

Rebuilds: every engine's manifest carries its capacity's content key (capacity_key); build_rank
given the previous rank dir links the files of capacities whose key is unchanged and whose files
match their checksums, and exports and builds the rest. weights.json records the shared tensors
(name, sha256, file, offset, length), so that new graphs share the weights already in the linked
weights.bin; tensors it lacks go to a new weights.N.bin (never appended to a linked file).
Workers: ``workers`` > 1 runs exports and engine builds in spawned processes (each loads the
model once); weights are shared in capacity order in the parent, so the files equal the serial
build's. Engines are not byte-reproducible on TensorRT-RTX 1.7 even serially (the order of the
I/O tensors in the plan varies run to run; same size), which is why reuse links files rather
than comparing rebuilt ones.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx_bindings"}
INSTALL = {"tensorrt": "pip install 'k3trt[tensorrt]' (tensorrt>=10.8; needs NVIDIA's package index)",
           "tensorrt-rtx": "pip install tensorrt-rtx-cu13-libs==1.7.1.116 tensorrt-rtx-cu13-bindings==1.7.1.116"}
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
WEIGHT_INPUT_MIN_ELEMENTS = 4096     # smaller initializers stay constants (norm weights, biases)


class BuildError(RuntimeError):
    """A build that cannot proceed; the message says why and what to do."""


# ------------------------------------------------------------------------------ backends
@dataclass(frozen=True)
class Backend:
    name: str                        # "tensorrt" | "tensorrt-rtx"
    trt: Any = field(repr=False)     # the imported module
    version: str = ""

    @property
    def is_rtx(self) -> bool:
        return self.name == "tensorrt-rtx"

    @property
    def graph_kind(self) -> str:
        """Which exported graphs it parses: "plugin" (k3trt nodes) or "native"."""
        return "native" if self.is_rtx else "plugin"


def installed_backends() -> list[str]:
    """Backends whose module can be found (without importing it)."""
    return [name for name, mod in MODULES.items() if importlib.util.find_spec(mod) is not None]


def load_backend(name: str) -> Backend:
    if name not in MODULES:
        raise BuildError(f"unknown TensorRT backend {name!r}; choose one of {sorted(MODULES)}")
    try:
        trt = importlib.import_module(MODULES[name])
    except ImportError as e:
        raise BuildError(f"backend {name!r} is not installed ({e}); install it with: {INSTALL[name]}") from None
    return Backend(name, trt, getattr(trt, "__version__", "?"))


# ------------------------------------------------------------------------------ checks before work
def normalize_target(target: str | None) -> str | None:
    if target is None:
        return None
    t = target.strip().lower().replace("_", "")
    if not t.startswith("sm") or not t[2:].isdigit():
        raise BuildError(f"target {target!r}: expected a GPU architecture like sm90 or sm120")
    return t


def check_target(backend: str, target: str | None) -> str | None:
    """The target the backend will build for, or a BuildError before any work starts."""
    t = normalize_target(target)
    if backend == "tensorrt-rtx":
        if t is None:
            raise BuildError(f"TensorRT-RTX builds ahead of time for a named GPU: pass --target, one of {RTX_TARGETS}")
        if t not in RTX_TARGETS:
            raise BuildError(f"TensorRT-RTX 1.7 cannot build for {t}; it builds for {', '.join(RTX_TARGETS)} "
                             "(datacenter GPUs such as sm90 need --backend tensorrt or torch)")
        return t
    if backend == "tensorrt":
        local = _local_gpu_target()
        if local is None:
            raise BuildError("full TensorRT builds on the GPU it targets and this machine has none; "
                             "build there, or use --backend tensorrt-rtx --target sm120 for an RTX GPU")
        if t is not None and t != local:
            raise BuildError(f"full TensorRT builds for the GPU present ({local}), not {t}; build on a {t} machine")
        return local
    raise BuildError(f"check_target: {backend!r} is not a TensorRT backend")


def runnable_here(backend: str, target: str | None) -> str | None:
    """None if this machine could run `backend` engines built for `target`, else why not (one
    clause, for messages). TensorRT-family engines run only on the GPU architecture they were
    built for; TensorRT-RTX runs only on its RTX targets (on SM90, e.g. an H200, it refuses to
    deserialize: "compute capability 9.0 ... not supported")."""
    local = _local_gpu_target()
    if backend == "tensorrt-rtx" and local is not None and local not in RTX_TARGETS:
        return (f"its GPU is {local}, and TensorRT-RTX runs only on {', '.join(RTX_TARGETS)} "
                "(datacenter GPUs such as sm90 need --backend tensorrt or torch)")
    if local is None:
        return "it has no CUDA GPU (TensorRT engines run on the GPU they were built for)"
    if target is not None and local != target:
        return f"its GPU is {local} and the engines were built for {target} (an engine runs only on its target)"
    if backend in MODULES and importlib.util.find_spec(MODULES[backend]) is None:
        return f"{backend} is not installed ({INSTALL[backend]})"
    return None


def _local_gpu_target() -> str | None:
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm{major}{minor}"
    except Exception:  # noqa: BLE001  (no torch CUDA at all: no GPU as far as we can tell)
        pass
    return None


def check_checkpoint(path: str | Path):
    """The checkpoint's ModelConfig, or a BuildError saying why it is not a usable K3 checkpoint."""
    from k3trt.config import ConfigError, ModelConfig

    path = Path(path)
    if not path.is_dir():
        raise BuildError(f"checkpoint {path} is not a directory (expected a Hugging Face checkpoint)")
    try:
        cfg = ModelConfig.from_json(path)
    except ConfigError as e:
        raise BuildError(f"checkpoint {path} is not a Kimi K3 checkpoint: {e}") from None
    if not any(path.glob("*.safetensors")):
        raise BuildError(f"checkpoint {path} has a K3 config.json but no *.safetensors weights")
    return cfg


def estimate_build_bytes(weight_bytes: int, num_engines: int, *, weights_as_inputs: bool = True) -> int:
    """Peak disk a build needs: weights.bin, one graph's transient data file before it is
    shared, and the engines (about 1/5 of the weights each with weights as inputs on tiny:
    activations and folded constants; a full copy each otherwise), plus 10%."""
    per_engine = weight_bytes // 5 if weights_as_inputs else weight_bytes * 11 // 10
    return int((2 * weight_bytes + num_engines * per_engine) * 1.1)


def check_disk(directory: str | Path, need_bytes: int) -> None:
    directory = Path(directory)
    probe = next((p for p in [directory, *directory.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise BuildError(f"not enough disk under {probe}: the build needs about {need_bytes / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB are free; free space or choose another --output")


# ------------------------------------------------------------------------------ plugins
def register_plugins(backend: Backend, op_types: set[str]) -> None:
    """Make the plugins for `op_types` known to the backend, or say which cannot be."""
    from k3trt.builder.onnx_ops import BY_OP_TYPE

    if backend.is_rtx:
        raise BuildError(f"TensorRT-RTX cannot load the k3trt plugins from Python ({sorted(op_types)}): its ONNX "
                         "parser aborts on Python IPluginCreatorV3One plugins and refuses tensorrt.plugin ones; "
                         "build the native graphs instead (this module's docstring has the details)")
    missing = []
    for op_type in sorted(op_types):
        module = f"k3trt.plugins.{BY_OP_TYPE[op_type].torch_name}_trt"
        try:
            importlib.import_module(module)      # registers "k3trt::<op_type>" with tensorrt.plugin
        except ImportError:
            missing.append(f"{op_type} ({module})")
    if missing:
        raise BuildError(f"no TensorRT plugin for {', '.join(missing)}: each k3trt node needs a module that "
                         "registers it with tensorrt.plugin (register + aot_impl)")


def blocking_nodes(backend: Backend, onnx_path: str | Path) -> list[str]:
    """The nodes of a graph the backend's ONNX parser cannot import, as "name (op_type): reason"."""
    trt = backend.trt
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(_strongly_typed(trt))
    parser = trt.OnnxParser(network, logger)
    onnx_path = Path(onnx_path)
    if parser.supports_model_v2(onnx_path.read_bytes(), str(onnx_path)):
        return []
    out = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        out.append(f"{err.node_name()} ({err.node_operator()}): {err.desc()}")
    return out


# ------------------------------------------------------------------------------ building
@dataclass(frozen=True)
class BuildOptions:
    target: str | None = None                       # sm120 … (RTX: required; full TRT: the local GPU)
    weights_as_inputs: bool = True                  # see the module doc
    workspace_bytes: int | None = None               # None: the backend's default (RTX on a CPU-only
                                                    # machine fails to allocate an explicit 1 GiB pool)
    timing_cache: Path | None = None                # full TRT only (RTX: no-op)
    # profile ranges of the dynamic cache dimensions: (min, opt, max)
    num_blocks: tuple[int, int, int] = (1, 4096, 65536)
    num_slots: tuple[int, int, int] = (1, 64, 1024)


@dataclass(frozen=True)
class EngineReport:
    name: str
    engine: Path
    seconds: float                    # the engine build (0 when reused)
    bytes: int
    layers: int
    weight_inputs: tuple[str, ...]
    reused: bool = False              # linked from the previous engine dir: same content key
    export_seconds: float = 0.0       # the ONNX export (and onnxruntime check) of its graph


def weights_to_inputs(onnx_path: Path, out_path: Path, min_elements: int = WEIGHT_INPUT_MIN_ELEMENTS) -> list[dict]:
    """Write a copy of the graph whose large initializers are graph inputs; returns their manifest
    (name, dtype, shape, location, offset, length: where the session reads each from)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    manifest = []
    for init in list(model.graph.initializer):
        n = 1
        for d in init.dims:
            n *= d
        if n < min_elements or init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in init.external_data}
        manifest.append({"name": init.name, "dtype": helper.tensor_dtype_to_np_dtype(init.data_type).name,
                         "onnx_dtype": init.data_type, "shape": list(init.dims), "location": info["location"],
                         "offset": int(info.get("offset", 0)), "length": int(info["length"])})
        model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        model.graph.initializer.remove(init)
    onnx.save(model, str(out_path))
    return manifest


def build_engine(backend: Backend, onnx_path: str | Path, engine_path: str | Path,
                 options: BuildOptions = BuildOptions(), meta: dict[str, Any] | None = None) -> EngineReport:
    """Parse `onnx_path` into a strongly typed network, build, write `engine_path` (+ ``.json``:
    the weight-input manifest, the layer count and `meta`, e.g. the capacity's content key).
    Parser errors name every node that failed."""
    trt = backend.trt
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    target = check_target(backend.name, options.target)
    t0 = time.perf_counter()
    manifest: list[dict] = []
    parse_path = onnx_path
    if options.weights_as_inputs:
        parse_path = onnx_path.with_name(f".{onnx_path.stem}.weights-as-inputs.onnx")
        manifest = weights_to_inputs(onnx_path, parse_path)
    try:
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(_strongly_typed(trt))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(parse_path)):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise BuildError(f"{backend.name} cannot parse {onnx_path.name}: " + "; ".join(errors))
    finally:
        if parse_path != onnx_path:
            parse_path.unlink(missing_ok=True)
    config = builder.create_builder_config()
    if options.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    if backend.is_rtx:
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, target.upper()), 0)
    cache = _load_timing_cache(backend, config, options.timing_cache)
    _add_profile(builder, network, config, options, _dynamic_dims(onnx_path))
    log.info("%s: building %s engine for %s (%d layers)", onnx_path.stem, backend.name, target, network.num_layers)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"{backend.name} failed to build {onnx_path.name} for {target} (the log above has the reason)")
    engine_path.write_bytes(memoryview(plan))
    Path(f"{engine_path}.json").write_text(
        json.dumps({"weights": manifest, "layers": network.num_layers, **(meta or {})}, indent=1) + "\n")
    if cache is not None:
        options.timing_cache.write_bytes(memoryview(cache.serialize()))
    report = EngineReport(onnx_path.stem, engine_path, time.perf_counter() - t0, engine_path.stat().st_size,
                          network.num_layers, tuple(m["name"] for m in manifest))
    log.info("%s: %s written (%.1f MiB) in %.1fs", report.name, engine_path.name, report.bytes / 2**20, report.seconds)
    return report


def _strongly_typed(trt) -> int:
    # strongly typed: the graph's dtypes are the engine's (no precision flags, no silent casts)
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def _load_timing_cache(backend: Backend, config, path: Path | None):
    if path is None or backend.is_rtx:      # RTX: timing caches are no-ops since 1.2
        return None
    cache = config.create_timing_cache(path.read_bytes() if path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def _dynamic_dims(onnx_path: Path) -> dict[str, dict[int, str]]:
    """input name -> {axis: dim name} for the graph's named dynamic dims (export.DYNAMIC_DIMS)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {v.name: {i: d.dim_param for i, d in enumerate(v.type.tensor_type.shape.dim) if d.dim_param}
            for v in model.graph.input}


def _add_profile(builder, network, config, options: BuildOptions, dims: dict[str, dict[int, str]]) -> None:
    """One profile: the step dims are static, the cache dims range as the options say."""
    ranges = {"num_blocks": options.num_blocks, "num_slots": options.num_slots}
    profile = builder.create_optimization_profile()
    dynamic = False
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = list(tensor.shape)
        if all(d >= 0 for d in shape):
            continue
        dynamic = True
        names = dims.get(tensor.name, {})
        unknown = [a for a, d in enumerate(shape) if d < 0 and names.get(a) not in ranges]
        if unknown:
            raise BuildError(f"input {tensor.name} has dynamic axes {unknown} with no profile range "
                             f"(known: {sorted(ranges)})")
        lo, opt, hi = ([ranges[names[a]][k] if d < 0 else d for a, d in enumerate(shape)] for k in range(3))
        profile.set_shape(tensor.name, lo, opt, hi)
    if dynamic:
        config.add_optimization_profile(profile)


# ------------------------------------------------------------------------------ a whole rank
NATIVE_MAX_PREFILL = 64      # native graphs unroll KDA's recurrence: graph size grows with T


def graph_specs(cfg, capacities, *, block_size: int, max_seq_len: int, dtype, kv_dtype, kv_scale: float = 1.0):
    """The GraphSpecs of every capacity (verify first), as the engine dir names them."""
    from k3trt.builder.export import GraphSpec

    # a padded verify request sees up to Q - 1 rows past its last live one
    max_blocks = -(-(max_seq_len + capacities.spec_tokens) // block_size)
    kw = dict(block_size=block_size, max_blocks=max_blocks, dtype=dtype, kv_dtype=kv_dtype, kv_scale=kv_scale)
    return ([GraphSpec.verify(b, capacities.spec_tokens, **kw) for b in capacities.verify] +
            [GraphSpec.prefill(t, **kw) for t in capacities.prefill])


def preflight(checkpoint: str | Path, output: str | Path, *, backend: str, target: str | None, capacities,
              dtype: str = "bf16") -> Any:
    """Every check a TensorRT build can fail before its long work, in order; returns the ModelConfig."""
    cfg = check_checkpoint(checkpoint)
    if backend not in installed_backends():
        raise BuildError(f"backend {backend!r} is not installed; install it with: {INSTALL[backend]}")
    target = check_target(backend, target)
    if backend == "tensorrt-rtx":
        if dtype == "bf16" and target == "sm75":
            raise BuildError("sm75 has no bf16: build with --dtype fp16 or fp32, or another --target")
        big = [t for t in capacities.prefill if t > NATIVE_MAX_PREFILL]
        if big:
            raise BuildError(f"TensorRT-RTX builds native graphs, which unroll the KDA recurrence: prefill "
                             f"capacities {big} exceed {NATIVE_MAX_PREFILL}; lower --max-num-tokens")
    weight_bytes = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    scale = 2 if dtype == "fp32" else 1               # checkpoints ship 16-bit weights
    check_disk(output, estimate_build_bytes(weight_bytes * scale, len(capacities.verify) + len(capacities.prefill)))
    return cfg


@dataclass(frozen=True)
class ModelSource:
    """Where build_rank gets the model when (and only when) it must export a graph: loaded in this
    process, or once in each worker process (``workers`` > 1)."""
    checkpoint: Path
    dtype: Any                        # torch.dtype

    def load(self):
        from k3trt.model.loader import load_model
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
    import hashlib

    from k3trt.builder.export import GraphSpec

    doc = {"inputs": inputs_digest, "graph": spec.name, "native": native,
           "spec": {f: str(getattr(spec, f)) for f in GraphSpec.__dataclass_fields__},
           "backend": backend, "backend_version": backend_version, "target": options.target,
           "weights_as_inputs": options.weights_as_inputs, "workspace_bytes": options.workspace_bytes,
           "num_blocks": list(options.num_blocks), "num_slots": list(options.num_slots)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def build_rank(model, cfg, capacities, rank_dir: str | Path, *, backend: str, block_size: int, max_seq_len: int,
               kv_dtype=None, kv_scale: float = 1.0, check: bool = False, engines: bool = True,
               options: BuildOptions = BuildOptions(), workers: int = 1, inputs_digest: str = "",
               previous: Previous | None = None, force: bool = False,
               known_digests: dict[str, str] | None = None) -> list[EngineReport]:
    """Export every capacity's graph into `rank_dir` (weights shared in weights.bin), check each
    with onnxruntime when `check`, and build its engine when `engines` (else export only, no
    TensorRT needed). The graphs are the native ones for TensorRT-RTX and the plugin ones for
    TensorRT; files: {name}.onnx, {name}.engine, {name}.engine.json (weight manifest, layer count,
    content key), weights.bin (+ weights.N.bin after a partial rebuild), weights.json.

    `model`: an nn.Module, or a ModelSource (loaded only if a graph must be exported; required
    for `workers` > 1: each worker process, spawned, loads it once and exports and builds
    capacities one at a time; the weights are shared in capacity order in this process, so the
    files equal a serial build's, engines aside: TensorRT-RTX's serialization order of I/O
    tensors varies from run to run, serial or not).
    `previous` (with `inputs_digest`): a capacity whose key (capacity_key) equals the one in its
    previous manifest, and whose previous files match their checksums, is linked, not rebuilt
    (unless `force`); the digests of linked files go into `known_digests` (rank-dir paths)."""
    from k3trt.builder.export import share_weights
    from k3trt.builder.onnx_ops import OPS, check_graph

    if backend not in MODULES:
        raise BuildError(f"unknown TensorRT backend {backend!r}; choose one of {sorted(MODULES)}")
    if workers > 1 and not isinstance(model, ModelSource):
        raise BuildError("build workers load the model themselves: pass a ModelSource, not a module")
    be = load_backend(backend) if engines else None
    native = backend == "tensorrt-rtx"              # the graphs that backend parses, engines or not
    if be is not None and not native:
        register_plugins(be, {op.op_type for op in OPS if op.torch_name != "merge_attn_states"})
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
        for spec in todo:
            t0 = time.perf_counter()
            path = _export(the_model(), cfg, spec, rank_dir, position[spec.name], **jobs)
            share_weights([path], data_name, table)
            exported = time.perf_counter() - t0
            if be is not None:
                r = _engine(be, path, rank_dir, spec.name, position[spec.name], **jobs)
                reports[spec.name] = dataclasses.replace(r, export_seconds=exported)
    if check:
        for spec in specs:
            if spec not in todo:
                log.info("%s: onnxruntime check (reused graph)", spec.name)
                check_graph(rank_dir / f"{spec.name}.onnx", the_model(), cfg, spec, native=native)
    (rank_dir / WEIGHT_TABLE).write_text(json.dumps(
        {"tensors": [[name, sha, loc, off, n] for (name, sha), (loc, off, n) in table.items()]}, indent=0) + "\n")
    return [reports[s.name] for s in specs] if engines else []


def _export(model, cfg, spec, rank_dir: Path, i: int, *, native: bool, check: bool, total: int, **_) -> Path:
    """One capacity's graph (checked by onnxruntime when `check`), its weights in its own data file."""
    from k3trt.builder.export import export_graph
    from k3trt.builder.onnx_ops import check_graph

    log.info("[%d/%d] %s: export (%s graph)", i, total, spec.name, "native" if native else "plugin")
    path = export_graph(model, cfg, spec, rank_dir / f"{spec.name}.onnx", native=native)
    if check:
        log.info("[%d/%d] %s: onnxruntime check", i, total, spec.name)
        check_graph(path, model, cfg, spec, native=native)
    return path


def _engine(be: Backend, path: Path, rank_dir: Path, name: str, i: int, *, options: BuildOptions, keys: dict,
            total: int, **_) -> EngineReport:
    """One capacity's engine from its (weight-shared) graph; its content key goes into its manifest."""
    log.info("[%d/%d] %s: engine", i, total, name)
    return build_engine(be, path, rank_dir / f"{name}.engine", options, meta={"key": keys[name]})


def _adopt(previous: Previous, rank_dir: Path, specs, keys: dict[str, str],
           known: dict[str, str]) -> tuple[dict[str, EngineReport], dict]:
    """Link the files of every capacity whose previous key matches and whose files are intact;
    returns their reports and the weight table restricted to the data files linked."""
    import onnx

    from k3trt.builder.engine_dir import sha256_file

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
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# ------------------------------------------------------------------------------ worker processes
_WORKER: dict[str, Any] = {}


def _worker_init(source: ModelSource, cfg, level: int, threads: int) -> None:
    import sys

    import torch

    logging.basicConfig(level=level, stream=sys.stderr, datefmt="%H:%M:%S",
                        format=f"%(asctime)s %(levelname)s [worker {os.getpid()}] %(name)s: %(message)s")
    logging.getLogger("k3trt").setLevel(level)
    torch.set_num_threads(threads)
    _WORKER.update(source=source, cfg=cfg)


def _worker_export(spec, rank_dir: Path, i: int, jobs: dict) -> tuple[Path, float]:
    t0 = time.perf_counter()
    if "model" not in _WORKER:
        _WORKER["model"] = _WORKER["source"].load()[1]
    path = _export(_WORKER["model"], _WORKER["cfg"], spec, rank_dir, i, **jobs)
    return path, time.perf_counter() - t0


def _worker_engine(backend: str, path: Path, rank_dir: Path, name: str, i: int, jobs: dict) -> EngineReport:
    if "backend" not in _WORKER:
        _WORKER["backend"] = load_backend(backend)
    return _engine(_WORKER["backend"], path, rank_dir, name, i, **jobs)


def _build_parallel(source: ModelSource, cfg, todo, position: dict[str, int], rank_dir: Path, data_name: str,
                    table: dict, reports: dict[str, EngineReport], *, backend: Backend | None, workers: int,
                    jobs: dict) -> None:
    """Exports, then engines, on `workers` spawned processes; the weights are shared here, in
    capacity order, as each export arrives (the serial build's order, so the same files)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from k3trt.builder.export import share_weights

    threads = max(1, (os.cpu_count() or 1) // workers)
    level = logging.getLogger("k3trt").getEffectiveLevel()
    log.info("building %d capacities on %d worker processes (%d torch threads each)", len(todo), workers, threads)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init, initargs=(source, cfg, level, threads))
    try:
        exports = [pool.submit(_worker_export, s, rank_dir, position[s.name], jobs) for s in todo]
        engines, export_time = {}, {}
        for spec, fut in zip(todo, exports):
            path, export_time[spec.name] = fut.result()
            share_weights([path], data_name, table)
            if backend is not None:
                engines[spec.name] = pool.submit(_worker_engine, backend.name, path, rank_dir, spec.name,
                                                 position[spec.name], jobs)
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
