"""Export the model's per-capacity step graphs to ONNX, the k3trt plugin ops as single nodes.

One graph per capacity (verify_b{B}, prefill_t{T}); their inputs, outputs and the contract the
caller keeps are the engine format's: k3trt/engine/graph_io.py (GraphSpec, io_specs).

``native=True`` exports the same graph with every k3trt op lowered to standard ONNX ops
(onnx_ops.native_lowerings) for a backend that cannot load the plugins (TensorRT-RTX).

Why the torch.onnx exporter (dynamo) and not a direct graph writer: the graph must be the model's
own computation (AttnRes, router, norms, projections), and a second writer of it would be a
second model to keep in step. What ENVIRONMENT.md found to work is used: an
``onnx.defs.OpSchema`` per k3trt op and plain tracing translation functions (onnx_ops.py).
Three thin export-time substitutions keep the model unforked and are scoped to the export:
``mla_cache_write`` (mutating) -> the functional ``k3trt::mla_cache_update`` then a copy;
``Experts.forward`` (Python loop over the experts with tokens: data-dependent) ->
``k3trt::moe_experts`` (both ops: plugins/graph_ops.py); the absorbed MLA path for every query
width, so that prefill reads the cache through ``mla_verify`` (the naive path slices by the
Python context length).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import k3trt.plugins  # noqa: F401  (registers torch.ops.k3trt.*)
from k3trt.config import ModelConfig
from k3trt.engine.graph_io import DYNAMIC_DIMS, GraphSpec, TensorSpec, cache_specs, io_specs
from k3trt.model import mla as mla_module
from k3trt.model.context import KDALayerCache, ModelCache, StepContext
from k3trt.model.moe import Experts
from k3trt.plugins.graph_ops import mla_cache_update, moe_experts  # noqa: F401  (the ops the graphs call)

log = logging.getLogger(__name__)

UNSTAMPED_Q_PER_REQ = 0      # MlaVerify's q_per_req in a prefill family's graph, before families.stamp
# the inputs whose first dimension is the step's token count N or sequence count S (graph_io.io_specs)
STEP_DIMS = {"input_ids": "tokens", "slot_mapping": "tokens", "positions": "tokens",
             "block_table": "seqs", "seq_lens": "seqs", "kda_slots": "seqs"}


def example_inputs(cfg: ModelConfig, spec: GraphSpec, *, num_blocks: int, num_slots: int,
                   generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """Valid inputs: sequence i owns blocks i·max_blocks.. and a random KDA slot, has 1 to
    max_blocks·block_size - Q tokens cached (never 0: the graph never sees a fresh sequence), and
    the caches hold random values in their dtypes."""
    g = generator or torch.Generator().manual_seed(0)
    S, Q, bs, mb = spec.num_seqs, spec.q_per_req, spec.block_size, spec.max_blocks
    if num_blocks < S * mb or num_slots < S:
        raise ValueError(f"example inputs for {spec.name} need >= {S * mb} blocks and >= {S} slots")
    ctx = torch.randint(1, mb * bs - Q + 1, (S,), generator=g)
    table = torch.arange(S * mb, dtype=torch.int32).view(S, mb)
    pos = torch.cat([torch.arange(c, c + Q) for c in ctx.tolist()])
    seq = torch.arange(N := spec.num_tokens) // Q
    values = {"input_ids": torch.randint(0, cfg.vocab_size, (N,), generator=g),
              "slot_mapping": table[seq, pos // bs].long() * bs + pos % bs,
              "block_table": table, "seq_lens": (ctx + Q).to(torch.int32),
              "kda_slots": torch.randperm(num_slots, generator=g)[:S], "positions": pos,
              "image_mask": torch.rand(N, generator=g) < 0.5}
    ins, _ = io_specs(cfg, spec)
    for t in ins:
        if t.name not in values:
            shape = [{"num_blocks": num_blocks, "num_slots": num_slots}.get(d, d) for d in t.shape]
            values[t.name] = (torch.randn(shape, generator=g) * 0.5).to(t.dtype)
    return {t.name: values[t.name] for t in ins}


# ------------------------------------------------------------------------------ the export wrapper
def model_cache(cfg: ModelConfig, spec: GraphSpec, caches: dict[str, Tensor]) -> ModelCache:
    """A ModelCache over tensors named as ``cache_specs`` names them."""
    cache = ModelCache(block_size=spec.block_size, kv_scale=spec.kv_scale)
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_kda(layer):
            cache.kda[layer] = KDALayerCache(caches[f"kda_state_{layer}"], caches[f"kda_conv_{layer}"],
                                             caches.get(f"kda_step_state_{layer}"),
                                             caches.get(f"kda_step_conv_{layer}"))
        else:
            cache.mla[layer] = caches[f"mla_cache_{layer}"]
    return cache


class _Multiples:
    """cu_q of a uniform step: entry i is i·q (i and q may be torch.export SymInts)."""

    def __init__(self, q):
        self.q = q

    def __getitem__(self, i):
        return i * self.q


@dataclass(frozen=True)
class UniformStep(StepContext):
    """A step of `seqs` sequences of `q` new tokens each, either of which may be a torch.export
    SymInt: what every exported graph runs. StepContext's per-sequence tuples cannot have a symbolic
    length, so here they are None (code that reads them fails loudly) and the properties the model
    reads of a uniform step come from the two numbers."""
    seqs: Any = 1
    q: Any = 1

    @property
    def num_seqs(self):
        return self.seqs

    @property
    def num_tokens(self):
        return self.seqs * self.q

    @property
    def uniform_q(self):
        return self.q

    @property
    def cu_q(self):
        return _Multiples(self.q)


def image_rows(model: nn.Module, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor] | None:
    """The model's `embeds` for a graph with image inputs: every row, image_embeds where image_mask
    is set and the token embedding elsewhere (static shapes: no data-dependent row count)."""
    if "image_embeds" not in inputs:
        return None
    tokens = model.model.embed_tokens(inputs["input_ids"])
    rows = torch.where(inputs["image_mask"][:, None], inputs["image_embeds"].to(tokens.dtype), tokens)
    return torch.arange(rows.shape[0], device=rows.device), rows


class StepGraph(nn.Module):
    """The model over one capacity's step, inputs and outputs as ``io_specs`` lists them. The
    step's sizes are read from the inputs (block_table [S, ...], input_ids [N]), so the same
    module traces with a symbolic batch (verify) or token count (prefill): a graph family."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, spec: GraphSpec):
        super().__init__()
        self.model, self.cfg, self.spec = model, cfg, spec
        self.input_names = [t.name for t in io_specs(cfg, spec)[0]]

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        spec, cfg = self.spec, self.cfg
        x = dict(zip(self.input_names, inputs))
        S, N = x["block_table"].shape[0], x["input_ids"].shape[0]
        # seq_lens, positions and "fresh" are graph inputs or derived from them, never constants of
        # the trace: the caller zeroes a fresh sequence's KDA slot (graph_io's contract), so no
        # sequence is fresh here (NoPE layers read no positions: such a model has no positions input)
        positions = x.get("positions")
        ctx = UniformStep(q_lens=None, ctx_lens=None, slot_mapping=x["slot_mapping"], block_table=x["block_table"],
                          kda_slots=x["kda_slots"], save_kda_states=spec.saves_kda_states,
                          dev_seq_lens=x["seq_lens"],
                          dev_positions=positions if positions is not None else torch.zeros_like(x["input_ids"]),
                          dev_fresh=torch.zeros_like(x["kda_slots"], dtype=torch.bool),
                          seqs=S, q=spec.q_per_req if spec.kind == "verify" else N)
        # clones: the model updates these in place; returning them makes the graph functional
        caches = {t.name: x[t.name].clone() for t in cache_specs(cfg, spec)}
        cache = model_cache(cfg, spec, caches)
        hidden = self.model(x["input_ids"], ctx, cache, embeds=image_rows(self.model, x))
        logits = self.model.logits(hidden if spec.kind == "verify" else hidden[-1:])
        return (logits, *caches.values())


