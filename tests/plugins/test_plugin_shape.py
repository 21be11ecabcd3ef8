"""The plugin package's shape (k3trt/plugins/__init__.py): kernel and reference modules never import
an op module, every op's CUDA registration goes through dispatch.py, whose fallback logs once per
(op, reason), and the ONNX registry the builder consumes is the ops' own descriptions."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

import k3trt.plugins
from k3trt.builder import onnx_ops
from k3trt.plugins import dispatch
from triton_interp import run_fresh

PLUGINS = Path(k3trt.plugins.__file__).parent
OP_MODULES = {"attn_res", "cache_write", "kda", "kda_front", "norm_act", "moe_gemm", "moe_route", "merge", "mla_verify"}
CUDA_OPS = ("attn_res", "mla_cache_write", "kda_recurrent_slots", "kda_chunked", "short_conv_slots", "kda_prep",
            "rms_norm", "gated_act", "kda_out_gate", "moe_gemm", "moe_route", "moe_combine", "merge_attn_states",
            "mla_verify")


def _plugin_imports(path: Path) -> set[str]:
    """The k3trt.plugins modules a file imports, as bare names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names.update([node.module] if node.module else [a.name for a in node.names])
            elif node.module and node.module.startswith("k3trt.plugins."):
                names.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[2] for a in node.names if a.name.startswith("k3trt.plugins."))
    return names


@pytest.mark.parametrize("path", sorted(p for p in PLUGINS.glob("*.py") if p.stem.endswith(("_triton", "_ref"))),
                         ids=lambda p: p.name)
def test_kernel_and_reference_modules_import_no_op_module(path):
    assert not _plugin_imports(path) & OP_MODULES, f"{path.name} imports an op module"


def test_every_op_module_has_its_reference_module():
    for op in OP_MODULES:
        assert (PLUGINS / f"{op}_ref.py").exists(), op
        assert f"{op}_ref" in _plugin_imports(PLUGINS / f"{op}.py"), op


def test_cuda_kernels_are_registered_without_importing_triton():
    code = ("import sys, torch, k3trt.plugins\n"
            f"for op in {CUDA_OPS!r}:\n"
            "    assert torch._C._dispatch_has_kernel_for_dispatch_key('k3trt::' + op, 'CUDA'), op\n"
            "assert 'triton' not in sys.modules, 'importing k3trt.plugins imported triton'\n")
    run_fresh(code)


def test_dispatch_falls_back_once_per_reason(caplog):
    dispatch.log_fallback.cache_clear()
    calls = []

    def reference(*args):
        calls.append(args)
        return "reference"
    with caplog.at_level(logging.WARNING, logger="k3trt.plugins.dispatch"):
        for reason in ("dtype x", "dtype x", "dtype y"):
            assert dispatch.call("some_op", reason, "no_such_module.fn", reference, 1, 2) == "reference"
    assert calls == [(1, 2)] * 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["some_op: Triton kernel does not cover dtype x; using the torch reference",
                        "some_op: Triton kernel does not cover dtype y; using the torch reference"]


def test_dispatch_calls_the_kernel_module_function():
    # any plugins module serves as the "kernel": dcp.local_len(17, 4, 3, 2) is the spec's example
    assert dispatch.call("some_op", None, "dcp.local_len", None, 17, 4, 3, 2) == 4
    assert not dispatch.falls_back("some_op", None)


def test_onnx_registry_is_the_ops_descriptions():
    assert onnx_ops.OPS is k3trt.plugins.ONNX_OPS
    assert len({op.op_type for op in onnx_ops.OPS}) == len({op.torch_name for op in onnx_ops.OPS}) == len(onnx_ops.OPS)
    assert set(onnx_ops.native_lowerings()) == {"mla_verify", "mla_cache_update", "kda_recurrent", "kda_chunked",
                                                "short_conv", "moe_experts"}
    for op in onnx_ops.OPS:
        if op.torch_name not in ("mla_cache_update", "moe_experts"):      # export-only, plugins/graph_ops.py
            tensors = [a.name for a in op.schema_args() if str(a.type) in ("Tensor", "Optional[Tensor]")]
            assert tensors == [p.name for p in op.inputs], op.torch_name
            assert hasattr(torch.ops.k3trt, op.torch_name)
