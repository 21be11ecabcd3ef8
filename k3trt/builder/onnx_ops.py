"""The k3trt plugin ops as ONNX nodes: the consumer of ``k3trt.plugins.ONNX_OPS`` (each op module
declares its node beside its torch op, plugins/onnx_spec.py), from which come the ONNX schemas
(domain ``k3trt``, so the exporter and ``onnx.checker`` know them), the exporter's translation
functions, the standard-ONNX lowerings, and the onnxruntime Python custom ops that run an exported
graph on the CPU.

Node contract (TensorRT's ONNX parser maps a node of an unknown op to the plugin registered under
the node's op_type, so these names are also the TensorRT plugin names):

    op_type          torch op                       inputs -> outputs (attributes: the op's scalars)
    MlaVerify        k3trt::mla_verify              q, kv_cache, block_table, seq_lens -> out, lse
    MlaCacheWrite    k3trt::mla_cache_update (*)    kv_c, k_pe, cache, slot_mapping -> cache_out
    KdaRecurrent     k3trt::kda_recurrent           q, k, v, g, beta, state -> o, final_state, all_states
    KdaChunked       k3trt::kda_chunked             q, k, v, g, beta, state -> o, final_state
    ShortConv        k3trt::short_conv              x, weight, conv_state -> y, new_state, all_states
    MoeExperts       k3trt::moe_experts (*)         x, ids, weights, w_gate, w_up, w_down -> y
    MergeAttnStates  k3trt::merge_attn_states       out_a, lse_a, out_b, lse_b -> out, lse

(*) export-only functional wrappers defined in export.py (the model calls the mutating
``mla_cache_write`` and loops over experts in Python). Layouts and semantics are the torch ops'
(their docstrings). Bool scalars become INT attributes (0/1); every scalar is an attribute,
never an input, because a plugin's configuration must be fixed at build time.

onnxruntime: the Python custom ops that run the k3trt nodes, and ``ort_session``, live in
plugins/onnx_ort.py (the onnx engine backend's runtime uses them too). Each calls the torch op
itself on the CPU (its reference implementation), so ``check_graph`` compares the exported
graph's *wiring* and the native ONNX parts against the model, not the plugins against
themselves. They are registered for fp32 activations; any other dtype is refused with a message.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable

import torch

from k3trt.builder.export import example_inputs, image_rows, model_cache  # also registers the export-only wrapper ops
from k3trt.engine.graph_io import cache_specs
from k3trt.model.context import StepContext
from k3trt.plugins import ONNX_OPS
from k3trt.plugins.onnx_ort import DOMAIN, ort_session
from k3trt.plugins.onnx_spec import OnnxOp
from k3trt.testing import assert_close

log = logging.getLogger(__name__)

OPSET_VERSION = 1

OPS: tuple[OnnxOp, ...] = ONNX_OPS
BY_TORCH_NAME = {op.torch_name: op for op in OPS}
BY_OP_TYPE = {op.op_type: op for op in OPS}


# ------------------------------------------------------------------------------ ONNX schemas
@functools.cache
def register_schemas() -> None:
    """Register an ``onnx.defs.OpSchema`` per op (once): onnxscript needs it to emit the node, and
    ``onnx.checker`` to check the graph."""
    import onnx.defs  # noqa: PLC0415 (optional: onnx)
    from onnx.defs import OpSchema  # noqa: PLC0415 (optional: onnx)

    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT, "str": OpSchema.AttrType.STRING}
    for op in OPS:
        if onnx.defs.has(op.op_type, DOMAIN):
            continue
        constraints, ins, outs = [], [], []
        for kind, params, dest in (("i", op.inputs, ins), ("o", op.outputs, outs)):
            for j, p in enumerate(params):
                tvar = f"T{kind}{j}"
                constraints.append((tvar, list(p.types), f"{p.name}"))
                dest.append(OpSchema.FormalParameter(p.name, tvar))
        attrs = [OpSchema.Attribute(name, kinds[kind], "", required=default is None)
                 for name, kind, default in op.attributes()]
        onnx.defs.register_schema(OpSchema(op.op_type, DOMAIN, OPSET_VERSION, op.doc, inputs=ins, outputs=outs,
                                           type_constraints=constraints, attributes=attrs))


# ------------------------------------------------------------------------------ exporter side
def _translation(op: OnnxOp) -> Callable:
    """A tracing-mode translation: bind the FX node's arguments by the torch schema, tensors become
    node inputs and scalars attributes (ENVIRONMENT.md: an @onnxscript.script function fails here)."""
    import onnxscript  # noqa: PLC0415 (optional: onnxscript)

    opset = onnxscript.values.Opset(DOMAIN, OPSET_VERSION)
    args = op.schema_args()
    tensor_names = [p.name for p in op.inputs]

    def translate(*call_args, **call_kwargs):
        bound = dict(zip((a.name for a in args), call_args))
        bound.update(call_kwargs)
        missing = [n for n in tensor_names if bound.get(n) is None]
        if missing:
            raise ValueError(f"k3trt::{op.torch_name}: tensor arguments {missing} are missing or None")
        attrs = {}
        for name, kind, default in op.attributes():
            value = bound.get(name, default)
            attrs[name] = int(value) if kind == "int" else value
        return getattr(opset, op.op_type)(*(bound[n] for n in tensor_names), **attrs)

    translate.__name__ = f"k3trt_{op.op_type}"
    return translate


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``."""
    register_schemas()
    return {op.torch_op.default: _translation(op) for op in OPS}