def _cache_write_shim(kv_c, k_pe, cache, slot_mapping, kv_scale=1.0):
    cache.copy_(torch.ops.k3trt.mla_cache_update(kv_c, k_pe, cache, slot_mapping, kv_scale))


def _mla_verify_shim(op):
    """Under a prefill family's trace q_per_req is the symbolic token count, which an ONNX
    attribute cannot hold: the node gets UNSTAMPED_Q_PER_REQ, which the plugins refuse, and
    families.stamp writes each capacity's value."""
    def call(q, kv_cache, block_table, seq_lens, q_per_req, *args, **kwargs):
        if not isinstance(q_per_req, int):
            q_per_req = UNSTAMPED_Q_PER_REQ
        return op.default(q, kv_cache, block_table, seq_lens, q_per_req, *args, **kwargs)
    # the fake-tensor dispatch finds the op by name in torch.ops.k3trt, i.e. this function
    call.default = op.default
    return call


def _experts_via_op(cfg: ModelConfig):
    def forward(self: Experts, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        return torch.ops.k3trt.moe_experts(x, ids, weights, self.w_gate, self.w_up, self.w_down, cfg.hidden_act,
                                           float(cfg.activation_situ_beta or 0.0),
                                           float(cfg.activation_situ_linear_beta or 0.0))
    return forward


@contextlib.contextmanager
def export_mode(cfg: ModelConfig, max_q: int, *, native: bool = False):
    """The substitutions of the module doc, undone on exit; `native` also swaps every k3trt op for
    its plain-torch lowering (onnx_ops.native_lowerings), so the graph has standard ONNX ops only.
    Not thread-safe (module attributes are patched); the builder exports one graph at a time."""
    from k3trt.builder.onnx_ops import native_lowerings  # noqa: PLC0415 (cycle: onnx_ops imports this module)

    ns = torch.ops.k3trt
    ops = native_lowerings() if native else {}
    saved_ops = {name: getattr(ns, name) for name in ["mla_cache_write", "mla_verify", *ops]}
    saved = (Experts.forward, mla_module.ABSORBED_MAX_Q)
    ns.mla_cache_write = _cache_write_shim
    for name, fn in ops.items():
        setattr(ns, name, fn)
    if not native:              # native graphs are never symbolic (builder/families.py)
        ns.mla_verify = _mla_verify_shim(ns.mla_verify)
    Experts.forward = _experts_via_op(cfg)
    mla_module.ABSORBED_MAX_Q = max(max_q, saved[1])
    try:
        yield
    finally:
        for name, op in saved_ops.items():
            setattr(ns, name, op)
        Experts.forward, mla_module.ABSORBED_MAX_Q = saved


# ------------------------------------------------------------------------------ export
def export_graph(model: nn.Module, cfg: ModelConfig, spec: GraphSpec, path: str | Path, *,
                 native: bool = False, example_blocks: int | None = None,
                 example_slots: int | None = None, step_range: tuple[int, int] | None = None) -> Path:
    """Export one capacity's graph to `path` (weights in ``<path>.data``); onnx.checker runs on it.
    `native`: the k3trt ops lowered to standard ONNX (for TensorRT-RTX), not plugin nodes.
    `step_range` (lo, hi), lo >= 2: a family's graph instead (builder/families.py), symbolic in the
    capacity over that range (verify: the batch S, with N = S·Q; prefill: the token count N);
    `spec` is one of its members (the example inputs' sizes)."""
    import onnx  # noqa: PLC0415 (optional: onnx)

    from k3trt.builder.onnx_ops import translation_table  # noqa: PLC0415 (cycle: onnx_ops imports this module)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nb = example_blocks or spec.num_seqs * spec.max_blocks + 1
    ns = example_slots or spec.num_seqs + 1
    inputs = example_inputs(cfg, spec, num_blocks=nb, num_slots=ns)
    ins, outs = io_specs(cfg, spec)
    dims = {d: torch.export.Dim(d, min=2) for d in DYNAMIC_DIMS}
    if step_range is not None:
        lo, hi = step_range
        if spec.kind == "verify":
            dims["seqs"] = torch.export.Dim("num_seqs", min=lo, max=hi)
            dims["tokens"] = dims["seqs"] * spec.q_per_req
        else:
            dims["tokens"] = torch.export.Dim("num_tokens", min=lo, max=hi)
    dynamic = tuple(_input_dims(t, dims) for t in ins)
    wrapper = StepGraph(model, cfg, spec).eval()
    t0 = time.perf_counter()
    log.info("export %s: tracing (%d inputs, %d outputs)", spec.name, len(ins), len(outs))
    # torch.export under the substitutions; the ONNX translation after them (its decomposition
    # pass walks the k3trt namespace and must see real ops there)
    max_q = spec.q_per_req if step_range is None or spec.kind == "verify" else step_range[1]
    with export_mode(cfg, max_q, native=native), torch.no_grad():
        exported = torch.export.export(wrapper, tuple(inputs.values()), dynamic_shapes=(dynamic,), strict=False)
    log.info("export %s: traced in %.1fs; translating to ONNX", spec.name, time.perf_counter() - t0)
    # onnx_ir warns once per k3trt node output that it has no value_info type (the schemas carry no
    # inference function); harmless, and hundreds of lines on a real model
    # The exporter's own INFO logging (onnxscript's optimizer, onnx_ir's passes: thousands of lines
    # per graph) is kept at WARNING unless k3trt itself logs at DEBUG.
    quiet = {"onnx_ir.serde": logging.ERROR}
    if not log.isEnabledFor(logging.DEBUG):
        quiet.update({"onnxscript": logging.WARNING, "onnx_ir": logging.WARNING})
    saved = {name: logging.getLogger(name).level for name in quiet}
    for name, lvl in quiet.items():
        logging.getLogger(name).setLevel(lvl)
    try:
        program = torch.onnx.export(exported, dynamo=True, external_data=True,
                                    input_names=[t.name for t in ins], output_names=[t.name for t in outs],
                                    custom_translation_table=translation_table(), optimize=True, verbose=False)
        program.save(str(path), external_data=True)
    finally:
        for name, lvl in saved.items():
            logging.getLogger(name).setLevel(lvl)
    _name_dynamic_dims(path, ins)
    onnx.checker.check_model(str(path), full_check=False)
    log.info("export %s: %s written and checked in %.1fs", spec.name, path.name, time.perf_counter() - t0)
    return path


def _input_dims(t: TensorSpec, dims: dict) -> dict | None:
    """torch.export's dynamic_shapes entry of one input: its cache dims, and its step dim if symbolic."""
    out = {i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str)}
    step = dims.get(STEP_DIMS.get(t.name))
    if step is not None:
        out[0] = step
    return out or None


