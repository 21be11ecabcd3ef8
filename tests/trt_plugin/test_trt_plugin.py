"""The C++ TensorRT plugin library on the CPU: it builds (one architecture, sm_120, cached), exports
TensorRT's plugin-library entry points, its creators are the ONNX node contract (names, namespace,
version, one field per torch-op scalar in order and kind), and each plugin's build-phase answers
(output dtypes and shapes, formats, configure, serialize -> runtime plugin -> onShapeChange, through
the harness shim) agree with the torch references on every case of k3trt.trt_plugin.cases.
The RTX reproductions run in subprocesses so that an abort cannot take pytest down."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3trt.builder.onnx_ops import OPS, register_schemas
from k3trt.trt_plugin.build import (
    PluginBuildError,
    build_harness,
    build_library,
    normalize_arch,
    trt_include_dir,
)
from k3trt.trt_plugin.cases import all_cases
from k3trt.trt_plugin.harness import HarnessError, PluginHarness

ARCH = ("sm_120",)
REPO = Path(__file__).resolve().parents[2]
needs_rtx = pytest.mark.skipif(not importlib.util.find_spec("tensorrt_rtx_bindings"),
                               reason="TensorRT-RTX not installed (pip install tensorrt-rtx-cu13-libs==1.7.1.116 "
                                      "tensorrt-rtx-cu13-bindings==1.7.1.116)")
try:
    trt_include_dir()
    HEADERS = True
except PluginBuildError:
    HEADERS = False
pytestmark = pytest.mark.skipif(not HEADERS, reason="TensorRT headers not found (set K3TRT_TRT_INCLUDE)")


@pytest.fixture(scope="module")
def library() -> Path:
    return build_library(ARCH)


@pytest.fixture(scope="module")
def harness(library):
    return PluginHarness(library)


def test_library_exports_the_entry_points(library):
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                             check=True).stdout.split()
    assert "getCreators" in symbols and "setLoggerFinder" in symbols
    lib = ctypes.CDLL(str(library))
    assert lib.getCreators and lib.setLoggerFinder
    # hidden visibility: the plugin classes do not leak into the host's symbol space
    assert not any("OpPlugin" in s or "k3trt" in s for s in symbols)


def test_build_is_cached(library):
    assert build_library(ARCH) == library     # the content hash names the file: no rebuild
    assert build_harness() == build_harness()


def test_creators_are_the_onnx_contract(harness):
    register_schemas()          # imports the torch ops whose schemas give the attributes
    kinds = {"int": 5, "float": 1, "str": 6}          # PluginFieldType: kINT32, kFLOAT32, kCHAR
    creators = harness.creators()
    assert sorted(creators) == sorted(op.op_type for op in OPS)
    for op in OPS:
        c = creators[op.op_type]
        assert (c.namespace, c.version) == ("k3trt", "1"), c
        assert list(c.fields) == [(name, kinds[kind]) for name, kind, _ in op.attributes()], op.op_type


def test_build_phase_matches_the_references():
    """Every case's reference outputs (run on the CPU) have the dtypes and shapes the plugin declares."""
    harness = PluginHarness(build_library(ARCH))
    for case in all_cases("tiny", "cpu"):
        spec = harness.output_specs(case.op, [(t.dtype, tuple(t.shape)) for t in case.inputs], case.attrs)
        ref = [(r.dtype, tuple(r.shape)) for r in case.reference()]
        assert list(spec.outputs) == ref, f"{case.op}[{case.name}]"
        assert spec.aliased == ((2,) if case.op == "MlaCacheWrite" else (-1,) * len(ref))


def test_moe_workspace_is_the_routed_rows(harness):
    bf16 = torch.bfloat16
    spec = harness.output_specs("MoeExperts", [(bf16, (5, 64)), (torch.int64, (5, 2)), (torch.float32, (5, 2)),
                                               (bf16, (8, 32, 64)), (bf16, (8, 32, 64)), (bf16, (8, 64, 32))],
                                {"activation": "situ", "beta": 4.0, "linear_beta": 25.0})
    assert spec.workspace == 5 * 2 * 32 * 4       # [T, k, I] fp32: the chosen experts only


