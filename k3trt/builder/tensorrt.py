"""TensorRT and TensorRT-RTX engines from the exported ONNX graphs, one module for both: the
nodes a parser cannot import (blocking_nodes), the layers it makes of a graph (parsed_layers), and
one graph's engine (build_engine). Backend discovery and the checks before a build:
builder/backends.py; a whole rank's graphs and engines (content-keyed reuse, worker processes):
builder/rank.py; the plugin library: k3trt/trt_plugin/ (docs/trt_plugins.md).

Both backends parse the *plugin* graphs: each k3trt node (domain ``k3trt``) becomes the
``IPluginV3`` plugin of the C++ library k3trt/trt_plugin/ registered as ``k3trt::<op_type>/1``,
the one implementation of the plugins for both backends. build_engine loads the library
(trt_plugin/loader.py: ``IPluginRegistry.load_library``; for TensorRT-RTX first the
``libtensorrt_rtx.so`` name its ONNX parser dlopens) and enables the preview feature
``ALIASED_PLUGIN_IO_10_03``, so that MlaCacheWrite writes the cache in place.

Backends (imported lazily; neither is needed to import k3trt):
    tensorrt       full TensorRT >= 10.8 (``pip install tensorrt``; not installable in this
                   workplace: this path runs in CI against tests/fake_tensorrt.py, which checks
                   the API contracts it relies on). Builds for the GPU it runs on.
    tensorrt-rtx   TensorRT-RTX 1.7 (module ``tensorrt_rtx_bindings``). Builds on a CPU-only
                   machine (AOT) for SM75/80/86/89/120/121. Plugins from Python do not work there:
                   a ``IPluginCreatorV3Quick`` (what ``tensorrt.plugin`` uses) is refused ("imports
                   IPluginV3 plugins registered with an IPluginCreatorV3One creator only"), and the
                   network API has no add_plugin*; C++ ``IPluginCreatorV3One`` libraries load.
                   ``BuildOptions.lowering="native"`` is the explicit fallback without the library:
                   every k3trt op lowered to standard ONNX (onnx_ops.native_lowerings: the MLA
                   einsum over the full block table, every expert on every token, the KDA
                   recurrence unrolled, so prefill capacities <= 64).
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

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3trt.builder.backends import BuildError, check_target
from k3trt.engine.backends import Backend
from k3trt.trt_plugin.loader import load_into

log = logging.getLogger(__name__)

WEIGHT_INPUT_MIN_ELEMENTS = 4096     # smaller initializers stay constants (norm weights, biases)


# ------------------------------------------------------------------------------ parsing
LOWERINGS = ("plugin", "native")     # how k3trt ops reach the engine: plugin layers, or the native fallback


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


def parsed_layers(backend: Backend, onnx_path: str | Path, plugin_library: Path | None = None) -> list[tuple[str, str]]:
    """(layer name, layer type) of the network the parser makes of a graph (with the plugin
    library loaded when given): what the engine is built from."""
    trt = backend.trt
    if plugin_library is not None:
        load_into(trt, plugin_library, rtx=backend.is_rtx)
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(_strongly_typed(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"{backend.name} cannot parse {Path(onnx_path).name}: " + "; ".join(errors))
    return [(network.get_layer(i).name, str(network.get_layer(i).type).split(".")[-1])
            for i in range(network.num_layers)]


# ------------------------------------------------------------------------------ building
@dataclass(frozen=True)
class BuildOptions:
    target: str | None = None                       # sm120 … (RTX: required; full TRT: the local GPU)
    weights_as_inputs: bool = True                  # see the module doc
    workspace_bytes: int | None = None               # None: the backend's default (RTX on a CPU-only
                                                    # machine fails to allocate an explicit 1 GiB pool)
    timing_cache: Path | None = None                # full TRT only (RTX: no-op)
    lowering: str = "plugin"                        # LOWERINGS; "native": RTX only, the fallback (module doc)
    plugin_library: Path | None = None              # the k3trt plugin library (plugin graphs; rank.py builds it)
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
    import onnx  # noqa: PLC0415 (optional: onnx)
    from onnx import helper  # noqa: PLC0415 (optional: onnx)

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
    plugins = options.lowering == "plugin"
    if plugins:
        if options.plugin_library is None:
            raise BuildError(f"{onnx_path.name}: a plugin graph needs BuildOptions.plugin_library (the k3trt plugin "
                             "library, k3trt.trt_plugin.loader.library_for)")
        load_into(trt, options.plugin_library, rtx=backend.is_rtx)
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
    if plugins:
        # MlaCacheWrite's cache_out aliases its cache input; without this TensorRT refuses the aliasing
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
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
    import onnx  # noqa: PLC0415 (optional: onnx)

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
