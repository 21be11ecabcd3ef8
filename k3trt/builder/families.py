"""Graph families: one export for many capacities.

Exporting a graph (torch.export, decompositions, the ONNX translation and its optimizer) costs
5-20 s on a 2-core machine whatever the capacity, and a default build has 19 capacities. The
capacities whose step runs the same model code differ only in their step size, so each such
family is exported once, symbolic in that size (export.export_graph's ``step_range``: the batch
S of verify graphs, N = S·Q; the token count N of prefill graphs), and every member's graph is
that graph with the member's sizes stamped onto its inputs and outputs (``stamp``). The stamped
graph is what the engine and onnxruntime consume, so the onnxruntime check and the engine's
static shapes are per capacity as before.

Families (``families``): a capacity of 1 alone (torch.export specialises a size of 1); verify
capacities >= 2; prefill capacities >= 2 up to CHUNKED_MIN_TOKENS (KDA's recurrent form) and
above it (the chunked form). The native lowering unrolls per-token loops, so every native
capacity is its own family. A family whose symbolic trace fails is exported member by member.
"""

from __future__ import annotations

import logging
from pathlib import Path

from k3trt.builder.export import UNSTAMPED_Q_PER_REQ, export_graph
from k3trt.engine.graph_io import DYNAMIC_DIMS, GraphSpec, io_specs
from k3trt.model.kda import CHUNKED_MIN_TOKENS

log = logging.getLogger(__name__)


def family_key(spec: GraphSpec, native: bool) -> tuple:
    """Capacities with equal keys run the same model code (the module doc)."""
    if native or spec.capacity == 1:
        return (spec.kind, "capacity", spec.capacity)
    return (spec.kind, "chunked" if spec.kind == "prefill" and spec.capacity > CHUNKED_MIN_TOKENS else "step")


def families(specs: list[GraphSpec], native: bool) -> list[list[GraphSpec]]:
    """`specs` grouped by family_key, each family in capacity order, families in order of first member."""
    out: dict[tuple, list[GraphSpec]] = {}
    for spec in specs:
        out.setdefault(family_key(spec, native), []).append(spec)
    return [sorted(f, key=lambda s: s.capacity) for f in out.values()]


def export_family(model, cfg, family: list[GraphSpec], path: Path, *, native: bool) -> Path:
    """The family's graph at `path` (weights in ``<path>.data``): symbolic in the step size when
    the family has several members, else the one member's static graph."""
    if len(family) == 1:
        return export_graph(model, cfg, family[0], path, native=native)
    step_range = (family[0].capacity, family[-1].capacity)
    log.info("exporting %s once for %s (symbolic %s %d..%d)", path.stem, ", ".join(s.name for s in family),
             "batch" if family[0].kind == "verify" else "token count", *step_range)
    return export_graph(model, cfg, family[0], path, native=native, step_range=step_range)


def stamp(family_path: Path, cfg, spec: GraphSpec, out: Path) -> Path:
    """`spec`'s graph from its family's graph: the member's sizes on every input and output
    (the cache dims stay dynamic), value_info that names a step dimension dropped (onnxruntime and
    TensorRT infer it), and MlaVerify's q_per_req set to the member's. The external data
    locations are kept (the family graph's weights are shared before stamping)."""
    import onnx  # noqa: PLC0415 (optional: onnx)

    model = onnx.load(str(family_path), load_external_data=False)
    ins, outs = io_specs(cfg, spec)
    for values, specs in ((model.graph.input, ins), (model.graph.output, outs)):
        if [v.name for v in values] != [t.name for t in specs]:
            raise ValueError(f"stamp {spec.name}: {family_path.name} has {[v.name for v in values]}, "
                             f"io_specs wants {[t.name for t in specs]}")
        for value, t in zip(values, specs):
            dims = value.type.tensor_type.shape.dim
            if len(dims) != len(t.shape):
                raise ValueError(f"stamp {spec.name}: {t.name} has rank {len(dims)} in {family_path.name}, "
                                 f"io_specs wants {t.shape}")
            for dim, want in zip(dims, t.shape):
                if isinstance(want, int):
                    dim.Clear()
                    dim.dim_value = want
                else:
                    dim.Clear()
                    dim.dim_param = want
    keep = [v for v in model.graph.value_info
            if all(not d.dim_param or d.dim_param in DYNAMIC_DIMS for d in v.type.tensor_type.shape.dim)]
    del model.graph.value_info[:]
    model.graph.value_info.extend(keep)
    for node in model.graph.node:
        if node.op_type == "MlaVerify":
            for attr in node.attribute:
                if attr.name == "q_per_req":
                    if attr.i not in (UNSTAMPED_Q_PER_REQ, spec.q_per_req):
                        raise ValueError(f"stamp {spec.name}: MlaVerify {node.name} has q_per_req {attr.i}, "
                                         f"the capacity needs {spec.q_per_req}")
                    attr.i = spec.q_per_req
    model.graph.name = spec.name
    onnx.save(model, str(out))
    onnx.checker.check_model(str(out), full_check=False)
    return out
