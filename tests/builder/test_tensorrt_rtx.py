"""TensorRT-RTX (CPU-only AOT builds for SM120) and the TensorRT session's GPU-free parts.

The plugin graphs build real SM120 engines for the tiny model, every k3trt node a plugin layer of
the C++ plugin library (k3trt/trt_plugin/); the native fallback (k3trt ops lowered to standard
ONNX) builds too. RTX's handling of Python plugins is kept as reproductions run in subprocesses
(an abort must not kill pytest): a Python IPluginCreatorV3One plugin builds once
``libtensorrt_rtx.so`` resolves (the name shim of trt_plugin/loader.py; the builder uses the C++
library, not Python plugins, for both backends); a tensorrt.plugin-style "Quick" creator is
refused with a message."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import k3trt.engine.backends as registry
from k3trt.builder.backends import (
    BuildError,
    check_checkpoint,
    check_disk,
    check_target,
    estimate_build_bytes,
    preflight,
)
from k3trt.builder.export import StepGraph, export_mode, model_cache
from k3trt.builder.rank import build_rank
from k3trt.builder.tensorrt import BuildOptions, blocking_nodes, build_engine, parsed_layers
from k3trt.engine.backends import Backend, BackendError, load_backend
from k3trt.engine.capacities import Capacities
from k3trt.engine.graph_io import cache_specs, graph_specs, io_specs
from k3trt.model.context import StepContext
from k3trt.runtime.engine import Seq, make_batch
from k3trt.runtime.engine_io import prefill_inputs, prefill_slices, verify_inputs
from k3trt.runtime.trt_session import Cuda, cache_bytes, engine_layouts

BLOCK, MAX_SEQ = 16, 60
REPO = Path(__file__).resolve().parents[1]
needs_rtx = pytest.mark.skipif(not __import__("importlib").util.find_spec("tensorrt_rtx_bindings"),
                               reason="TensorRT-RTX not installed (pip install tensorrt-rtx-cu13-libs==1.7.1.116 "
                                      "tensorrt-rtx-cu13-bindings==1.7.1.116)")

_PLUGIN_PRELUDE = textwrap.dedent('''
    import sys
    from k3trt.trt_plugin.loader import preload_rtx_name
    preload_rtx_name()        # the parser dlopens libtensorrt_rtx.so when it imports a plugin node
    import tensorrt_rtx_bindings as trt
    from onnx import TensorProto, helper

    def build(op_type, domain):
        node = helper.make_node(op_type, ["x"], ["y"], domain=domain)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
        logger = trt.Logger(trt.Logger.ERROR)
        builder = trt.Builder(logger)
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(model.SerializeToString()):
            print("PARSE-ERROR", [str(parser.get_error(i)) for i in range(parser.num_errors)], flush=True)
            return
        config = builder.create_builder_config()
        config.num_compute_capabilities = 1
        config.set_compute_capability(trt.ComputeCapability.SM120, 0)
        print("RESULT", "ok" if builder.build_serialized_network(network, config) is not None else "none", flush=True)
''')

# The minimal identity plugin, written like NVIDIA's IPluginV3 Python sample: every attribute set,
# every method present. Each method prints, so a run shows how far TensorRT-RTX got.
_V3ONE = _PLUGIN_PRELUDE + textwrap.dedent('''
    def trace(m):
        print("CALLED", m, flush=True)

    class Identity(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self):
            for base in (trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
                base.__init__(self)
            self.num_outputs, self.plugin_namespace = 1, "k3trt"
            self.plugin_name, self.plugin_version = "K3Identity", "1"
            self.timing_cache_id, self.metadata_string = "", ""
        def get_capability_interface(self, kind): trace("get_capability_interface"); return self
        def get_output_data_types(self, types): trace("get_output_data_types"); return [types[0]]
        def get_output_shapes(self, inputs, shape_inputs, exprs): trace("get_output_shapes"); return [inputs[0]]
        def supports_format_combination(self, pos, io, n):
            trace("supports_format_combination"); return io[pos].desc.type == trt.float32
        def configure_plugin(self, i, o): trace("configure_plugin")
        def on_shape_change(self, i, o): trace("on_shape_change")
        def get_workspace_size(self, i, o): return 0
        def get_valid_tactics(self): return []
        def set_tactic(self, t): pass
        def enqueue(self, *args): trace("enqueue")
        def attach_to_context(self, ctx): return self.clone()
        def get_fields_to_serialize(self): return trt.PluginFieldCollection([])
        def clone(self):
            c = Identity(); c.__dict__.update(self.__dict__); return c

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_namespace, self.plugin_version = "K3Identity", "k3trt", "1"
            self.field_names = trt.PluginFieldCollection([])
        def create_plugin(self, name, fields, phase):
            trace("create_plugin"); KEEP.append(Identity()); return KEEP[-1]

    KEEP, CREATOR = [], Creator()
    print("REGISTERED", trt.get_plugin_registry().register_creator(CREATOR, "k3trt"), flush=True)
    build("K3Identity", "k3trt")   # not "Identity": the parser would map that to its own op
''')

_QUICK = _PLUGIN_PRELUDE + textwrap.dedent('''
    class Creator(trt.IPluginCreatorV3Quick):
        def __init__(self):
            trt.IPluginCreatorV3Quick.__init__(self)
            self.name, self.plugin_namespace, self.plugin_version = "QuickIdentity", "k3trt", "1"
            self.field_names = trt.PluginFieldCollection([])
        def create_plugin(self, name, namespace, fields, phase):
            raise AssertionError("not reached: the parser refuses Quick creators first")

    CREATOR = Creator()
    print("REGISTERED", trt.get_plugin_registry().register_creator(CREATOR, "k3trt"), flush=True)
    build("QuickIdentity", "k3trt")
''')


def _run(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO)


@needs_rtx
def test_rtx_builds_with_a_python_v3one_plugin():
    """With libtensorrt_rtx.so resolvable, RTX runs a Python IPluginCreatorV3One plugin's build
    capability (without it the parser aborts right after create_plugin: test_trt_plugin.py)."""
    r = _run(_V3ONE)
    assert "REGISTERED True" in r.stdout and "CALLED create_plugin" in r.stdout, r.stdout + r.stderr
    assert "CALLED get_output_shapes" in r.stdout, r.stdout
    assert r.returncode == 0 and "RESULT ok" in r.stdout, (
        f"rc={r.returncode}; stdout={r.stdout[-400:]!r}; stderr={r.stderr[-400:]!r}")


@needs_rtx
def test_rtx_refuses_quick_plugins_with_a_message():
    r = _run(_QUICK)
    assert r.returncode == 0, r.stderr[-400:]
    assert "IPluginCreatorV3One creator only" in r.stdout, r.stdout


# ------------------------------------------------------------------------------ checks before work
def test_not_a_k3_checkpoint(tmp_path):
    with pytest.raises(BuildError, match="not a directory"):
        check_checkpoint(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(BuildError, match="not a Kimi K3 checkpoint.*model_type"):
        check_checkpoint(tmp_path)


def test_k3_config_without_weights(tiny_ckpt, tmp_path):
    (tmp_path / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    with pytest.raises(BuildError, match="no \\*.safetensors"):
        check_checkpoint(tmp_path)
    assert check_checkpoint(tiny_ckpt).model_type == "kimi_k3"


def test_targets(monkeypatch):
    assert check_target("tensorrt-rtx", "SM120") == "sm120"
    with pytest.raises(BuildError, match="cannot build for sm90"):
        check_target("tensorrt-rtx", "sm90")
    with pytest.raises(BuildError, match="pass --target"):
        check_target("tensorrt-rtx", None)
    with pytest.raises(BuildError, match="like sm90"):
        check_target("tensorrt-rtx", "hopper")
    monkeypatch.setattr(registry, "local_gpu_target", lambda: None)
    with pytest.raises(BuildError, match="has none"):
        check_target("tensorrt", "sm90")
    monkeypatch.setattr(registry, "local_gpu_target", lambda: "sm90")
    assert check_target("tensorrt", None) == "sm90"
    with pytest.raises(BuildError, match="build on a sm100 machine"):
        check_target("tensorrt", "sm100")


def test_disk_and_backend_checks(tmp_path, tiny_ckpt):
    with pytest.raises(BuildError, match="not enough disk"):
        check_disk(tmp_path / "out", 1 << 60)
    check_disk(tmp_path / "out", 1)
    assert estimate_build_bytes(100, 4) < estimate_build_bytes(100, 4, weights_as_inputs=False)
    with pytest.raises(BackendError, match="unknown TensorRT backend"):
        load_backend("onnx")
    caps = Capacities((1, 2), (1, 128))
    if __import__("importlib").util.find_spec("tensorrt") is None:
        with pytest.raises(BuildError, match="not installed"):
            preflight(tiny_ckpt, tmp_path / "e", backend="tensorrt", target="sm90", capacities=caps)


@needs_rtx
def test_preflight_for_rtx(tiny_ckpt, tmp_path):
    def run(target, prefill):
        return preflight(tiny_ckpt, tmp_path / "e", backend="tensorrt-rtx", target=target,
                         capacities=Capacities((1,), prefill))

    assert run("sm120", (1, 128, 8192)).num_hidden_layers == 4        # plugin graphs: no prefill cap
    with pytest.raises(BuildError, match="exceed 64"):
        preflight(tiny_ckpt, tmp_path / "e", backend="tensorrt-rtx", target="sm120",
                  capacities=Capacities((1,), (1, 128)), lowering="native")
    with pytest.raises(BuildError, match="sm75 has no bf16"):
        run("sm75", (1,))
    cfg = run("sm120", (1,))
    assert cfg.num_hidden_layers == 4


def test_lowering_choices_are_checked(tiny_model, tmp_path):
    cfg, model = tiny_model
    caps = Capacities((1,), (1,), 3)
    with pytest.raises(BuildError, match="native lowering is TensorRT-RTX's fallback"):
        build_rank(model, cfg, caps, tmp_path, backend="tensorrt", block_size=BLOCK, max_seq_len=MAX_SEQ,
                   options=BuildOptions(target="sm120", lowering="native"))
    with pytest.raises(BuildError, match="choose one of"):
        build_rank(model, cfg, caps, tmp_path, backend="tensorrt-rtx", block_size=BLOCK, max_seq_len=MAX_SEQ,
                   options=BuildOptions(target="sm120", lowering="dense"))
    with pytest.raises(BuildError, match="needs BuildOptions.plugin_library"):
        build_engine(Backend("tensorrt-rtx", None), tmp_path / "g.onnx", tmp_path / "g.engine",
                     BuildOptions(target="sm120"))


# ------------------------------------------------------------------------------ RTX engines
def k3trt_nodes(onnx_path) -> dict[str, str]:
    """node name -> op_type of a graph's k3trt nodes."""
    import onnx  # noqa: PLC0415 (optional: onnx)
    return {n.name: n.op_type for n in onnx.load(str(onnx_path), load_external_data=False).graph.node
            if n.domain == "k3trt"}


