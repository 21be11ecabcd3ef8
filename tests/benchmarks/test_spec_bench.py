"""The speculation benchmarks' parts: the oracle drafter (benchmarks/oracle.py) plugged into
LLM.from_model through its ``drafter`` hook accepts at the rate it is set to and leaves greedy
output unchanged; benchmarks/spec_speedup.py runs its CPU smoke end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_e2e_bench import run_script

from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from oracle import OracleDrafter  # noqa: E402  (benchmarks/ is not a package)


def engine(model, k: int = 0, drafter=None, graphs: bool = False) -> LLM:
    """graphs: the graph session (on the CPU its static steps run uncaptured), where verify steps
    launch ahead of the host's commit and the oracle drafts on the device."""
    caps = Capacities.plan(max_batch=4, max_num_tokens=64, spec_tokens=k, verify=[1, 4])
    build = BuildConfig(dtype="fp32", block_size=16, max_num_tokens=64, max_seq_len=128)
    return LLM.from_model(model, build=build, capacities=caps, prefix_caching=False, spec_tokens=k or None,
                          drafter=drafter, cuda_graphs=graphs, adaptive_k=False)


@pytest.fixture(scope="module")
def plain_run(tiny_model):
    cfg, model = tiny_model
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(16, cfg.vocab_size, (4, 12), generator=g).tolist()
    outs = engine(model).generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


