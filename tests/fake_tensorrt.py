"""A stand-in for the ``tensorrt`` module: the part of its API that k3trt's full-TensorRT build path
calls (builder/tensorrt.py, trt_plugin/loader.py), each call checking the contract TensorRT
documents for it, so that the path runs in CI where TensorRT cannot be installed. Install it with
``install(monkeypatch)``.

What it checks, and how a real TensorRT would answer:
- ``get_plugin_registry().load_library(path)`` loads the real library and reads its creators
  through its ``getCreators`` entry point (the harness shim, k3trt/trt_plugin/harness.py); a
  library without creators gives None. ``get_creator(name, version, namespace)`` looks them up.
- ``Builder.create_network`` needs the STRONGLY_TYPED flag (k3trt's graphs carry their dtypes).
- ``OnnxParser.parse_from_file`` imports a node outside the default ONNX domain only as the plugin
  registered under (op_type, attribute ``plugin_version`` or "1", attribute ``plugin_namespace``
  or the node's domain), and every other attribute must be a field the creator declares;
  otherwise the parse fails with an error naming the node ("plugin not found").
- ``build_serialized_network`` returns None (error logged) for a network with a plugin that
  aliases an output to an input (asked of the real plugin: ``getAliasedInput`` through the
  harness) unless ``PreviewFeature.ALIASED_PLUGIN_IO_10_03`` is on, and for a dynamic input that
  no optimization profile covers.

What it does not do: build or run engines (the plan is a JSON list of the layers), infer shapes,
or check the dtypes and shapes of plugin I/O (tests/test_trt_plugin.py checks those against the
torch references through the harness).
"""

from __future__ import annotations

import enum
import json
import sys

import onnx

__version__ = "10.8.0.fake"


class NetworkDefinitionCreationFlag(enum.IntEnum):
    STRONGLY_TYPED = 5


class PreviewFeature(enum.Enum):
    ALIASED_PLUGIN_IO_10_03 = 4


class LayerType(enum.Enum):
    ONNX_NODE = 0               # any standard ONNX node (the fake does not lower them)
    PLUGIN_V3 = 1


class MemoryPoolType(enum.Enum):
    WORKSPACE = 0


class Logger:
    ERROR, WARNING, INFO = 1, 2, 3

    def __init__(self, severity: int = 2):
        self.severity, self.messages = severity, []

    def log(self, severity: int, msg: str) -> None:
        self.messages.append((severity, msg))


class _Registry:
    def __init__(self):
        self.creators: dict[tuple[str, str, str], object] = {}
        self.harnesses = []

    def load_library(self, path: str):
        from k3trt.trt_plugin.harness import HarnessError, PluginHarness  # noqa: PLC0415 (heavy: builds the harness)

        try:
            harness = PluginHarness(path)
            creators = harness.creators()
        except HarnessError:
            return None
        if not creators:
            return None
        self.harnesses.append(harness)
        for info in creators.values():
            self.creators[(info.name, info.version, info.namespace)] = (info, harness)
        return object()          # a library handle

    def get_creator(self, name: str, version: str, namespace: str = ""):
        found = self.creators.get((name, version, namespace))
        return found[0] if found else None


_REGISTRY = _Registry()


def get_plugin_registry() -> _Registry:
    return _REGISTRY


class _Tensor:
    def __init__(self, name: str, shape: list[int]):
        self.name, self.shape = name, tuple(shape)


class _Layer:
    def __init__(self, name: str, type_: LayerType, aliases: bool = False):
        self.name, self.type, self.aliases = name, type_, aliases


class _Network:
    def __init__(self):
        self.inputs: list[_Tensor] = []
        self.layers: list[_Layer] = []

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def get_input(self, i: int) -> _Tensor:
        return self.inputs[i]

    def get_layer(self, i: int) -> _Layer:
        return self.layers[i]


class _ParserError:
    def __init__(self, node: str, op: str, desc: str):
        self._node, self._op, self._desc = node, op, desc

    def node_name(self) -> str:
        return self._node

    def node_operator(self) -> str:
        return self._op

    def desc(self) -> str:
        return self._desc

    def __str__(self) -> str:
        return f"node {self._node} ({self._op}): {self._desc}"