def assert_plugin_layers(backend, rank, names, library=None) -> None:
    """Every k3trt node of each graph is a PLUGIN_V3 layer of the network the parser makes of it."""
    for name in names:
        nodes = k3trt_nodes(rank / f"{name}.onnx")
        assert {"MlaVerify", "MlaCacheWrite", "MoeExperts", "ShortConv"} <= set(nodes.values()), nodes
        layers = dict(parsed_layers(backend, rank / f"{name}.onnx", library))
        assert {n: layers.get(n) for n in nodes} == dict.fromkeys(nodes, "PLUGIN_V3"), name


@pytest.fixture(scope="module")
def rtx_rank(tiny_model, tmp_path_factory):
    pytest.importorskip("tensorrt_rtx_bindings")
    cfg, model = tiny_model
    rank = tmp_path_factory.mktemp("rank0")
    caps = Capacities(verify=(2,), prefill=(1,), spec_tokens=3)
    reports = build_rank(model, cfg, caps, rank, backend="tensorrt-rtx", block_size=BLOCK, max_seq_len=MAX_SEQ,
                         check=True, options=BuildOptions(target="sm120"))
    return cfg, caps, rank, reports


def test_plugin_engines_build_for_sm120(rtx_rank):
    cfg, caps, rank, reports = rtx_rank
    assert [r.name for r in reports] == ["verify_b2", "prefill_t1"]
    for r in reports:
        assert r.engine.stat().st_size == r.bytes > 1 << 20
        assert len(r.weight_inputs) > 10          # the weights are bound at run time, not embedded
    weights = (rank / "weights.bin").stat().st_size
    assert all(r.bytes < weights for r in reports)
    assert sorted(p.name for p in rank.glob("*.bin")) == ["weights.bin"]      # one copy for every engine
    assert_plugin_layers(load_backend("tensorrt-rtx"), rank, [r.name for r in reports])


