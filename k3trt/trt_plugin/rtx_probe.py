"""Does TensorRT-RTX take the k3trt plugin library? Build the library for sm_120, load it into RTX's
plugin registry, parse one-node ONNX graphs (a k3trt node as the exporter writes it) and build a
serialized engine for SM120 from each on this (CPU-only) machine.

    python -m k3trt.trt_plugin.rtx_probe [--op MergeAttnStates|MlaVerify|...|all] [--library PATH] [--no-link]

RTX's ONNX parser dlopens ``libtensorrt_rtx.so`` (the unversioned name) when it imports a plugin
node, and the wheel ships only ``libtensorrt_rtx.so.1``: without that name the parser throws
inside a noexcept path and the process aborts ("terminate called without an active exception").
So the probe first loads the ``libtensorrt_rtx.so`` name shim (trt_plugin/loader.py), as the
engine builder does; ``--no-link`` skips that and shows the abort.

Each step prints ``STEP <name>`` before it runs and ``DONE <name> ...`` after, flushed, so that
when RTX aborts the process the last STEP line names the call that did not return; run it in a
subprocess (tests/trt_plugin/test_trt_plugin.py does). docs/trt_plugins.md records what it shows.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
from onnx import TensorProto, helper

from k3trt.builder.onnx_ops import BY_OP_TYPE
from k3trt.trt_plugin.build import build_library
from k3trt.trt_plugin.cases import all_cases
from k3trt.trt_plugin.loader import OP_TYPES, preload_rtx_name

ONNX_DTYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
               torch.bfloat16: TensorProto.BFLOAT16, torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN,
               torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64}


def graph_bytes(op: str) -> bytes:
    """A one-node graph as the exporter writes it (domain ``k3trt``, the torch op's scalars as
    attributes, no plugin_namespace / plugin_version), with the dtypes and shapes of the op's first
    tiny case in k3trt.trt_plugin.cases."""
    case = next(c for c in all_cases("tiny", "cpu") if c.op == op)
    contract = BY_OP_TYPE[op]
    ins = [(p.name, t) for p, t in zip(contract.inputs, case.inputs)]
    outs = [(p.name, t) for p, t in zip(contract.outputs, case.reference())]
    info = [helper.make_tensor_value_info(n, ONNX_DTYPES[t.dtype], list(t.shape)) for n, t in ins + outs]
    node = helper.make_node(op, [n for n, _ in ins], [n for n, _ in outs], domain="k3trt", **case.attrs)
    graph = helper.make_graph([node], f"probe_{op}", info[:len(ins)], info[len(ins):])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("k3trt", 1)])
    return model.SerializeToString()


def step(name: str, fn):
    print(f"STEP {name}", flush=True)
    t0 = time.perf_counter()
    out = fn()
    print(f"DONE {name} ({time.perf_counter() - t0:.2f}s): {out!r}"[:600], flush=True)
    return out


def probe(ops: list[str], library: str | None) -> int:
    import tensorrt_rtx_bindings as trt  # noqa: PLC0415 (optional: tensorrt_rtx)

    class Logger(trt.ILogger):
        """Warnings and errors, plus the builder's per-layer lines (the engine's layer information)."""
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            if severity <= trt.ILogger.Severity.WARNING or "LayerType:" in msg:
                print(f"TRT[{severity.name}] {msg}", flush=True)

    lib = library or str(step("build_library", lambda: build_library(("sm_120",))))
    logger = Logger()
    registry = trt.get_plugin_registry()
    step("load_library", lambda: registry.load_library(lib))
    step("creators", lambda: sorted(f"{c.plugin_namespace}::{c.name}/{c.plugin_version}"
                                    for c in registry.all_creators if c.plugin_namespace == "k3trt"))
    failed = [op for op in ops if not _build_one(trt, logger, registry, op)]
    print("FAILED" if failed else "ALL-BUILT", failed or len(ops), flush=True)
    return 1 if failed else 0


def _build_one(trt, logger, registry, op: str) -> bool:
    step(f"{op}: get_creator", lambda: registry.get_creator(op, "1", "k3trt"))
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    ok = step(f"{op}: parse", lambda: parser.parse(graph_bytes(op)))
    if not ok:
        print("PARSE-ERRORS", [str(parser.get_error(i)) for i in range(parser.num_errors)], flush=True)
        return False
    step(f"{op}: layers", lambda: [(network.get_layer(i).name, str(network.get_layer(i).type))
                            for i in range(network.num_layers)])
    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(trt.ComputeCapability.SM120, 0)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    # MlaCacheWrite's aliased cache: RTX refuses aliased plugin I/O unless this is on
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    plan = step(f"{op}: build_serialized_network", lambda: builder.build_serialized_network(network, config))
    if plan is None:
        print(f"RESULT {op}: build returned None (the log above has the reason)", flush=True)
        return False
    # (deserializing needs a GPU of the target: here it fails with "CUDA driver version is insufficient")
    print(f"RESULT {op}: engine {plan.nbytes} bytes for SM120", flush=True)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k3trt.trt_plugin.rtx_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=[*OP_TYPES, "all"], default="MergeAttnStates")
    parser.add_argument("--library", help="a built plugin library (default: build_library for sm_120)")
    parser.add_argument("--no-link", action="store_true", help="do not provide libtensorrt_rtx.so (shows the abort)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.no_link:
        step("rtx_name_shim", preload_rtx_name)
    sys.exit(probe(list(OP_TYPES) if args.op == "all" else [args.op], args.library))


if __name__ == "__main__":
    main()