class OnnxParser:
    def __init__(self, network: _Network, logger: Logger):
        self.network, self.logger, self.errors = network, logger, []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, i: int) -> _ParserError:
        return self.errors[i]

    def parse_from_file(self, path: str) -> bool:
        model = onnx.load(str(path), load_external_data=False)
        inits = {t.name for t in model.graph.initializer}
        for v in model.graph.input:
            if v.name not in inits:
                self.network.inputs.append(_Tensor(v.name, [d.dim_value if d.HasField("dim_value") else -1
                                                            for d in v.type.tensor_type.shape.dim]))
        for i, node in enumerate(model.graph.node):
            name = node.name or f"node_of_{node.output[0]}"
            if node.domain in ("", "ai.onnx"):
                self.network.layers.append(_Layer(name, LayerType.ONNX_NODE))
                continue
            layer = self._plugin_layer(node, name)
            if layer is None:
                return False
            self.network.layers.append(layer)
        return True

    def _plugin_layer(self, node, name: str) -> _Layer | None:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        version = attrs.pop("plugin_version", b"1")
        namespace = attrs.pop("plugin_namespace", node.domain.encode())
        version, namespace = (v.decode() if isinstance(v, bytes) else str(v) for v in (version, namespace))
        found = _REGISTRY.creators.get((node.op_type, version, namespace))
        if found is None:
            self.errors.append(_ParserError(name, node.op_type, f"plugin not found: {namespace}::{node.op_type} "
                                                                f"version {version}"))
            return None
        info, harness = found
        unknown = sorted(set(attrs) - {f for f, _ in info.fields})
        if unknown:
            self.errors.append(_ParserError(name, node.op_type, f"attributes {unknown} are no fields of the creator"))
            return None
        return _Layer(name, LayerType.PLUGIN_V3, aliases=_aliases(harness, node.op_type))


def _aliases(harness, op: str) -> bool:
    """Whether the real plugin declares an aliased output (asked with the op's first tiny case)."""
    from k3trt.trt_plugin.cases import all_cases  # noqa: PLC0415 (heavy: the op references)

    case = next(c for c in all_cases("tiny", "cpu") if c.op == op)
    specs = harness.output_specs(op, [(t.dtype, tuple(t.shape)) for t in case.inputs], case.attrs)
    return any(a >= 0 for a in specs.aliased)


class _Profile:
    def __init__(self):
        self.shapes: dict[str, tuple] = {}

    def set_shape(self, name: str, lo, opt, hi) -> None:
        if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
            raise ValueError(f"profile of {name}: need min <= opt <= max, got {lo} {opt} {hi}")
        self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))


class _Config:
    def __init__(self):
        self.preview: set[PreviewFeature] = set()
        self.profiles: list[_Profile] = []
        self.pools: dict = {}

    def set_preview_feature(self, feature: PreviewFeature, enable: bool) -> None:
        if not isinstance(feature, PreviewFeature):
            raise TypeError(f"set_preview_feature takes a PreviewFeature, got {feature!r}")
        (self.preview.add if enable else self.preview.discard)(feature)

    def set_memory_pool_limit(self, pool: MemoryPoolType, size: int) -> None:
        self.pools[pool] = int(size)

    def add_optimization_profile(self, profile: _Profile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger: Logger):
        self.logger = logger

    def create_network(self, flags: int) -> _Network:
        if not flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)):
            raise ValueError("k3trt builds strongly typed networks: flag STRONGLY_TYPED missing")
        return _Network()

    def create_builder_config(self) -> _Config:
        return _Config()

    def create_optimization_profile(self) -> _Profile:
        return _Profile()

    def build_serialized_network(self, network: _Network, config: _Config):
        aliasing = [layer.name for layer in network.layers if layer.aliases]
        if aliasing and PreviewFeature.ALIASED_PLUGIN_IO_10_03 not in config.preview:
            self.logger.log(Logger.ERROR, f"Aliased I/O used by plugin {aliasing[0]} but "
                                          "PreviewFeature::kALIASED_PLUGIN_IO_10_03 not enabled")
            return None
        covered = {name for p in config.profiles for name in p.shapes}
        for t in network.inputs:
            if any(d < 0 for d in t.shape) and t.name not in covered:
                self.logger.log(Logger.ERROR, f"input {t.name} is dynamic and no optimization profile covers it")
                return None
        return json.dumps([[layer.name, layer.type.name] for layer in network.layers]).encode()


def install(monkeypatch) -> object:
    """Make ``import tensorrt`` give this module (fresh registry) for the test's duration."""
    monkeypatch.setattr(sys.modules[__name__], "_REGISTRY", _Registry())
    monkeypatch.setitem(sys.modules, "tensorrt", sys.modules[__name__])
    return sys.modules[__name__]


__all__ = ["Builder", "LayerType", "Logger", "MemoryPoolType", "NetworkDefinitionCreationFlag", "OnnxParser",
           "PreviewFeature", "get_plugin_registry", "install"]