def test_native_fallback_builds_for_sm120(tiny_model, tmp_path):
    pytest.importorskip("tensorrt_rtx_bindings")
    cfg, model = tiny_model
    caps = Capacities(verify=(2,), prefill=(1,), spec_tokens=3)
    reports = build_rank(model, cfg, caps, tmp_path, backend="tensorrt-rtx", block_size=BLOCK, max_seq_len=MAX_SEQ,
                         check=True, options=BuildOptions(target="sm120", lowering="native"))
    assert [r.name for r in reports] == ["verify_b2", "prefill_t1"]
    assert all(r.bytes > 1 << 20 and len(r.weight_inputs) > 10 for r in reports)
    assert not any(k3trt_nodes(tmp_path / f"{r.name}.onnx") for r in reports)
    assert blocking_nodes(load_backend("tensorrt-rtx"), tmp_path / "verify_b2.onnx") == []


def test_layouts_read_back_from_the_rank_dir(rtx_rank):
    cfg, caps, rank, _ = rtx_rank
    lay = engine_layouts(rank, cfg, verify=caps.verify, prefill=caps.prefill, spec_tokens=caps.spec_tokens,
                         block_size=BLOCK, max_seq_len=MAX_SEQ, dtype=torch.float32, kv_dtype=torch.float32,
                         num_blocks=20, num_slots=5)
    v = lay["verify_b2"]
    assert [b.name for b in v.step_inputs] == ["input_ids", "slot_mapping", "block_table", "seq_lens", "kda_slots"]
    assert v.binding("input_ids").shape == (8,) and v.binding("block_table").shape == (2, 4)
    assert v.binding(f"mla_cache_{cfg.mla_layers[0]}").shape == (20, BLOCK, cfg.mla_cache_dim)
    assert v.binding("logits").shape == (8, cfg.vocab_size) and not v.binding("logits").is_input
    assert lay["prefill_t1"].binding("logits").shape == (1, cfg.vocab_size)
    assert not any("step" in c for c in lay["prefill_t1"].cache_names)
    per_state = 5 * 2 * 32 * 32 * 4
    assert cache_bytes(lay, alias=True) * 2 == cache_bytes(lay, alias=False) > per_state
    with pytest.raises(FileNotFoundError, match="verify_b4"):
        engine_layouts(rank, cfg, verify=(2, 4), prefill=(1,), spec_tokens=3, block_size=BLOCK, max_seq_len=MAX_SEQ,
                       dtype=torch.float32, kv_dtype=torch.float32, num_blocks=20, num_slots=5)


