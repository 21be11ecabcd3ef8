"""The k3trt plugin ops as ONNX nodes: one table, from which come the ONNX schemas (domain
``k3trt``, so the exporter and ``onnx.checker`` know them), the exporter's translation functions,
and the onnxruntime Python custom ops that run an exported graph on the CPU.

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

onnxruntime: ``onnxruntime-extensions`` runs Python ops of domain ``ai.onnx.contrib`` only, so
``ort_session`` renames the k3trt nodes' domain in a copy of the graph. Each Python op calls the
torch op itself on the CPU (its reference implementation), so the check compares the exported
graph's *wiring* and the native ONNX parts against the model, not the plugins against themselves.
onnxruntime-extensions fixes one input type list per op type: the Python ops are registered for
fp32 activations (the tiny-preset check); any other dtype is refused with a message.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

DOMAIN = "k3trt"
OPSET_VERSION = 1
ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"

_FLOATS = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
_CACHE = _FLOATS + ("tensor(float8e4m3fn)",)
_I32 = ("tensor(int32)",)
_I64 = ("tensor(int64)",)
_F32 = ("tensor(float)",)


@dataclass(frozen=True)
class Param:
    name: str
    types: tuple[str, ...]


@dataclass(frozen=True)
class OnnxOp:
    torch_name: str                      # k3trt::<torch_name>
    op_type: str                         # ONNX node op_type = TensorRT plugin name
    inputs: tuple[Param, ...]            # the torch op's tensor arguments, in order
    outputs: tuple[Param, ...]
    doc: str

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


def _p(names: str, types: tuple[str, ...]) -> tuple[Param, ...]:
    return tuple(Param(n, types) for n in names.split())


OPS: tuple[OnnxOp, ...] = (
    OnnxOp("mla_verify", "MlaVerify",
           _p("q", _FLOATS) + _p("kv_cache", _CACHE) + _p("block_table seq_lens", _I32),
           _p("out", _FLOATS) + _p("lse", _F32),
           "Absorbed-MLA attention of q_per_req rows per request over the paged latent cache."),
    OnnxOp("mla_cache_update", "MlaCacheWrite",
           _p("kv_c k_pe", _FLOATS) + _p("cache", _CACHE) + _p("slot_mapping", _I64),
           _p("cache_out", _CACHE),
           "The cache with rows written at slot_mapping (negative slots skipped); in place in an engine."),
    OnnxOp("kda_recurrent", "KdaRecurrent",
           _p("q k v g beta", _FLOATS) + _p("state", _F32),
           _p("o", _FLOATS) + _p("final_state all_states", _F32),
           "Token-by-token KDA delta rule; all_states is empty unless save_all."),
    OnnxOp("kda_chunked", "KdaChunked",
           _p("q k v g beta", _FLOATS) + _p("state", _F32),
           _p("o", _FLOATS) + _p("final_state", _F32),
           "Chunked (WY) KDA delta rule for prefill."),
    OnnxOp("short_conv", "ShortConv",
           _p("x weight conv_state", _FLOATS),
           _p("y new_state all_states", _FLOATS),
           "Causal depthwise conv + SiLU over a rolling window."),
    OnnxOp("moe_experts", "MoeExperts",
           _p("x", _FLOATS) + _p("ids", _I64) + _p("weights", _F32) + _p("w_gate w_up w_down", _FLOATS),
           _p("y", _FLOATS),
           "Routed experts: sum over the chosen experts of weight * down(act(gate(x), up(x)))."),
    OnnxOp("merge_attn_states", "MergeAttnStates",
           _p("out_a", _FLOATS) + _p("lse_a", _F32) + _p("out_b", _FLOATS) + _p("lse_b", _F32),
           _p("out", _FLOATS) + _p("lse", _F32),
           "Exact LSE merge of two partial attention results."),
)
BY_TORCH_NAME = {op.torch_name: op for op in OPS}
BY_OP_TYPE = {op.op_type: op for op in OPS}


def _ensure_torch_ops() -> None:
    import k3trt.plugins  # noqa: F401  (registers the plugin ops)
    import k3trt.builder.export  # noqa: F401  (registers the export-only wrapper ops)


# ------------------------------------------------------------------------------ ONNX schemas
_registered = False


def register_schemas() -> None:
    """Register an ``onnx.defs.OpSchema`` per op (idempotent): onnxscript needs it to emit the
    node, and ``onnx.checker`` to check the graph."""
    global _registered
    if _registered:
        return
    import onnx.defs
    from onnx.defs import OpSchema

    _ensure_torch_ops()
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
    _registered = True


# ------------------------------------------------------------------------------ exporter side
def _translation(op: OnnxOp) -> Callable:
    """A tracing-mode translation: bind the FX node's arguments by the torch schema, tensors become
    node inputs and scalars attributes (ENVIRONMENT.md: an @onnxscript.script function fails here)."""
    import onnxscript

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
_ort_registered = False


def register_ort_ops() -> None:
    """Register one onnxruntime-extensions Python op per k3trt op (fp32 activations)."""
    global _ort_registered
    if _ort_registered:
        return
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    _ensure_torch_ops()
    dt = {"tensor(float)": PyCustomOpDef.dt_float, "tensor(int32)": PyCustomOpDef.dt_int32,
          "tensor(int64)": PyCustomOpDef.dt_int64}
    attr_dt = {"int": PyCustomOpDef.dt_int64, "float": PyCustomOpDef.dt_float, "str": PyCustomOpDef.dt_string}
    for op in OPS:
        onnx_op(op_type=op.op_type,
                inputs=[dt[p.types[0]] for p in op.inputs], outputs=[dt[p.types[0]] for p in op.outputs],
                attrs={name: attr_dt[kind] for name, kind, _ in op.attributes()})(_ort_body(op))
    _ort_registered = True


def _ort_body(op: OnnxOp) -> Callable:
    bool_attrs = {a.name for a in op.schema_args() if str(a.type) == "bool"}
    attr_names = [name for name, _, _ in op.attributes()]

    def body(*arrays, **attrs):
        tensors = [torch.from_numpy(a.copy()) for a in arrays]
        kwargs = {k: (bool(v) if k in bool_attrs else v) for k, v in attrs.items() if k in attr_names}
        named = dict(zip((p.name for p in op.inputs), tensors))
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
    The renamed copy is written beside the original (onnxruntime refuses external data outside
    the model's directory, symlinks included) and removed once the session has loaded it."""
    import onnx
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    register_ort_ops()
    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    to_ort_domain(model)
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(get_library_path())
    opts.intra_op_num_threads = threads
    fd, tmp = tempfile.mkstemp(prefix=f".{onnx_path.stem}.", suffix=".ort.onnx", dir=onnx_path.parent)
    os.close(fd)
    try:
        onnx.save(model, tmp)
        return ort.InferenceSession(tmp, opts, providers=["CPUExecutionProvider"])
    finally:
        os.unlink(tmp)


