"""How a plugin op appears in an exported ONNX graph: the data each op module declares beside its
torch op (``ONNX = (OnnxOp(...), ...)``), collected in ``k3trt.plugins.ONNX_OPS`` and consumed by
builder/onnx_ops.py (schemas, exporter translations, onnxruntime ops, native lowerings).

An ``OnnxOp`` names the torch op (``k3trt::<torch_name>``), the node's op_type (which is also the
TensorRT plugin name), the tensor inputs and outputs with their allowed ONNX types, and optionally
``native``: a plain-torch form that torch.export traces into standard ONNX (static shapes, no host
syncs) for a backend that cannot load plugins. Every non-tensor argument of the torch op becomes
a node attribute (bool as INT 0/1): a plugin's configuration is fixed at build time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

FLOATS = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
CACHE = FLOATS + ("tensor(float8e4m3fn)",)
I32 = ("tensor(int32)",)
I64 = ("tensor(int64)",)
F32 = ("tensor(float)",)


@dataclass(frozen=True)
class Param:
    name: str
    types: tuple[str, ...]


def params(names: str, types: tuple[str, ...]) -> tuple[Param, ...]:
    """One Param per space-separated name, all of `types`."""
    return tuple(Param(n, types) for n in names.split())


@dataclass(frozen=True)
class OnnxOp:
    torch_name: str                      # k3trt::<torch_name>
    op_type: str                         # ONNX node op_type = TensorRT plugin name
    inputs: tuple[Param, ...]            # the torch op's tensor arguments, in order
    outputs: tuple[Param, ...]
    doc: str
    native: Callable | None = None       # the standard-ONNX lowering (export_mode(native=True))

    @property
    def torch_op(self):
        return getattr(torch.ops.k3trt, self.torch_name)

    def schema_args(self) -> list:
        return list(self.torch_op.default._schema.arguments)

    def attributes(self) -> list[tuple[str, str, Any]]:
        """(name, kind, default) of every non-tensor argument; kind in int | float | str."""
        out = []
        for a in self.schema_args():
            kind = str(a.type)
            if kind == "Tensor":
                continue
            kind = {"bool": "int", "SymInt": "int"}.get(kind, kind)
            if kind not in ("int", "float", "str"):
                raise TypeError(f"{self.torch_name}: argument {a.name} has type {a.type}, "
                                "which has no ONNX attribute form")
            out.append((a.name, kind, a.default_value if a.has_default_value() else None))
        return out