@pytest.mark.parametrize("op, attrs, inputs, message", [
    ("MoeExperts", {"activation": "gelu", "beta": 0.0, "linear_beta": 0.0}, None, "createPlugin returned nullptr"),
    ("MlaVerify", {"softmax_scale": 0.1}, None, "createPlugin returned nullptr"),         # q_per_req missing
    ("MlaVerify", {"q_per_req": 2, "softmax_scale": 0.1},
     [(torch.float32, (6, 2, 32)), (torch.float32, (4, 16, 32)), (torch.int32, (2, 2)), (torch.int32, (2,))],
     "onShapeChange"),                                                                   # 6 rows != 2 x 2
    ("MlaVerify", {"q_per_req": 2, "softmax_scale": 0.1},
     [(torch.int32, (4, 2, 32)), (torch.float32, (4, 16, 32)), (torch.int32, (2, 2)), (torch.int32, (2,))],
     "getOutputDataTypes"),
])
def test_refusals_name_the_call(harness, op, attrs, inputs, message):
    specs = inputs or [(torch.float32, (1,))]
    with pytest.raises(HarnessError, match=message):
        harness.output_specs(op, specs, attrs)


def test_missing_headers_say_what_to_set(monkeypatch, tmp_path):
    monkeypatch.setenv("K3TRT_TRT_INCLUDE", str(tmp_path))
    with pytest.raises(PluginBuildError, match="K3TRT_TRT_INCLUDE"):
        build_library(ARCH)


def test_arch_names():
    assert [normalize_arch(a) for a in ("sm_90a", "sm90a", "90a", "sm120", "SM_120")] == \
        ["sm_90a", "sm_90a", "sm_90a", "sm_120", "sm_120"]
    with pytest.raises(ValueError):
        normalize_arch("hopper")


# ------------------------------------------------------------------------------ TensorRT-RTX
def _probe(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "K3TRT_PLUGIN_TRACE": "1"}
    return subprocess.run([sys.executable, "-m", "k3trt.trt_plugin.rtx_probe", *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=REPO, check=False)


@needs_rtx
def test_rtx_builds_sm120_engines_with_every_plugin(library):
    """Each op as the exporter writes the node (domain k3trt, the torch scalars as attributes) parses to
    a PLUGIN_V3 layer and builds an SM120 engine on this CPU; RTX runs the plugin's build capability."""
    r = _probe("--op", "all", "--library", str(library))
    assert r.returncode == 0 and "ALL-BUILT 7" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.stdout.count("'LayerType.PLUGIN_V3')]") == 7
    assert r.stdout.count("LayerType: custom_layer") + r.stdout.count("LayerType: PluginV3") == 7
    for call in ("createPlugin", "getOutputShapes", "supportsFormatCombination", "configurePlugin",
                 "getAliasedInput", "getFieldsToSerialize"):
        assert f"MlaVerify::{call}" in r.stderr, call


@needs_rtx
def test_rtx_parser_aborts_without_the_unversioned_library_name(library):
    """RTX 1.7's ONNX parser dlopens libtensorrt_rtx.so (the wheel ships libtensorrt_rtx.so.1 only):
    without it, it aborts right after createPlugin. If a later RTX fixes this, this test says so."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    r = subprocess.run([sys.executable, "-m", "k3trt.trt_plugin.rtx_probe", "--no-link", "--library", str(library)],
                       capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
                       env={**env, "PYTHONPATH": str(REPO), "K3TRT_PLUGIN_TRACE": "1"})
    assert r.returncode != 0, "RTX no longer needs libtensorrt_rtx.so: drop the link in rtx_probe"
    assert r.stdout.strip().splitlines()[-1] == "STEP MergeAttnStates: parse"
    assert "MergeAttnStates::createPlugin" in r.stderr and "getCapabilityInterface" not in r.stderr