def reference_outputs(model, cfg, spec, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an exported graph must compute: the model run eagerly the way the runtime runs it (a
    plain StepContext: the naive MLA path for prefill, the experts loop)."""
    from k3trt.builder.export import model_cache
    from k3trt.engine.graph_io import cache_specs
    from k3trt.model.context import StepContext

    Q, S = spec.q_per_req, spec.num_seqs
    ctx_lens = tuple(int(n) - Q for n in inputs["seq_lens"])
    ctx = StepContext((Q,) * S, ctx_lens, inputs["slot_mapping"], inputs["block_table"], inputs["kda_slots"],
                      spec.saves_kda_states)
    caches = {t.name: inputs[t.name].clone() for t in cache_specs(cfg, spec)}
    cache = model_cache(cfg, spec, caches)
    with torch.no_grad():
        hidden = model(inputs["input_ids"], ctx, cache)
        logits = model.logits(hidden if spec.kind == "verify" else hidden[-1:])
    return {"logits": logits, **{f"{k}_out": v for k, v in caches.items()}}


def check_graph(onnx_path: str | Path, model, cfg, spec, *, native: bool = False, atol: float = 2e-4,
                rtol: float = 2e-3, seed: int = 1) -> dict[str, float]:
    """Run an exported graph in onnxruntime (CPU) on example inputs (k3trt nodes by the Python ops,
    or none when `native`) and compare every output with the eager model (export.reference_outputs).
    Raises AssertionError naming the output and its worst element; returns max |error| per output."""
    import onnxruntime as ort

    from k3trt.builder.export import example_inputs
    from k3trt.testing import assert_close

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
# Plain-torch forms of the ops that torch.export can trace into standard ONNX (static shapes, no
# host syncs), for a backend that cannot load the plugins (TensorRT-RTX from Python, see
# tensorrt.py). Exact in semantics, not in cost: MoE computes every expert for every token and
# KDA's chunked form becomes the unrolled recurrence. Each is checked against its op in tests.
def _native_mla_verify(q, kv_cache, block_table, seq_lens, q_per_req, softmax_scale, kv_scale=1.0, d_v=512,
                       dcp_size=1, dcp_rank=0, dcp_interleave=1, sparse_chunk=0, sparse_sink=1,
                       sparse_stride=1, sparse_recent=1):
    if dcp_size != 1 or sparse_chunk:
        raise NotImplementedError("the native mla_verify lowering covers dense attention without DCP")
    (B, pages), (rows, H, D), page = block_table.shape, q.shape, kv_cache.shape[1]
    Q, L = q_per_req, pages * page
    pos = torch.arange(L, device=q.device)
    kv = kv_cache[block_table.long()].reshape(B, L, D).float() * kv_scale
    # rows past a request's length may hold NaN (never read by the op): zero them, mask the scores
    kv = torch.where((pos[None, :] < seq_lens[:, None])[..., None], kv, 0.0)
    vis = seq_lens[:, None] - (Q - 1) + torch.arange(Q, device=q.device)[None, :]          # [B, Q]
    s = torch.einsum("bqhd,bld->bqhl", q.float().view(B, Q, H, D), kv) * softmax_scale
    s = s.masked_fill(~(pos[None, None, :] < vis[..., None]).unsqueeze(2), float("-inf"))
    m = s.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe[..., None])
    total = p.sum(-1)
    out = torch.einsum("bqhl,bld->bqhd", p, kv[..., :d_v]) / total.clamp_min(1e-30)[..., None]
    out = torch.where((total > 0)[..., None], out, 0.0)
    lse = torch.where(total > 0, m_safe + torch.log(total.clamp_min(1e-30)), float("-inf"))
    return out.reshape(rows, H, d_v).to(q.dtype), lse.reshape(rows, H)


def native_cache_update(kv_c, k_pe, cache, slot_mapping, kv_scale=1.0):
    """mla_cache_update without skipping by a mask: negative slots go to a spare row that is cut off."""
    from k3trt.plugins.cache_write import FP8_MAX

    rows = torch.cat([kv_c, k_pe], -1)
    if cache.dtype == torch.float8_e4m3fn:
        rows = (rows.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX)
    flat = cache.reshape(-1, cache.shape[-1])
    n = flat.shape[0]
    spare = torch.cat([flat, flat[:1]], 0)
    idx = torch.where(slot_mapping >= 0, slot_mapping, n)
    return torch.index_put(spare, (idx,), rows.to(cache.dtype))[:n].reshape(cache.shape)


def _native_moe(x, ids, weights, w_gate, w_up, w_down, activation, beta, linear_beta):
    from k3trt.model.layers import ACTIVATIONS

    combine = torch.zeros(x.shape[0], w_gate.shape[0], dtype=torch.float32, device=x.device)
    combine = combine.scatter(1, ids, weights.float())                                       # [T, E]
    g = torch.einsum("tw,eiw->eti", x, w_gate)
    u = torch.einsum("tw,eiw->eti", x, w_up)
    h = ACTIVATIONS[activation](g, u, beta or None, linear_beta or None)
    y = torch.einsum("eti,ewi->etw", h, w_down)
    return torch.einsum("te,etw->tw", combine, y.float()).to(x.dtype)


def _native_kda_chunked(q, k, v, g, beta, state, scale, chunk_size=64):
    from k3trt.plugins.kda import _kda_recurrent_torch

    # no triangular solve in ONNX: the recurrence, unrolled (equal up to rounding)
    o, final, _ = _kda_recurrent_torch(q, k, v, g, beta, state, scale, False)
    return o, final


def native_lowerings() -> dict[str, Callable]:
    """torch-op name -> its export-friendly plain-torch form."""
    from k3trt.plugins.kda import _kda_recurrent_torch, _short_conv_torch

    return {"mla_verify": _native_mla_verify, "mla_cache_update": native_cache_update,
            "kda_recurrent": _kda_recurrent_torch, "kda_chunked": _native_kda_chunked,
            "short_conv": _short_conv_torch, "moe_experts": _native_moe}
