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
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
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
    seconds: float
    bytes: int
    layers: int
    weight_inputs: tuple[str, ...]


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
                 options: BuildOptions = BuildOptions()) -> EngineReport:
    """Parse `onnx_path` into a strongly typed network, build, write `engine_path` (+ ``.json``:
    the weight-input manifest). Parser errors name every node that failed."""
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
    Path(f"{engine_path}.json").write_text(json.dumps({"weights": manifest}, indent=1) + "\n")
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


def build_rank(model, cfg, capacities, rank_dir: str | Path, *, backend: str, block_size: int, max_seq_len: int,
               kv_dtype=None, kv_scale: float = 1.0, check: bool = False, engines: bool = True,
               options: BuildOptions = BuildOptions()) -> list[EngineReport]:
    """Export every capacity's graph into `rank_dir` (weights shared in weights.bin), check each
    with onnxruntime when `check`, and build its engine when `engines` (else export only, no
    TensorRT needed). The graphs are the native ones for TensorRT-RTX and the plugin ones for
    TensorRT; files: {name}.onnx, {name}.engine, {name}.engine.json (weight manifest), weights.bin."""
    from k3trt.builder.export import export_graph, share_weights
    from k3trt.builder.onnx_ops import OPS, check_graph

    if backend not in MODULES:
        raise BuildError(f"unknown TensorRT backend {backend!r}; choose one of {sorted(MODULES)}")
    be = load_backend(backend) if engines else None
    native = backend == "tensorrt-rtx"              # the graphs that backend parses, engines or not
    if be is not None and not native:
        register_plugins(be, {op.op_type for op in OPS if op.torch_name != "merge_attn_states"})
    rank_dir = Path(rank_dir)
    rank_dir.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    specs = graph_specs(cfg, capacities, block_size=block_size, max_seq_len=max_seq_len, dtype=dtype,
                        kv_dtype=kv_dtype or dtype, kv_scale=kv_scale)
    table, reports = None, []
    for i, spec in enumerate(specs, 1):
        log.info("[%d/%d] %s: export (%s graph)", i, len(specs), spec.name, "native" if native else "plugin")
        path = export_graph(model, cfg, spec, rank_dir / f"{spec.name}.onnx", native=native)
        table = share_weights([path], table=table)
        if check:
            log.info("[%d/%d] %s: onnxruntime check", i, len(specs), spec.name)
            check_graph(path, model, cfg, spec, native=native)
        if be is not None:
            log.info("[%d/%d] %s: engine", i, len(specs), spec.name)
            reports.append(build_engine(be, path, rank_dir / f"{spec.name}.engine", options))
    return reports