# ------------------------------------------------------------------------------ the session's step mapping
def _caches(cfg, spec, num_blocks, num_slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in cache_specs(cfg, spec):
        shape = [{"num_blocks": num_blocks, "num_slots": num_slots}.get(d, d) for d in t.shape]
        out[t.name] = torch.randn(shape, generator=g) * 0.5
    return out


def _engine(model, cfg, spec, x, caches):
    """What the engine computes (StepGraph under the export substitutions, eagerly); updates `caches`."""
    names = [t.name for t in io_specs(cfg, spec)[0]]
    with torch.no_grad(), export_mode(cfg, spec.q_per_req):
        out = StepGraph(model, cfg, spec)(*[x[n] if n in x else caches[n] for n in names])
    for t, v in zip(io_specs(cfg, spec)[1][1:], out[1:]):
        caches[t.name[:-4]] = v
    return out[0]


def _reference(model, cfg, batch, caches, spec):
    ctx = StepContext(batch.q_lens, batch.ctx_lens, batch.slot_mapping, batch.block_table, batch.kda_slots,
                      batch.save_kda_states)
    with torch.no_grad():
        return model.logits(model(batch.input_ids, ctx, model_cache(cfg, spec, caches)))


def test_padded_verify_step_equals_the_unpadded_model(tiny_model):
    """3 live requests with 4, 1 and 2 rows run in a capacity-4 engine: live logits, written cache
    rows and (after the session's reset of short requests) KDA states equal the unpadded step."""
    cfg, model = tiny_model
    spec = graph_specs(cfg, Capacities((4,), (1,), 3), block_size=BLOCK, max_seq_len=MAX_SEQ, dtype=torch.float32,
                       kv_dtype=torch.float32)[0]
    g = torch.Generator().manual_seed(3)
    seqs = [Seq(torch.randint(0, 1000, (q,), generator=g).tolist(), c, blocks, slot, q)
            for q, c, blocks, slot in ((4, 5, [7, 2], 1), (1, 20, [0, 4], 3), (2, 30, [5, 1, 6], 0))]
    batch = make_batch(seqs, BLOCK, capacity=4, save_kda_states=True)
    nb, ns = 12, 5
    ref_caches = _caches(cfg, spec, nb, ns)
    eng_caches = {k: v.clone() for k, v in ref_caches.items()}
    want = _reference(model, cfg, batch, ref_caches, spec)
    x, rows = verify_inputs(batch, spec, scratch_slot=ns - 1)
    assert x["kda_slots"].tolist() == [1, 3, 0, 4] and x["seq_lens"].tolist() == [9, 24, 34, 4]
    got = _engine(model, cfg, spec, x, eng_caches)[rows]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-3)
    for layer in cfg.kda_layers:        # the session's rollback of requests shorter than Q
        for s, q in ((3, 1), (0, 2)):
            eng_caches[f"kda_state_{layer}"][s] = eng_caches[f"kda_step_state_{layer}"][s, q - 1]
            eng_caches[f"kda_conv_{layer}"][s] = eng_caches[f"kda_step_conv_{layer}"][s, q - 1]
        for kind in ("state", "conv"):
            for s in (1, 3, 0):
                torch.testing.assert_close(eng_caches[f"kda_{kind}_{layer}"][s], ref_caches[f"kda_{kind}_{layer}"][s],
                                           atol=2e-5, rtol=2e-4)
    for layer in cfg.mla_layers:        # padded rows wrote nothing
        torch.testing.assert_close(eng_caches[f"mla_cache_{layer}"], ref_caches[f"mla_cache_{layer}"])


