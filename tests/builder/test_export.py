"""ONNX export of the per-capacity step graphs (tiny preset): k3trt plugin nodes, shared external
weights, onnx.checker, and onnxruntime equivalence with the eager model (prefill and verify, two
capacities each); the native lowerings against their ops."""

import collections
import dataclasses

import onnx
import pytest
import torch

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime_extensions")

from k3trt.builder.export import StepGraph, example_inputs, export_graph, export_mode, model_cache  # noqa: E402
from k3trt.builder.families import families  # noqa: E402
from k3trt.builder.onnx_ops import DOMAIN, check_graph, native_lowerings, reference_outputs  # noqa: E402
from k3trt.builder.rank import build_rank  # noqa: E402
from k3trt.engine.capacities import Capacities  # noqa: E402
from k3trt.engine.graph_io import cache_specs, graph_specs, io_specs  # noqa: E402
from k3trt.model import mla
from k3trt.model.moe import Experts  # noqa: E402

BLOCK, MAX_SEQ = 16, 124
# prefill 2 and 4 run the recurrent KDA op, 32 and 64 the chunked one; five graph families
# (builder/families.py): b1, b2+b4 (one symbolic export), t1, t2+t4, t32+t64
CAPS = Capacities(verify=(1, 2, 4), prefill=(1, 2, 4, 32, 64), spec_tokens=3)
EXPORTED = ("verify_b1", "verify_b2", "verify_b4", "prefill_t1", "prefill_t2", "prefill_t4", "prefill_t32",
            "prefill_t64")


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    """The plugin graphs of CAPS in one rank dir, through the builder's export-only path."""
    cfg, model = tiny_model
    rank = tmp_path_factory.mktemp("rank0")
    assert build_rank(model, cfg, CAPS, rank, backend="tensorrt", block_size=BLOCK, max_seq_len=MAX_SEQ,
                      engines=False) == []
    specs = {s.name: s for s in graph_specs(cfg, CAPS, block_size=BLOCK, max_seq_len=MAX_SEQ, dtype=torch.float32,
                                            kv_dtype=torch.float32)}
    return cfg, model, rank, specs


def test_graphs_hold_one_k3trt_node_per_op_call(exported):
    cfg, _, rank, specs = exported
    n_mla, n_kda = len(cfg.mla_layers), len(cfg.kda_layers)
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    for name in EXPORTED:
        model = onnx.load(str(rank / f"{name}.onnx"), load_external_data=False)
        onnx.checker.check_model(str(rank / f"{name}.onnx"))
        ops = collections.Counter(n.op_type for n in model.graph.node if n.domain == DOMAIN)
        kda_op = "KdaChunked" if name in ("prefill_t32", "prefill_t64") else "KdaRecurrent"  # > CHUNKED_MIN_TOKENS
        assert ops == {"MlaVerify": n_mla, "MlaCacheWrite": n_mla, "ShortConv": n_kda, kda_op: n_kda,
                       "MoeExperts": n_moe}, name
        ins, outs = io_specs(cfg, specs[name])
        assert [i.name for i in model.graph.input] == [t.name for t in ins]
        assert [o.name for o in model.graph.output] == [t.name for t in outs]
        for value, spec in zip(model.graph.input, ins):      # dynamic cache dims carry the spec's names
            dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
            assert dims == list(spec.shape), value.name
        verify = [n for n in model.graph.node if n.op_type == "MlaVerify"][0]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in verify.attribute}
        assert attrs["q_per_req"] == specs[name].q_per_req and attrs["d_v"] == cfg.kv_lora_rank