# ------------------------------------------------------------------------------ onnxruntime side
def reference_outputs(model, cfg, spec, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an exported graph must compute: the model run eagerly the way the runtime runs it (a
    plain StepContext: the naive MLA path for prefill, the experts loop)."""
    Q, S = spec.q_per_req, spec.num_seqs
    ctx_lens = tuple(int(n) - Q for n in inputs["seq_lens"])
    ctx = StepContext((Q,) * S, ctx_lens, inputs["slot_mapping"], inputs["block_table"], inputs["kda_slots"],
                      spec.saves_kda_states)
    caches = {t.name: inputs[t.name].clone() for t in cache_specs(cfg, spec)}
    cache = model_cache(cfg, spec, caches)
    with torch.no_grad():
        hidden = model(inputs["input_ids"], ctx, cache, embeds=image_rows(model, inputs))
        logits = model.logits(hidden if spec.kind == "verify" else hidden[-1:])
    return {"logits": logits, **{f"{k}_out": v for k, v in caches.items()}}


def check_graph(onnx_path: str | Path, model, cfg, spec, *, native: bool = False, atol: float = 2e-4,
                rtol: float = 2e-3, seed: int = 1) -> dict[str, float]:
    """Run an exported graph in onnxruntime (CPU) on example inputs (k3trt nodes by the Python ops,
    or none when `native`) and compare every output with the eager model (export.reference_outputs).
    Raises AssertionError naming the output and its worst element; returns max |error| per output."""
    import onnxruntime as ort  # noqa: PLC0415 (optional: onnxruntime)


    if not native and spec.dtype != torch.float32:
        raise ValueError(f"the onnxruntime check of plugin graphs runs fp32 only (the Python ops are "
                         f"registered for fp32); {spec.name} is {spec.dtype}")
    nb, ns = spec.num_seqs * spec.max_blocks + 2, spec.num_seqs + 2
    inputs = example_inputs(cfg, spec, num_blocks=nb, num_slots=ns, generator=torch.Generator().manual_seed(seed))
    ref = reference_outputs(model, cfg, spec, inputs)
    if native:
        sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    else:
        sess = ort_session(onnx_path)
    outs = sess.run(None, {k: v.numpy() for k, v in inputs.items()})
    errors = {}
    for meta, got in zip(sess.get_outputs(), outs):
        got = torch.from_numpy(got)
        assert_close(got, ref[meta.name], dtype=torch.float32, atol=atol, rtol=rtol,
                     name=f"{Path(onnx_path).name}: {meta.name}")
        errors[meta.name] = float((got.double() - ref[meta.name].double()).abs().max()) if got.numel() else 0.0
    log.info("onnxruntime check %s: %d outputs match (worst %.2g)", Path(onnx_path).name, len(errors),
             max(errors.values(), default=0.0))
    return errors


# ------------------------------------------------------------------------------ native lowerings
def native_lowerings() -> dict[str, Callable]:
    """torch-op name -> its export-friendly plain-torch form (``OnnxOp.native``), for a backend that
    cannot load the plugins (TensorRT-RTX from Python, see tensorrt.py). Each is checked against
    its op in tests."""
    return {op.torch_name: op.native for op in OPS if op.native is not None}
