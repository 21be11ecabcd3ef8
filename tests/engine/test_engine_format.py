"""The engine format is the runtime's only tie to the builder: running an engine imports no
builder module (so not the ONNX exporter), and the engine package imports neither side."""

import json
import subprocess
import sys

RUNTIME_MODULES = ("k3trt.runtime", "k3trt.runtime.llm", "k3trt.runtime.trt_session", "k3trt.runtime.oneshot",
                   "k3trt.runtime.onnx_session", "k3trt.runtime.engine_io", "k3trt.plugins.onnx_ort",
                   "k3trt.runtime.speculative.layer_skip", "k3trt.serve", "k3trt.serve.app", "k3trt.triton",
                   "k3trt.cli")
ENGINE_MODULES = ("k3trt.engine", "k3trt.engine.engine_dir", "k3trt.engine.writer", "k3trt.engine.build_config",
                  "k3trt.engine.capacities", "k3trt.engine.graph_io", "k3trt.engine.backends")


def _loaded_after_import(modules: tuple[str, ...]) -> list[str]:
    """The k3trt modules in sys.modules after importing `modules` in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}:\n"
            "    importlib.import_module(m)\n"
            "print(json.dumps(sorted(k for k in sys.modules if k.startswith('k3trt'))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_runtime_imports_no_builder_module():
    loaded = _loaded_after_import(RUNTIME_MODULES)
    assert set(RUNTIME_MODULES) <= set(loaded)
    assert [m for m in loaded if m.startswith("k3trt.builder")] == []


def test_the_engine_package_imports_neither_side():
    loaded = _loaded_after_import(ENGINE_MODULES)
    sides = ("k3trt.builder", "k3trt.runtime", "k3trt.model", "k3trt.plugins", "k3trt.serve", "k3trt.triton")
    assert [m for m in loaded if m.startswith(tuple(f"{s}." for s in sides)) or m in sides] == []