def test_weights_are_stored_once_for_all_graphs(exported, tiny_model):
    _, model = tiny_model
    _, _, rank, _ = exported
    assert sorted(p.name for p in rank.iterdir() if not p.name.endswith(".onnx")) == ["weights.bin", "weights.json"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    size = (rank / "weights.bin").stat().st_size
    assert 0.9 * params < size < 1.1 * params          # once, not once per graph
    for name in EXPORTED:
        m = onnx.load(str(rank / f"{name}.onnx"), load_external_data=False)
        locs = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
        assert locs == {"weights.bin"}


@pytest.mark.parametrize("name", EXPORTED)
def test_onnxruntime_matches_the_model(exported, name):
    cfg, model, rank, specs = exported
    errors = check_graph(rank / f"{name}.onnx", model, cfg, specs[name])
    assert set(errors) == {t.name for t in io_specs(cfg, specs[name])[1]}


def test_step_graph_equals_the_model_eagerly(tiny_model):
    """The export wrapper and its substitutions (seq_lens from inputs, absorbed prefill, slots never
    fresh, functional cache write, experts op), run eagerly, are the model: the graph's semantics
    before any exporter touches it."""
    cfg, model = tiny_model
    for spec in graph_specs(cfg, CAPS, block_size=BLOCK, max_seq_len=MAX_SEQ, dtype=torch.float32,
                            kv_dtype=torch.float32):
        inputs = example_inputs(cfg, spec, num_blocks=spec.num_seqs * spec.max_blocks + 1, num_slots=spec.num_seqs + 2)
        ref = reference_outputs(model, cfg, spec, inputs)
        with torch.no_grad(), export_mode(cfg, spec.q_per_req):
            got = StepGraph(model, cfg, spec)(*inputs.values())
        names = [t.name for t in io_specs(cfg, spec)[1]]
        for n, g in zip(names, got):
            torch.testing.assert_close(g, ref[n], atol=2e-4, rtol=2e-3, msg=f"{spec.name} {n}")


def test_prefill_graph_with_image_embeds(tiny_model, tmp_path):
    """An engine with encoder capacities: its prefill graphs (not its verify graphs) take
    image_embeds / image_mask; onnxruntime equals the model with the masked rows replaced, and the
    rows change the logits."""
    cfg, model = tiny_model
    specs = {s.name: s for s in graph_specs(cfg, dataclasses.replace(CAPS, encoder=(64,)), block_size=BLOCK,
                                            max_seq_len=MAX_SEQ, dtype=torch.float32, kv_dtype=torch.float32)}
    assert [n for n, s in specs.items() if s.image_embeds] == [n for n in specs if n.startswith("prefill_")]
    spec = specs["prefill_t4"]
    names = [t.name for t in io_specs(cfg, spec)[0]]
    assert {"image_embeds", "image_mask"} <= set(names) and "image_embeds" not in {
        t.name for t in io_specs(cfg, specs["verify_b1"])[0]}
    check_graph(export_graph(model, cfg, spec, tmp_path / "prefill_t4.onnx"), model, cfg, spec)
    inputs = example_inputs(cfg, spec, num_blocks=spec.max_blocks + 1, num_slots=3)
    assert inputs["image_mask"].any()
    plain = reference_outputs(model, cfg, spec, {**inputs, "image_mask": torch.zeros_like(inputs["image_mask"])})
    assert not torch.allclose(reference_outputs(model, cfg, spec, inputs)["logits"], plain["logits"])


def test_export_mode_restores_what_it_patches(tiny_model):
    cfg, _ = tiny_model
    before = (torch.ops.k3trt.mla_cache_write, torch.ops.k3trt.kda_recurrent, Experts.forward, mla.ABSORBED_MAX_Q)
    with pytest.raises(RuntimeError, match="boom"):
        with export_mode(cfg, 64, native=True):
            assert torch.ops.k3trt.kda_recurrent is not before[1] and mla.ABSORBED_MAX_Q == 64
            raise RuntimeError("boom")
    after = (torch.ops.k3trt.mla_cache_write, torch.ops.k3trt.kda_recurrent, Experts.forward, mla.ABSORBED_MAX_Q)
    assert after == before


def test_native_lowerings_equal_their_ops():
    """Each plain-ONNX lowering against the op on random inputs, padding and NaN garbage included."""
    g = torch.Generator().manual_seed(0)
    low = native_lowerings()
    # mla_verify: 3 requests x 4 rows, 2 heads, D = 24 (d_v 16), pages of 16; NaN past the lengths
    cache = torch.randn(10, 16, 24, generator=g)
    table = torch.tensor([[3, 1, 0], [2, 5, 9], [7, 4, 6]], dtype=torch.int32)
    lens = torch.tensor([5, 33, 16], dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        cache.view(-1, 24)[(table[b].long()[:, None] * 16 + torch.arange(16)).flatten()[n:]] = float("nan")
    q = torch.randn(12, 2, 24, generator=g)
    want = torch.ops.k3trt.mla_verify(q, cache, table, lens, 4, 0.3, 1.0, 16)
    got = low["mla_verify"](q, cache, table, lens, 4, 0.3, 1.0, 16)
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, atol=1e-5, rtol=1e-5)
    # cache update with padding slots (-1)
    kv_c, k_pe = torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g)
    slots = torch.tensor([3, -1, 40, -1, 0])
    base = torch.randn(4, 16, 24, generator=g)
    torch.testing.assert_close(low["mla_cache_update"](kv_c, k_pe, base, slots, 1.0),
                               torch.ops.k3trt.mla_cache_update(kv_c, k_pe, base, slots, 1.0))
    # chunked KDA through the recurrence
    B, T, H, D = 2, 20, 2, 8
    qk = torch.nn.functional.normalize(torch.randn(2, B, T, H, D, generator=g), dim=-1)
    v, gate = torch.randn(B, T, H, D, generator=g), -torch.rand(B, T, H, D, generator=g)
    beta, s0 = torch.rand(B, T, H, generator=g), torch.randn(B, H, D, D, generator=g)
    for w, o in zip(torch.ops.k3trt.kda_chunked(qk[0], qk[1], v, gate, beta, s0, 0.3),
                    low["kda_chunked"](qk[0], qk[1], v, gate, beta, s0, 0.3)):
        torch.testing.assert_close(o, w, atol=1e-4, rtol=1e-4)
    # dense MoE
    x, E, W, inter = torch.randn(6, 16, generator=g), 4, 16, 8
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)])
    wts = torch.rand(6, 2, generator=g)
    ws = [torch.randn(E, inter, W, generator=g), torch.randn(E, inter, W, generator=g),
          torch.randn(E, W, inter, generator=g)]
    torch.testing.assert_close(low["moe_experts"](x, ids, wts, *ws, "situ", 4.0, 25.0),
                               torch.ops.k3trt.moe_experts(x, ids, wts, *ws, "situ", 4.0, 25.0), atol=1e-5, rtol=1e-5)