def test_prefill_slices_equal_one_model_prefill(tiny_model):
    """A fresh 7-token sequence and a 5-token continuation run as exact slices (4+2+1, 4+1) of
    one-sequence engines, the fresh slot zeroed first: last-token logits and caches match."""
    cfg, model = tiny_model
    caps = Capacities((1,), (1, 2, 4), 3)
    specs = {s.capacity: s for s in graph_specs(cfg, caps, block_size=BLOCK, max_seq_len=MAX_SEQ,
                                                dtype=torch.float32, kv_dtype=torch.float32) if s.kind == "prefill"}
    g = torch.Generator().manual_seed(4)
    seqs = [Seq(torch.randint(0, 1000, (7,), generator=g).tolist(), 0, [3], 2, 1),
            Seq(torch.randint(0, 1000, (5,), generator=g).tolist(), 9, [0, 5], 1, 1)]
    batch = make_batch(seqs, BLOCK, capacity=16)
    ref_caches = _caches(cfg, specs[4], 8, 4)
    eng_caches = {k: v.clone() for k, v in ref_caches.items()}
    want = _reference(model, cfg, batch, ref_caches, specs[4])[batch.logit_rows]
    slices = prefill_slices(batch, caps.prefill)
    assert [(c.seq, c.start, c.capacity, c.last) for c in slices] == \
        [(0, 0, 4, False), (0, 4, 2, False), (0, 6, 1, True), (1, 0, 4, False), (1, 4, 1, True)]
    for layer in cfg.kda_layers:        # the session zeroes a fresh sequence's slot
        eng_caches[f"kda_state_{layer}"][2] = 0
        eng_caches[f"kda_conv_{layer}"][2] = 0
    last = {}
    for c in slices:
        x = prefill_inputs(batch, c, specs[c.capacity])
        logits = _engine(model, cfg, specs[c.capacity], x, eng_caches)
        if c.last:
            last[c.seq] = logits[0]
    torch.testing.assert_close(torch.stack([last[0], last[1]]), want, atol=2e-4, rtol=2e-3)
    for name, ref in ref_caches.items():
        if name.startswith("mla") or name.endswith(("_0", "_1", "_3")):
            rows = slice(None) if name.startswith("mla") else [1, 2]
            torch.testing.assert_close(eng_caches[name][rows], ref[rows], atol=2e-5, rtol=2e-4, msg=name)