@pytest.mark.parametrize("ahead", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_oracle_accepts_at_its_rate(tiny_model, plain_run, alpha, ahead):
    cfg, model = tiny_model
    prompts, ref = plain_run
    oracle = OracleDrafter(cfg.vocab_size)
    oracle.set_references(prompts, ref)
    oracle.configure(alpha=alpha, seed=5)
    llm = engine(model, k=3, drafter=oracle, graphs=ahead)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref                   # greedy speculation is exact
    assert not oracle.diverged and oracle.evaluated >= 60
    assert (llm.stats()["launched_ahead"] > 0) == ahead
    spec = llm.stats()["speculative"]
    assert spec["method"] == "oracle" and oracle.drafted > 0
    # the runtime also counts the step that ends a request, whose commit the oracle never sees; a
    # step launched ahead past a request's end drafts rows the runtime does not count
    for n in ("drafted", "accepted"):
        assert abs(spec[f"{n}_tokens"] - getattr(oracle, n)) <= 2 * 3 * len(prompts), n
    if alpha == 1.0:
        assert oracle.alpha_measured == 1.0 and spec["accepted_tokens"] == spec["drafted_tokens"]
    elif alpha == 0.0:
        assert oracle.alpha_measured == 0.0 and spec["accepted_tokens"] == 0
    else:       # ~130 judged positions: a 0.15 band is ~3.5 standard deviations
        assert abs(oracle.alpha_measured - alpha) < 0.15, (oracle.alpha_measured, oracle.evaluated)


def off_reference(tiny_model, plain_run):
    """(prompts, plain outputs, references that leave them at token 10, as a bf16 argmax flip would,
    the oracle at α 1 on those, a K = 3 engine drafting with it)."""
    cfg, model = tiny_model
    prompts, ref = plain_run
    off = [r[:10] + [(t + 1) % cfg.vocab_size for t in r[10:]] for r in ref]
    oracle = OracleDrafter(cfg.vocab_size)
    oracle.set_references(prompts, off)
    oracle.configure(alpha=1.0)
    return prompts, ref, off, oracle, engine(model, k=3, drafter=oracle)


def test_a_case_reruns_requests_that_left_their_reference(tiny_model, plain_run):
    """A reference that leaves greedy at token 10 (as a bf16 argmax flip would): the first run stops
    drafting there; the rerun takes that run's output as the reference and drafts to the end."""
    import spec_cases  # noqa: PLC0415 (benchmarks/ on sys.path above)
    prompts, ref, _, oracle, llm = off_reference(tiny_model, plain_run)
    r = spec_cases.measure_case(llm, oracle, prompts, {"tokens_per_s": 1.0, "outputs": ref}, 3, 1.0, 40, reruns=2)
    assert r["reruns"] == 1 and r["run"] == 2 and r["held"] and r["diverged"] == 0
    assert r["exact"] and r["differ_from_plain"] == 0
    assert r["alpha_measured"] == 1.0 and r["tokens_per_step"] > 3


def test_a_run_off_its_reference_is_not_at_alpha_and_says_so(tiny_model, plain_run):
    """The figures of a run where requests left their reference (no drafts after the flip: few
    tokens per step) are marked as not at α, kept out of the goals, and the flip is no rejection
    in α measured; converging the references first makes the case's first run hold."""
    import spec_cases  # noqa: PLC0415 (benchmarks/ on sys.path above)
    import spec_report  # noqa: PLC0415
    prompts, ref, off, oracle, llm = off_reference(tiny_model, plain_run)
    base = {"tokens_per_s": 1.0, "outputs": ref}
    r = spec_cases.measure_case(llm, oracle, prompts, base, 3, 1.0, 40, reruns=0)
    assert r["run"] == 1 and not r["held"] and r["diverged"] == len(prompts)
    assert r["alpha_measured"] == 1.0 and oracle.evaluated == oracle.accepted > 0     # the flips are not judged
    assert r["tokens_per_step"] < 2          # drafts stopped at token 10 of 40
    row = {"name": "K3 b1 mtp a1.0", "kind": "spec", "spec_tokens": 3, "batch": 1, "cost": "mtp", "alpha": 1.0, **r}
    assert spec_report.mark(row)["name"].endswith("!α") and not spec_report.at_alpha(row)
    g = spec_report.goals([row])["b1_K3_a1.0_mtp_3.2x"]
    assert g["speedup"] is None and not g["met"] and "left their reference" in g["not_at_alpha"]

    oracle.set_references(prompts, off)
    assert spec_cases.converge(llm, oracle, prompts, 40, runs=3, seed=0) == 0
    oracle.configure(alpha=0.8, seed=1)
    r = spec_cases.measure_case(llm, oracle, prompts, base, 3, 0.8, 40, reruns=2)
    assert r["run"] == 1 and r["held"] and r["exact"] and abs(r["alpha_measured"] - 0.8) < 0.15


def test_the_deep_view_equals_a_model_with_those_weights_copied():
    """deep_model.deep_view: 13 layers on 6 built layers' tensors (no copies), each layer of its own
    kind, gives the tokens of a 13-layer model built with each layer's source weights copied in."""
    from deep_model import built_layers, deep_config, deep_view, source_layer  # noqa: PLC0415

    from k3trt.model.loader import build_model  # noqa: PLC0415
    raw, small = built_layers("tiny", 512, distinct=6, dtype=torch.float32, device="cpu", seed=1)
    cfg, deep = deep_view(raw, small, 13)
    assert deep_view(raw, small, 6)[1] is small
    assert {p.data_ptr() for p in deep.parameters()} == {p.data_ptr() for p in small.parameters()}
    assert cfg.linear_attn_config.kda_layers == tuple(i for i in range(1, 14) if i % 3)     # KDA, KDA, MLA, ...
    copy = build_model(deep_config(raw, 13), dtype=torch.float32)
    src = dict(small.named_parameters())
    with torch.no_grad():
        for name, p in copy.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"]:
                parts[2] = str(source_layer(int(parts[2]), 13, 6, 3))
            p.copy_(src[".".join(parts)])
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(16, 512, (2, 9), generator=g).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = [o.token_ids for o in engine(deep).generate(prompts, params)]
    assert got == [o.token_ids for o in engine(copy).generate(prompts, params)]
    assert got != [o.token_ids for o in engine(small).generate(prompts, params)]       # the depth is real
    with pytest.raises(ValueError, match="period"):
        built_layers("tiny", 512, distinct=5, dtype=torch.float32, device="cpu")


def test_oracle_refuses_unknown_prompts_and_bad_alpha(tiny_model):
    cfg, _ = tiny_model
    oracle = OracleDrafter(cfg.vocab_size)
    with pytest.raises(ValueError, match="alpha"):
        oracle.configure(alpha=1.5)
    from k3trt.runtime.speculative import DraftInput  # noqa: PLC0415
    with pytest.raises(KeyError, match="set_references"):
        oracle.propose([DraftInput("r", [1, 2, 3])], 3)


def test_decode_row_experts_switch_routes_every_row_as_the_first_and_restores(tiny_model):
    import spec_breakdown  # noqa: PLC0415 (benchmarks/ on sys.path above)

    from k3trt.model.moe import Router  # noqa: PLC0415
    cfg, model = tiny_model
    router = next(m for m in model.modules() if isinstance(m, Router))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    ids0, w0 = router(x)
    assert not (ids0 == ids0[:1]).all()                      # the rows pick different experts on their own
    with spec_breakdown.decode_row_experts(model):
        ids, w = router(x)
        assert torch.equal(ids, ids0[:1].expand_as(ids0)) and torch.equal(w, w0[:1].expand_as(w0))
    ids1, w1 = router(x)
    assert torch.equal(ids1, ids0) and torch.equal(w1, w0) and "forward" not in vars(router)


def test_spec_speedup_cpu_smoke(tmp_path):
    out = tmp_path / "spec.json"
    printed = run_script("benchmarks/spec_speedup.py", "--device", "cpu", "--preset", "tiny", "--quick",
                         "--vocab", "1024", "--json", str(out), timeout=300)
    doc = json.loads(out.read_text())
    assert not doc["errors"] and "K3 b1 mtp a0.8" in printed      # errors: also an engine outliving its run
    assert "MTP draft token : decode step at batch 1" in printed
    spec = [c for c in doc["cases"] if c["kind"] == "spec"]
    assert {(c["spec_tokens"], c["batch"], c["cost"], c["alpha"]) for c in spec} == \
        {(k, b, c, a) for k in (1, 3) for b in (1, 4) for c in ("free", "mtp") for a in (0.8, 1.0)}
    for c in doc["cases"]:
        assert "error" not in c, (c["name"], c.get("traceback"))
        assert c["tokens_per_s"] > 0 and "outputs" not in c
    for c in spec:
        assert c["exact"] and c["held"] and c["run"] == 1 and c["diverged"] == c["differ_from_plain"] == 0
        assert c["verify_ms"] > 0 and c["ideal_speedup"] > 0 and c["speedup_at_alpha"] > 0 and c["layers"] == 4
        assert c["ahead_share"] > 0.5          # verify steps launched ahead, the oracle drafting on the device
        if c["alpha"] == 1.0:
            assert c["alpha_measured"] == 1.0
    profiled = [c for c in spec if "profile" in c]       # each batch's first case per K, traced again
    assert sorted((c["spec_tokens"], c["batch"], c["cost"], c["alpha"]) for c in profiled) == \
        [(k, b, "mtp", 0.8) for k in (1, 3) for b in (1, 4)]
    assert all(c["profile"]["steps"] == 6 and c["profile"]["step_ms"] > 0 for c in profiled)
    assert set(doc["goals"]) == {"b1_K3_a0.8_mtp_2.5x", "b1_K3_a1.0_mtp_3.2x", "b32_K3_a0.8_mtp_1.5x",
                                 "b1_K3_verify_within_1.1x_decode"}


def test_spec_breakdown_cpu_smoke(tmp_path):
    out = tmp_path / "breakdown.json"
    printed = run_script("benchmarks/spec_speedup.py", "--device", "cpu", "--preset", "tiny", "--quick",
                         "--vocab", "1024", "--breakdown", "--breakdown-k", "2", "--json", str(out), timeout=300)
    r = json.loads(out.read_text())["breakdown"]
    assert "MoE expert count" in printed and r["rows"] == 3
    assert set(r["step_ms"]) == {"decode", "verify", "verify-same"} and min(r["step_ms"].values()) > 0
    parts = {p["part"]: p for p in r["parts"]}
    assert {"kda", "mla", "moe experts", "moe router", "lm_head", "other"} <= set(parts)
    assert all(parts["moe experts"][s] > 0 for s in ("decode", "verify", "verify-same"))
    assert r["moe_expert_count_ms"] == pytest.approx(r["step_ms"]["verify"] - r["step_ms"]["verify-same"], abs=1e-3)
    assert r["goal"]["ratio"] == r["verify_vs_decode"] and r["goal"]["ratio_same_experts"] == r["verify_same_vs_decode"]
    assert "without the MoE expert-count effect" in printed
    gemms = {g["gemm"]: g for g in r["router_gemms"]}
    assert gemms["fp32 x @ w.T (moe.Router)"]["max_diff"] == 0.0 and gemms["fp32 x @ w.T (moe.Router)"]["ms_3"] > 0
    assert "error" in gemms["bf16 mm, fp32 out (CUDA)"]          # no CPU kernel: a row saying so, not a crash


def test_breakdown_names_the_part_that_launched_each_kernel():
    import spec_breakdown  # noqa: PLC0415 (benchmarks/ on sys.path above)
    ev = lambda name, parent=None, kernels=(): SimpleNamespace(name=name, cpu_parent=parent,  # noqa: E731
                                                               kernels=[SimpleNamespace(name=k) for k in kernels])
    router = ev("moe router")
    mm = ev("aten::mm", ev("aten::matmul", router), ["cutlass_80_simt_sgemm_64x64", "splitKreduce_kernel"])
    loose = ev("aten::copy_", None, ["elementwise_kernel"])
    got = spec_breakdown.kernel_parts([router, mm, loose], {"moe router", "kda"})
    assert got == {"cutlass_80_simt_sgemm_64x64": "moe router", "splitKreduce_kernel": "moe router",
                   "elementwise_kernel": "other"}
    assert "router" in spec_breakdown.why("void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>")
    assert spec_breakdown.why("nvjet_sm90_tst_128x8") == ""


def test_batches_whose_cache_does_not_fit_are_skipped_with_the_reason(tiny_model):
    import spec_engines  # noqa: PLC0415 (benchmarks/ on sys.path above)
    import spec_speedup  # noqa: PLC0415
    cfg, _ = tiny_model
    a = spec_speedup.parse(["--device", "cpu", "--batches", "1,4"])
    a.max_seq_len = 512                      # caches of whole MiBs: the cap below is in MiB
    one = spec_engines.cache_plan(cfg, a, 3, [1]).total_bytes
    assert spec_engines.cache_plan(cfg, a, 3, [1, 4]).total_bytes > one > spec_engines.cache_plan(cfg, a, 0, [1]).total_bytes
    a.kv_cache_mb = -(-one // 2**20)         # room for batch 1 at K = 3, not batch 4
    doc = {"cases": [], "errors": []}
    run = spec_speedup.Run(a, doc)
    assert spec_engines.fitting_batches(run, cfg, 3, [1, 4]) == [1]
    assert [(c["name"], c["batch"]) for c in doc["cases"]] == [("K3 b4", 4)] and "GiB" in doc["cases"][0]["skipped"]


@pytest.mark.slow
def test_train_draft_cpu_smoke(tmp_path):
    out = tmp_path / "trained.json"
    printed = run_script("benchmarks/train_draft.py", "--device", "cpu", "--steps", "5", "--tiny",
                         "--out", str(tmp_path / "ckpt"), "--json", str(out), timeout=600)
    doc = json.loads(out.read_text())
    assert "small K3-architecture model trained here" in printed and doc["note"] in printed
    assert doc["training"]["steps"] == 5 and doc["data"]["train_tokens"] > 0 and doc["data"]["held_out_files"] > 0
    assert (tmp_path / "ckpt" / "config.json").is_file()
    names = {c["name"]: c for c in doc["cases"]}
    assert set(names) == {f"{m} b{b}" for m in ("none", "ngram", "mtp", "layerskip:2") for b in (1, 2)}
    for c in doc["cases"]:
        assert c["tokens_per_s"] > 0 and c.get("exact", True), c
    assert names["mtp b1"]["drafted_tokens"] > 0 and names["layerskip:2 b1"]["drafted_tokens"] > 0


@pytest.mark.gpu
def test_spec_benchmarks_gpu_smoke(tmp_path):
    """The GPU paths (graph replays, MTP-cost drafting, the profiler's CUDA kernels, bf16 autocast
    training) on tiny sizes: the full runs' first GPU contact."""
    tiny = ("--preset", "tiny", "--vocab", "1024", "--ks", "2", "--alphas", "0.8", "--batches", "1,4",
            "--prompt-len", "16", "--max-tokens", "12", "--kv-cache-mb", "512")
    run_script("benchmarks/spec_speedup.py", *tiny, "--json", str(tmp_path / "s.json"), timeout=600)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert not doc["errors"] and all("error" not in c for c in doc["cases"])
    assert all(c["verify_ms"] > 0 for c in doc["cases"] if c["kind"] == "spec")
    run_script("benchmarks/spec_speedup.py", *tiny, "--breakdown", "--json", str(tmp_path / "b.json"), timeout=600)
    r = json.loads((tmp_path / "b.json").read_text())["breakdown"]
    parts = {p["part"]: p for p in r["parts"]}
    assert parts["moe experts"]["decode"] > 0 and parts["kda"]["verify"] > 0
    assert any(k["part"] not in ("?", "other") for k in r["kernels_grown"])
    assert r["router_gemms"][0]["ms_1"] > 0 and r["router_gemms"][0]["max_diff"] == 0.0
    run_script("benchmarks/train_draft.py", "--device", "cuda", "--steps", "5", "--tiny", "--json",
               str(tmp_path / "t.json"), timeout=600)
    cases = {c["name"]: c for c in json.loads((tmp_path / "t.json").read_text())["cases"]}
    assert all(c["tokens_per_s"] > 0 for c in cases.values()) and cases["mtp b1"]["drafted_tokens"] > 0


def test_a_batch_whose_cache_does_not_fit_runs_at_the_deepest_that_does():
    import spec_engines  # noqa: PLC0415 (benchmarks/ on sys.path above)
    import spec_speedup  # noqa: PLC0415
    from deep_model import built_layers, deep_config  # noqa: PLC0415
    a = spec_speedup.parse(["--device", "cpu", "--preset", "tiny", "--layers", "12", "--distinct-layers", "6",
                            "--batches", "1,4"])
    raw, small = built_layers("tiny", 512, distinct=6, dtype=torch.float32, device="cpu")
    need = lambda layers, b: spec_engines.cache_plan(deep_config(raw, layers), a, 3, [b]).total_bytes  # noqa: E731
    a.max_seq_len = 4096                               # MiBs of cache a layer at batch 4
    a.kv_cache_mb = need(9, 4) >> 20                   # batch 1 fits 12 layers deep, batch 4 fewer
    assert need(12, 1) <= a.kv_cache_mb << 20 < need(12, 4)
    doc = {"cases": [], "errors": [], "notes": []}
    got = spec_speedup.depths(spec_speedup.Run(a, doc), raw, small)
    (deep, b1), (shallow, b4) = sorted(got.items(), reverse=True)
    assert deep == 12 and b1 == [1] and 6 <= shallow < 12 and b4 == [4]
    assert need(shallow, 4) <= a.kv_cache_mb << 20 < need(shallow + 1, 4)
    assert doc["notes"] == [f"batch 4: {shallow} layers (the deepest whose cache fits at K=3), not 12"]


def test_a_record_rederives_the_speedup_at_alpha_and_the_goals_from_its_measurements():
    import spec_report  # noqa: PLC0415 (benchmarks/ on sys.path above)
    spec = {"name": "K3 b1 mtp a0.8", "kind": "spec", "spec_tokens": 3, "batch": 1, "cost": "mtp", "alpha": 0.8,
            "expected_tokens_per_step": 2.952, "step_ms": 94.3, "speedup": 2.62, "held": True}
    doc = {"cases": [{"name": "plain b1", "kind": "plain", "batch": 1, "step_ms": 78.6}, spec]}
    spec_report.rederive(doc)
    assert spec["speedup_at_alpha"] == round(2.952 * 78.6 / 94.3, 3) < 2.5 < spec["speedup"]
    g = doc["goals"]["b1_K3_a0.8_mtp_2.5x"]
    assert not g["met"] and g["speedup_at_alpha"] == spec["speedup_at_alpha"] and g["speedup"] == 2.62
