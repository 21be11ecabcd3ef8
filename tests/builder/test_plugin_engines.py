"""Engines that contain the k3trt plugin library: the library recorded in the engine dir and the
refusals when it is missing or different; the full-TensorRT build path run against
tests/fake_tensorrt.py (the API contracts it relies on); `k3trt build-plugins`; and (slow) the
default `k3trt build --backend tensorrt-rtx --target sm120` of the tiny checkpoint, every k3trt
node of every graph a plugin layer."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging

import pytest
from click.testing import CliRunner

import fake_tensorrt
from k3trt.builder import rank as rank_module
from k3trt.builder.backends import BuildError
from k3trt.builder.rank import build_rank
from k3trt.builder.tensorrt import BuildOptions, build_engine, parsed_layers
from k3trt.cli import main
from k3trt.engine import backends as registry
from k3trt.engine.backends import load_backend
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.engine.engine_dir import EngineDirError, read_engine_dir
from k3trt.engine.writer import write_engine_dir
from k3trt.trt_plugin.build import PluginBuildError, build_library, trt_include_dir
from k3trt.trt_plugin.loader import LIBRARY_ENV, library_for, target_archs
from k3trt.trt_plugin.rtx_probe import graph_bytes
from test_tensorrt_rtx import BLOCK, MAX_SEQ, assert_plugin_layers, k3trt_nodes

try:
    trt_include_dir()
    HEADERS = True
except PluginBuildError:
    HEADERS = False
needs_headers = pytest.mark.skipif(not HEADERS, reason="TensorRT headers not found (set K3TRT_TRT_INCLUDE)")
needs_rtx = pytest.mark.skipif(not importlib.util.find_spec("tensorrt_rtx_bindings"),
                               reason="TensorRT-RTX not installed")


# ------------------------------------------------------------------------------ the engine dir's record
def _engine_dir(tmp_path, tiny_ckpt, record):
    def populate(tmp):
        (tmp / "rank0").mkdir()
        (tmp / "rank0" / "verify_b1.engine").write_bytes(b"plan")

    return write_engine_dir(tmp_path / "engine", backend="tensorrt-rtx", target="sm120",
                            model_raw=json.loads((tiny_ckpt / "config.json").read_text()), build=BuildConfig(),
                            capacities=Capacities((1,), (1,), 3), populate=populate, plugin_library=record)


def test_engine_dir_refuses_a_missing_or_different_plugin_library(tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setenv("K3TRT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(LIBRARY_ENV, raising=False)
    lib = tmp_path / "cache" / "trt_plugin" / "libk3trt_plugins-120-0123456789abcdef.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"the library")
    record = {"file": lib.name, "sha256": hashlib.sha256(b"the library").hexdigest(), "archs": ["sm_120"]}
    engine = _engine_dir(tmp_path, tiny_ckpt, record)
    raw = json.loads((engine / "config.json").read_text())
    assert raw["build"]["plugin_library"] == record
    ed = read_engine_dir(engine)
    assert ed.plugin_library == record and ed.build == BuildConfig() and ed.plugin_library_path() == lib

    lib.write_bytes(b"another library")
    with pytest.raises(EngineDirError, match="differs from the one the engines were built with.*"
                                             "k3trt build-plugins --arch sm120"):
        read_engine_dir(engine)
    lib.unlink()
    with pytest.raises(EngineDirError, match="is missing; build it with `k3trt build-plugins --arch sm120`"):
        read_engine_dir(engine)
    other = tmp_path / "elsewhere.so"
    other.write_bytes(b"the library")
    monkeypatch.setenv(LIBRARY_ENV, str(other))
    assert read_engine_dir(engine).plugin_library_path() == other
    read_engine_dir(engine, verify_checksums=False)          # a rebuild reads it without the library


def test_target_archs():
    assert target_archs("sm120") == ("sm_120",)
    assert target_archs("sm90") == ("sm_90a",)
    assert target_archs("sm_86") == ("sm_86",)


@needs_headers
def test_build_plugins_command():
    r = CliRunner().invoke(main, ["build-plugins", "--arch", "sm120"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == str(build_library(("sm_120",)))
    r = CliRunner().invoke(main, ["build-plugins", "--arch", "hopper"])
    assert r.exit_code != 0 and "expected sm_XY" in r.output


# ------------------------------------------------------------------------------ full TensorRT, faked
@pytest.fixture
def fake_trt(monkeypatch):
    """`import tensorrt` gives tests/fake_tensorrt.py, on a machine whose GPU is an sm120."""
    trt = fake_tensorrt.install(monkeypatch)
    monkeypatch.setattr(registry, "local_gpu_target", lambda: "sm120")
    monkeypatch.setattr(rank_module, "local_gpu_target", lambda: "sm120")
    return trt


@needs_headers
def test_fake_parser_looks_plugins_up_by_name_namespace_version(fake_trt, tmp_path):
    library = library_for(("sm_120",)).path
    path = tmp_path / "g.onnx"
    path.write_bytes(graph_bytes("MlaCacheWrite"))
    be = load_backend("tensorrt")
    with pytest.raises(BuildError, match="plugin not found: k3trt::MlaCacheWrite"):
        parsed_layers(be, path)                                     # the library is not loaded yet
    assert parsed_layers(be, path, library) == [("node_of_cache_out", "PLUGIN_V3")]
    import onnx  # noqa: PLC0415 (optional: onnx)
    model = onnx.load(str(path))
    model.graph.node[0].attribute.append(onnx.helper.make_attribute("plugin_namespace", "other"))
    onnx.save(model, str(path))
    with pytest.raises(BuildError, match="plugin not found: other::MlaCacheWrite"):
        parsed_layers(be, path)


@needs_headers
def test_fake_builder_needs_the_aliased_io_preview_feature(fake_trt, tmp_path):
    library = library_for(("sm_120",)).path
    path = tmp_path / "g.onnx"
    path.write_bytes(graph_bytes("MlaCacheWrite"))
    be = load_backend("tensorrt")
    logger = fake_trt.Logger()
    builder = fake_trt.Builder(logger)
    parsed_layers(be, path, library)
    network = builder.create_network(1 << int(fake_trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert fake_trt.OnnxParser(network, logger).parse_from_file(str(path))
    config = builder.create_builder_config()
    assert builder.build_serialized_network(network, config) is None
    assert "kALIASED_PLUGIN_IO_10_03 not enabled" in logger.messages[-1][1]
    config.set_preview_feature(fake_trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    assert builder.build_serialized_network(network, config) is not None
    report = build_engine(be, path, tmp_path / "g.engine", BuildOptions(target="sm120", plugin_library=library))
    assert json.loads(report.engine.read_bytes()) == [["node_of_cache_out", "PLUGIN_V3"]]


@needs_headers
def test_full_tensorrt_build_path_against_the_fake(fake_trt, tiny_model, tmp_path):
    """build_rank for full TensorRT: plugin graphs, the library built for the GPU's target and
    loaded through the registry, every k3trt node a plugin layer, one weights.bin."""
    cfg, model = tiny_model
    caps = Capacities(verify=(1,), prefill=(1,), spec_tokens=3)
    reports = build_rank(model, cfg, caps, tmp_path, backend="tensorrt", block_size=BLOCK, max_seq_len=MAX_SEQ,
                         options=BuildOptions())
    assert [r.name for r in reports] == ["verify_b1", "prefill_t1"]
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["weights.bin"]
    for r in reports:
        layers = dict(json.loads(r.engine.read_bytes()))
        nodes = k3trt_nodes(tmp_path / f"{r.name}.onnx")
        assert nodes and all(layers[n] == "PLUGIN_V3" for n in nodes)
        assert len(r.weight_inputs) > 10
    assert_plugin_layers(load_backend("tensorrt"), tmp_path, [r.name for r in reports])


# ------------------------------------------------------------------------------ the default RTX build
@needs_rtx
@needs_headers
@pytest.mark.slow
def test_default_rtx_build_has_a_plugin_layer_for_every_k3trt_node(tiny_ckpt, tmp_path, caplog):
    """`k3trt build CKPT --backend tensorrt-rtx --target sm120`, defaults only."""
    caplog.set_level(logging.INFO)
    out = tmp_path / "engine"
    r = CliRunner().invoke(main, ["build", str(tiny_ckpt), "-o", str(out), "--backend", "tensorrt-rtx",
                                  "--target", "sm120"])
    assert r.exit_code == 0, r.output
    ed = read_engine_dir(out)
    library = ed.plugin_library_path()
    assert ed.plugin_library["archs"] == ["sm_120"]
    names = [f"verify_b{b}" for b in ed.capacities.verify] + [f"prefill_t{t}" for t in ed.capacities.prefill]
    assert max(ed.capacities.prefill) == ed.build.max_seq_len == 4096 and len(names) == 19   # T stops at max_seq_len
    assert sorted(p.name for p in ed.rank_dir.glob("*.bin")) == ["weights.bin"]
    weights = (ed.rank_dir / "weights.bin").stat().st_size
    assert all((ed.rank_dir / f"{n}.engine").stat().st_size < weights for n in names)
    assert_plugin_layers(load_backend("tensorrt-rtx"), ed.rank_dir, names, library)