def test_model_cache_maps_every_layer(tiny_model):
    cfg, _ = tiny_model
    spec = graph_specs(cfg, CAPS, block_size=BLOCK, max_seq_len=MAX_SEQ, dtype=torch.float32,
                       kv_dtype=torch.float32)[0]
    cache = model_cache(cfg, spec, {t.name: torch.empty(0) for t in cache_specs(cfg, spec)})
    assert sorted(cache.mla) == list(cfg.mla_layers) and sorted(cache.kda) == list(cfg.kda_layers)
    assert all(c.step_state is not None for c in cache.kda.values())     # verify keeps per-row states


def test_graph_families(tiny_model):
    """The default plan's 19 capacities take 5 exports; native graphs are one family each."""
    cfg, _ = tiny_model
    caps = Capacities.plan(max_batch=32, max_num_tokens=4096, spec_tokens=3)
    specs = graph_specs(cfg, caps, block_size=64, max_seq_len=4096, dtype=torch.float32, kv_dtype=torch.float32)
    names = [[s.name for s in f] for f in families(specs, native=False)]
    assert names == [["verify_b1"], [f"verify_b{b}" for b in (2, 4, 8, 16, 32)], ["prefill_t1"],
                     [f"prefill_t{t}" for t in (2, 4, 8, 16)], [f"prefill_t{t}" for t in (32, 64, 128, 256, 512,
                                                                                          1024, 2048, 4096)]]
    assert len(families(specs, native=True)) == len(specs) == 19


def test_family_members_are_stamped_copies(exported):
    """Members of one family share the graph and differ in their I/O sizes and MlaVerify's
    q_per_req only; no family file is left behind."""
    _, _, rank, specs = exported
    assert not list(rank.glob("family_*"))
    for a, b in (("verify_b2", "verify_b4"), ("prefill_t32", "prefill_t64")):
        ga, gb = (onnx.load(str(rank / f"{n}.onnx"), load_external_data=False).graph for n in (a, b))
        assert [n.op_type for n in ga.node] == [n.op_type for n in gb.node]
        dims = [d.dim_value for d in gb.input[0].type.tensor_type.shape.dim]
        assert dims == [specs[b].num_tokens]
