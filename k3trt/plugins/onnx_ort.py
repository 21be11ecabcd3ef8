"""The k3trt nodes of an exported graph run by onnxruntime on the CPU: one onnxruntime-extensions
Python op per node type of ``k3trt.plugins.ONNX_OPS``, each calling its torch op (the reference
on the CPU). Shared by the builder's equivalence check (builder/onnx_ops.check_graph) and the
onnx engine backend's session (runtime/onnx_session.py).

onnxruntime-extensions runs Python ops of domain ``ai.onnx.contrib`` only, so ``ort_session``
renames the k3trt nodes' domain in an in-memory copy of the graph; the graph's external weights
are read from its own directory, which is never written. onnxruntime-extensions fixes one input
type list per op type: the Python ops are registered for fp32 activations.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

import k3trt.plugins.graph_ops  # noqa: F401  (registers the functional ops the graphs call)
from k3trt.plugins import ONNX_OPS
from k3trt.plugins.onnx_spec import OnnxOp

log = logging.getLogger(__name__)

DOMAIN = "k3trt"
ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"


@functools.cache
def register_ort_ops() -> None:
    """Register one onnxruntime-extensions Python op per k3trt op (fp32 activations), once."""
    from onnxruntime_extensions import (  # noqa: PLC0415 (optional: onnxruntime-extensions)
        PyCustomOpDef,
        onnx_op,
    )

    dt = {"tensor(float)": PyCustomOpDef.dt_float, "tensor(int32)": PyCustomOpDef.dt_int32,
          "tensor(int64)": PyCustomOpDef.dt_int64}
    attr_dt = {"int": PyCustomOpDef.dt_int64, "float": PyCustomOpDef.dt_float, "str": PyCustomOpDef.dt_string}
    for op in ONNX_OPS:
        onnx_op(op_type=op.op_type,
                inputs=[dt[p.types[0]] for p in op.inputs], outputs=[dt[p.types[0]] for p in op.outputs],
                attrs={name: attr_dt[kind] for name, kind, _ in op.attributes()})(_ort_body(op))


def _ort_body(op: OnnxOp) -> Callable:
    bool_attrs = {a.name for a in op.schema_args() if str(a.type) == "bool"}
    attr_names = [name for name, _, _ in op.attributes()]

    def body(*arrays, **attrs):
        tensors = [torch.from_numpy(a.copy()) for a in arrays]
        kwargs = {k: (bool(v) if k in bool_attrs else v) for k, v in attrs.items() if k in attr_names}
        named = dict(zip((p.name for p in op.inputs), tensors))
        with torch.inference_mode():
            out = op.torch_op(**named, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        res = tuple(o.detach().contiguous().numpy() for o in outs)
        return res if len(res) > 1 else res[0]

    body.__name__ = f"ort_{op.op_type}"
    return body


def to_ort_domain(model) -> None:
    """Rename the k3trt nodes' domain (in place, on a copy the caller owns) for onnxruntime-extensions."""
    for node in model.graph.node:
        if node.domain == DOMAIN:
            node.domain = ORT_CONTRIB_DOMAIN
    imports = [o for o in model.opset_import if o.domain not in (DOMAIN, ORT_CONTRIB_DOMAIN)]
    del model.opset_import[:]
    model.opset_import.extend(imports)
    model.opset_import.add(domain=ORT_CONTRIB_DOMAIN, version=1)


def ort_session(onnx_path: str | Path, *, threads: int = 0):
    """An onnxruntime CPU session for an exported graph, its k3trt nodes run by the Python ops.
    The renamed graph is handed over in memory; its external data is read from the graph's
    directory (onnxruntime's external-initializers folder), which stays untouched."""
    import onnx  # noqa: PLC0415 (optional: onnx)
    import onnxruntime as ort  # noqa: PLC0415 (optional: onnxruntime)
    from onnxruntime_extensions import get_library_path  # noqa: PLC0415 (optional: onnxruntime-extensions)

    register_ort_ops()
    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    to_ort_domain(model)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(get_library_path())
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                  str(onnx_path.parent.resolve()))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