def _name_dynamic_dims(path: Path, ins: list[TensorSpec]) -> None:
    """The exporter names dynamic dims after its symbols (s15); give them the spec's names, which
    the engine profiles and the session use."""
    import onnx  # noqa: PLC0415 (optional: onnx)

    model = onnx.load(str(path), load_external_data=False)
    rename = {}
    for value, t in zip(model.graph.input, ins):
        for dim, want in zip(value.type.tensor_type.shape.dim, t.shape):
            if isinstance(want, str) and dim.dim_param:
                rename[dim.dim_param] = want
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in rename:
                dim.dim_param = rename[dim.dim_param]
    onnx.save(model, str(path))


WeightTable = dict[tuple[str, str], tuple[str, int, int]]   # (name, sha256) -> (file, offset, length)


def share_weights(paths: list[Path], data_name: str = "weights.bin", table: WeightTable | None = None) -> WeightTable:
    """Point every graph's external tensors at shared data files beside them (each tensor stored
    once, keyed by name and content; pass the returned `table` back to share graphs exported
    later) and delete the per-graph data files. Tensors the table already holds point where it
    says (a rebuild's table starts with the files of the graphs it reuses); new ones are appended
    to `data_name`, which is created only when something is appended. Tensor by tensor: a
    K3-sized file is never held in memory."""
    import onnx  # noqa: PLC0415 (optional: onnx)

    paths = [Path(p) for p in paths]
    data = paths[0].parent / data_name
    if any(p.parent != data.parent for p in paths):
        dirs = sorted({str(p.parent) for p in paths})
        raise ValueError(f"share_weights: graphs must share one directory, got {dirs}")
    table = {} if table is None else table
    shared = {loc for loc, _, _ in table.values()} | {data_name}
    old_files: set[Path] = set()
    out = None
    try:
        for p in paths:
            model = onnx.load(str(p), load_external_data=False)
            for t in model.graph.initializer:
                if t.data_location != onnx.TensorProto.EXTERNAL:
                    continue
                info = {e.key: e.value for e in t.external_data}
                if info["location"] in shared:
                    continue
                src = p.parent / info["location"]
                old_files.add(src)
                with open(src, "rb") as f:
                    f.seek(int(info.get("offset", 0)))
                    blob = f.read(int(info["length"]))
                key = (t.name, hashlib.sha256(blob).hexdigest())
                if key not in table:
                    if out is None:
                        out = open(data, "ab")
                    out.write(b"\0" * (-out.tell() % 64))        # aligned for mmap-and-copy loaders
                    table[key] = (data_name, out.tell(), len(blob))
                    out.write(blob)
                location, offset, length = table[key]
                del t.external_data[:]
                for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
                    t.external_data.add(key=k, value=v)
            onnx.save(model, str(p))
    finally:
        if out is not None:
            out.close()
    for f in old_files:
        f.unlink(missing_ok=True)
    files = sorted({loc for loc, _, _ in table.values()})
    log.info("weights: %d tensors in %s (%.1f MiB), shared by %d graph(s)", len(table), ", ".join(files),
             sum((data.parent / f).stat().st_size for f in files) / 2**20, len(paths))
    return table