def test_verify_inputs_refuse_a_step_that_does_not_fit(tiny_model):
    cfg, _ = tiny_model
    spec = graph_specs(cfg, Capacities((2,), (1,), 1), block_size=BLOCK, max_seq_len=MAX_SEQ, dtype=torch.float32,
                       kv_dtype=torch.float32)[0]
    batch = make_batch([Seq([1, 2, 3], 4, [0], 0, 3)], BLOCK, capacity=2)
    with pytest.raises(ValueError, match="runs 2 requests x 2 rows"):
        verify_inputs(batch, spec, scratch_slot=9)


@needs_rtx
@pytest.mark.slow
def test_more_native_engines_build_and_check(tiny_model, tmp_path):
    """Every capacity of a small plan, the chunked-prefill capacity (32, unrolled) included."""
    cfg, model = tiny_model
    caps = Capacities(verify=(1, 2, 4), prefill=(1, 2, 4, 8, 16, 32), spec_tokens=3)
    reports = build_rank(model, cfg, caps, tmp_path, backend="tensorrt-rtx", block_size=BLOCK, max_seq_len=MAX_SEQ,
                         check=True, options=BuildOptions(target="sm120", lowering="native"))
    assert len(reports) == 9 and all(r.bytes > 0 for r in reports)


@pytest.mark.gpu
def test_cuda_plumbing_of_the_session(tmp_path):
    """The session's cuda-python layer on a real GPU (no TensorRT needed): allocation, pinned
    staging, row copies and zeroing, weight upload by manifest, a captured and replayed graph,
    and zero-copy fp32 results for torch."""
    pytest.importorskip("cuda.bindings")
    cu = Cuda(0)
    a = cu.zeros((4, 3), torch.float32)
    src = torch.arange(12, dtype=torch.float32).view(4, 3)
    ptr, host = cu.pinned(src.numel() * 4)
    host[:] = src.view(torch.uint8).numpy().reshape(-1)
    cu.h2d(a.ptr, ptr, src.numel() * 4)
    b = cu.zeros((4, 3), torch.float32)
    steps = cu.zeros((4, 2, 3), torch.float32)
    cu.copy_row(b, 2, a, 1)                      # b[2] = a[1]
    cu.zero_row(a, 0)
    graph = cu.capture(lambda stream: cu.copy_row(b, 0, a, 3))
    cu.synchronize()
    assert torch.as_tensor(b, device="cuda")[0].sum().item() == 0      # captured, not run
    cu.launch(graph)
    cu.synchronize()
    got = torch.as_tensor(b, device="cuda").cpu()
    assert got[0].tolist() == [9, 10, 11] and got[2].tolist() == [3, 4, 5]
    assert torch.as_tensor(a, device="cuda").cpu()[0].tolist() == [0, 0, 0]
    cu.copy_row(steps, 0, a, 2)                  # a [4,3] row into steps[0, 0]
    cu.copy_row(b, 1, steps, 0, sub=0)           # rollback-style: b[1] = steps[0, 0]
    cu.synchronize()
    assert torch.as_tensor(b, device="cuda").cpu()[1].tolist() == [6, 7, 8]
    w = torch.randn(5, 7)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64 + w.numpy().tobytes())
    up = cu.load_weights(tmp_path, [{"name": "w", "dtype": "float32", "shape": [5, 7], "location": "weights.bin",
                                     "offset": 64, "length": w.numel() * 4}])
    assert torch.equal(torch.as_tensor(up["w"], device="cuda").cpu(), w)
