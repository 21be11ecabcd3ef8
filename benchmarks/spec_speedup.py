"""Speculative decoding's speedup against acceptance, with the step's cost taken apart.

    PYTHONPATH=. python benchmarks/spec_speedup.py --json $OUT/spec_speedup.json        # H100 / H200, < 7 min
    PYTHONPATH=. python benchmarks/spec_speedup.py --quick --json $OUT/spec_speedup.json  # < 2.5 min
    PYTHONPATH=. python benchmarks/spec_speedup.py --breakdown --json $OUT/spec_breakdown.json
    PYTHONPATH=. python benchmarks/spec_speedup.py --device cpu --preset tiny [--quick]  # CPU smoke

Acceptance is set, not hoped for: the oracle drafter (benchmarks/oracle.py) proposes the target's
own greedy continuation, taken from the plain greedy run of the same prompts, with each position
replaced with probability 1 - α. So the figures hold for any weights (random here): they are what
k3trt delivers for a model whose drafts are accepted at rate α. One process:

  ceilings   copy bandwidth and bf16 GEMM rate (harness.py; a CPU stand-in with --device cpu)
  model      the preset (default ``spec``: K3's per-layer dimensions, 24 layers, 8 experts top-2,
             one MTP layer) built on the device with random weights
  engines    one plain, then one per K, each alone on the device: its cache sized from need (every
             request at --max-seq-len, KDA states for K + 1 positions), a batch whose cache would
             pass --kv-cache-mb skipped at that K with the reason; an engine lives only in the
             frame of the function that runs it, and the next one checks it is gone and its memory
             returned (else the record's errors say so)
  plain      per batch, plain greedy decoding (CUDA graphs, the one-step-ahead launch): tokens/s,
             and the reference outputs; then the (batch, 1) graph replayed alone: decode ms
  sync       per batch, the same prompts with speculation off per request on a speculating engine:
             synchronous steps, whose host time (step - decode ms) is the host work of a step
  sweep      per K an engine with the oracle drafter; per batch, drafting cost and α: tokens/s
             against plain at the same batch. Drafting costs: ``free`` (the oracle alone: the
             engine's ceiling) and ``mtp`` (the runtime's MTPDrafter on the target's MTP layer run
             on every propose, with its hidden-state hand-over, its tokens discarded; with its
             reduced draft vocabulary, --mtp-draft-vocab, and CUDA graphs where the runtime has
             them, else the record's notes say it ran without). After each batch the (batch, K+1)
             verify graph replayed alone: verify ms

Columns: draft ms per token (host wall of propose, device work synchronised), verify ms and its
ratio to decode ms, the verify graph (plain rows: the decode graph) against its roofline
(roofline.py: bytes / copy bandwidth or flops / GEMM rate, the ceilings of this run), host ms
exposed (step - draft - verify: the GPU waits) and hidden (the sync step's host work less the
exposed part; an estimate), the ceiling ``ideal×`` = E[tokens per step] × decode ms / verify ms
(free drafts, no host time; E = Σ_{i≤K} α^i) and the measured speedup's share of it, and ``k3×``:
a model, not a measurement, of the speedup at K3's 93 layers (spec_report.k3_model: decode and
verify ms scaled by 93 / layers, draft and host ms as measured; the preset's one MTP layer is
~1/24 of its step, K3's ~1/93). A verify step may take another argmax than plain decoding where two
logits are within bf16 rounding; the request then leaves its reference and the oracle stops
drafting for it, so such a run is not at α. Before a batch's cases its references are brought to
the speculating engine (runs at α 1, free drafts, each taking the last run's outputs as the
references of the requests that left theirs, up to --converge-runs runs), so no case pays for that;
a case then runs again the same way while requests leave their reference. Each row's figures come
from its last run (``run``, 1-based; the runs before it only set references) and ``held`` says
whether every request kept its reference there (``diverged``: those that did not); a row not held
is not at its α: the table marks it, the goals and the plot leave it out. Every row's output is
compared with the plain run's: ``exact``, and ``differ_from_plain`` requests (bf16 flips make
these differ; the oracle's references, not plain output, set α). Greedy, EOS ignored, fixed
max_tokens, prefix caching off. The JSON is rewritten after each case; cases
past --budget-s are skipped and say so. --breakdown: benchmarks/spec_breakdown.py instead of the
sweep. Plot: PNG beside the JSON when matplotlib imports.
"""

from __future__ import annotations

import argparse
import logging
import time
import traceback
import weakref
from pathlib import Path

import torch
from harness import best_s, cpu_ceilings, machine, measure, median_ms, record, write_json
from oracle import OracleDrafter
from roofline import Sizes, roofline
from spec_engines import engine, fitting_batches, mtp_drafter, settle
from spec_report import goals, k3_model, plot, report

from k3trt.config import ModelConfig
from k3trt.engine.build_config import BuildConfig
from k3trt.model.loader import build_model
from k3trt.model.presets import preset_config
from k3trt.model.weights import init_random_
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams

log = logging.getLogger("spec_speedup")
VOCAB = 129408          # the tokenizer's vocabulary rounded up, as make_checkpoint makes it


# ------------------------------------------------------------------------------ engines and runs
def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab - 16, (n, length), generator=g).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def drive(llm: LLM, ps: list[list[int]], max_tokens: int, *, speculate: bool = True,
          oracle: OracleDrafter | None = None) -> dict:
    """Submit every prompt, step until each has its first token, then time every step to the end."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculative=speculate)
    ids = [llm.add_request(p, params) for p in ps]
    outs: dict = {}

    def step() -> None:
        for o in llm.step():
            if o.request_id in ids:
                outs[o.request_id] = o
                if o.finished and o.error:
                    raise RuntimeError(f"{o.request_id}: {o.error}")

    while not all(r in outs and outs[r].token_ids for r in ids):
        step()
    sync(llm.session.device)
    if oracle is not None:
        oracle.reset_counters()
    before = sum(len(outs[r].token_ids) for r in ids)
    times = []
    while not all(outs[r].finished for r in ids):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    tokens, wall = sum(len(outs[r].token_ids) for r in ids) - before, sum(times)
    return {"decode_tokens": tokens, "decode_steps": len(times), "decode_s": round(wall, 5),
            "tokens_per_s": round(tokens / wall, 2) if wall else None,
            "step_ms": round(wall * 1e3 / len(times), 4) if times else None,
            "tokens_per_step": round(tokens / len(times) / len(ids), 3) if times else None,   # per request
            "outputs": [list(outs[r].token_ids) for r in ids]}


def step_ms(llm: LLM, batch: int, q: int) -> float | None:
    """The (capacity of `batch`, q) step alone, as it was last run: a graph replay timed by CUDA
    events, or on the CPU the static step host-timed. None: the engine has no such step."""
    s = llm.session
    cap = next((c for c in sorted(getattr(s, "capacities", ())) if c >= batch), None)
    st = getattr(s, "steps", {}).get((cap, q))
    if st is None:
        return None
    if st.graph is not None:
        return round(median_ms(st.graph.replay, warmup=2, reps=15), 4)
    with torch.inference_mode():
        return round(best_s(lambda: s._run_static(st), reps=3) * 1e3, 4)


def roofline_ms(run: "Run", model, batch: int, q: int) -> float:
    """The step's roofline (roofline.py) at the run's mean decode context, with its ceilings."""
    a, ceil = run.args, run.doc["machine"]["ceilings"]
    r = roofline(Sizes.of(model, next(model.parameters()).dtype), seqs=batch, q=q,
                 ctx=a.prompt_len + a.max_tokens / 2, copy_gbps=ceil["copy_gbps"], gemm_tflops=ceil["gemm_tflops"],
                 save_states=q > 1)
    return r["roofline_ms"]


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per verify step when each draft is accepted with probability α given the earlier ones."""
    return float(sum(alpha ** i for i in range(k + 1)))


# ------------------------------------------------------------------------------ the run
class Run:
    def __init__(self, args, doc: dict, base_bytes: int = 0):
        """base_bytes: device memory allocated before any engine (the model): what each closed
        engine must leave."""
        self.args, self.doc, self.t0, self.base_bytes = args, doc, time.perf_counter(), base_bytes
        self.last_engine: weakref.ref | None = None

    def skip(self, name: str, why: str, **meta) -> None:
        log.warning("%s skipped: %s", name, why)
        self.doc["cases"].append({"name": name, **meta, "skipped": why})
        self.save()

    def save(self) -> None:
        write_json(self.args.json, self.doc)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def case(self, name: str, fn, **meta) -> dict | None:
        """One case as a row (its failure is a row with the error); None when skipped."""
        if self.over_budget():
            self.doc["cases"].append({"name": name, **meta, "skipped": f"past the {self.args.budget_s}s budget"})
            self.save()
            return None
        t0 = time.perf_counter()
        try:
            row = {"name": name, **meta, **fn()}
        except Exception as e:                 # keep going: one case's failure is one row
            log.error("%s failed: %s: %s", name, type(e).__name__, e)
            row = {"name": name, **meta, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc(limit=6)[-3000:]}
        row["case_s"] = round(time.perf_counter() - t0, 2)
        log.info("%s: %s", name, {k: row.get(k) for k in ("tokens_per_s", "speedup", "alpha_measured", "error")
                                  if k in row})
        self.doc["cases"].append(row)
        self.save()
        return row


def plain_cases(run: Run, model, ps: dict) -> dict[int, dict]:
    """Plain decoding per batch: the baseline rows (with their outputs, the oracle's references)."""
    a, base = run.args, {}
    batches = fitting_batches(run, model.cfg, 0)
    if not batches:
        return base
    with engine(run, model, 0, batches) as llm:
        for b in batches:
            drive(llm, ps[b], 4)          # warm-up: shapes, kernels

            def plain(b=b):
                r = drive(llm, ps[b], a.max_tokens)
                r["decode_ms"] = step_ms(llm, b, 1)
                r["decode_roofline_ms"] = roofline_ms(run, model, b, 1)
                r["decode_vs_roofline"] = r["graph_vs_roofline"] = _ratio(r["decode_ms"], r["decode_roofline_ms"])
                r["host_exposed_ms"] = _minus(r["step_ms"], r["decode_ms"])
                return r
            row = run.case(f"plain b{b}", plain, kind="plain", batch=b)
            if row and "error" not in row:
                base[b] = row
    return base


def sweep(run: Run, model, ps: dict, base: dict[int, dict]) -> None:
    a, cfg = run.args, model.cfg
    oracle = OracleDrafter(cfg.vocab_size)
    for b, row in base.items():
        oracle.set_references(ps[b], row["outputs"])
    host_sync: dict[int, float | None] = {}
    for k in a.ks:
        if run.over_budget():
            run.doc["errors"].append(f"K={k}: past the {a.budget_s}s budget")
            continue
        batches = [b for b in fitting_batches(run, cfg, k) if b in base]
        if not batches:
            continue
        try:
            sweep_engine(run, model, oracle, k, batches, ps, base, host_sync)
        except Exception as e:
            log.error("K=%d engine: %s: %s", k, type(e).__name__, e)
            run.doc["errors"].append(f"K={k} engine: {type(e).__name__}: {e}")
        finally:
            oracle.configure(alpha=1.0, cost=None)


def sweep_engine(run: Run, model, oracle: OracleDrafter, k: int, batches: list[int], ps: dict,
                 base: dict[int, dict], host_sync: dict) -> None:
    with engine(run, model, k, batches, drafter=oracle) as llm:
        sweep_batches(run, model, llm, oracle, k, batches, ps, base, host_sync)


def sweep_batches(run: Run, model, llm: LLM, oracle: OracleDrafter, k: int, batches: list[int], ps: dict,
                  base: dict[int, dict], host_sync: dict) -> None:
    a = run.args
    mtp = mtp_drafter(run, model, llm, k, max(batches)) if "mtp" in a.costs else None
    for b in batches:
        if b not in host_sync:      # speculation off per request: synchronous q = 1 steps
            drive(llm, ps[b], 4, speculate=False)                      # warm-up
            r = drive(llm, ps[b], a.max_tokens, speculate=False)
            host_sync[b] = _minus(r["step_ms"], base[b]["decode_ms"])
            base[b]["host_sync_ms"] = host_sync[b]
            base[b]["host_hidden_ms"] = _hidden(host_sync[b], base[b]["host_exposed_ms"])
        off = 0 if run.over_budget() else converge(llm, oracle, ps[b], a.max_tokens, a.converge_runs, a.seed)
        if off:
            run.doc["notes"].append(f"K{k} b{b}: {off} requests still off their reference after {a.converge_runs} "
                                    "runs at α 1 (the cases rerun them too)")
        rows = []
        for cost in a.costs:
            oracle.configure(alpha=1.0, cost=mtp if cost == "mtp" else None)
            drive(llm, ps[b], 2 * k + 2)      # warm-up (the oracle knows only these prompts)
            for alpha in a.alphas:
                def spec(b=b, alpha=alpha, cost=cost):
                    oracle.configure(alpha=alpha, seed=a.seed, cost=mtp if cost == "mtp" else None)
                    return measure_case(llm, oracle, ps[b], base[b], k, alpha, a.max_tokens, a.reruns)
                row = run.case(f"K{k} b{b} {cost} a{alpha}", spec, kind="spec", spec_tokens=k, batch=b,
                               cost=cost, alpha=alpha)
                if row and "error" not in row:
                    rows.append(row)
        verify, roof = step_ms(llm, b, k + 1), roofline_ms(run, model, b, k + 1)
        for row in rows:            # the verify step alone, as the batch last ran it
            finish_row(row, verify, base[b]["decode_ms"], host_sync[b])
            row["verify_roofline_ms"] = roof
            row["verify_vs_roofline"] = row["graph_vs_roofline"] = _ratio(verify, roof)
        run.save()
    oracle.configure(alpha=1.0, cost=None)      # the oracle outlives the engine: drop its MTP drafter


def run_until_held(llm: LLM, oracle: OracleDrafter, ps: list, max_tokens: int, reruns: int) -> tuple[dict, int]:
    """Runs of the prompts until one ends with every request on its reference (at most reruns + 1);
    after a run where some left theirs (a verify step's argmax other than plain decoding's, within
    bf16 rounding), those requests take its outputs as their references. The last run and its index."""
    for rerun in range(reruns + 1):
        r = drive(llm, ps, max_tokens, oracle=oracle)
        if not oracle.diverged or rerun == reruns:
            break
        for p, out in zip(ps, r["outputs"]):
            if tuple(p) in oracle.diverged:
                oracle.set_references([p], [out])
        oracle.configure(alpha=oracle.alpha, seed=oracle.seed, cost=oracle.cost)
    return r, rerun


def converge(llm: LLM, oracle: OracleDrafter, ps: list, max_tokens: int, runs: int, seed: int) -> int:
    """The references brought to this engine's verify numerics before a batch's cases (at α 1, free
    drafts), so no case (the first, say) pays for it. Requests still off their reference after it."""
    oracle.configure(alpha=1.0, seed=seed, cost=None)
    if runs > 0:
        run_until_held(llm, oracle, ps, max_tokens, runs - 1)
    off = len(oracle.diverged)
    oracle.configure(alpha=1.0, seed=seed, cost=None)
    return off


def measure_case(llm: LLM, oracle: OracleDrafter, ps: list, base: dict, k: int, alpha: float, max_tokens: int,
                 reruns: int) -> dict:
    """One case: its figures come from the last of run_until_held's runs (``run``, 1-based);
    ``held`` False where requests left their reference in it (``diverged``): they got no drafts
    from there on, so its figures are not at α."""
    r, rerun = run_until_held(llm, oracle, ps, max_tokens, reruns)
    outs = r.pop("outputs")
    r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if r["tokens_per_s"] else None
    r["exact"] = outs == base["outputs"]
    r["differ_from_plain"] = sum(o != b for o, b in zip(outs, base["outputs"]))     # requests
    r["reruns"], r["run"] = rerun, rerun + 1
    r["diverged"] = len(oracle.diverged)
    r["held"] = not oracle.diverged
    r["alpha_measured"] = round(oracle.alpha_measured, 4) if oracle.alpha_measured is not None else None
    r["drafted_tokens"] = oracle.drafted
    r["draft_ms_per_token"] = round(oracle.draft_s * 1e3 / oracle.drafted, 4) if oracle.drafted else None
    r["draft_ms_per_step"] = round(oracle.draft_s * 1e3 / r["decode_steps"], 4) if r["decode_steps"] else None
    r["expected_tokens_per_step"] = round(expected_tokens(alpha, k), 3)
    return r


def finish_row(row: dict, verify_ms: float | None, decode_ms: float | None, host_sync: float | None) -> None:
    row["verify_ms"], row["decode_ms"] = verify_ms, decode_ms
    row["verify_vs_decode"] = round(verify_ms / decode_ms, 3) if verify_ms and decode_ms else None
    row["host_exposed_ms"] = _minus(_minus(row["step_ms"], row["draft_ms_per_step"]), verify_ms)
    row["host_hidden_ms"] = _hidden(host_sync, row["host_exposed_ms"])
    if row["verify_vs_decode"]:
        row["ideal_speedup"] = round(row["expected_tokens_per_step"] / row["verify_vs_decode"], 3)
        row["of_ideal"] = round(row["speedup"] / row["ideal_speedup"], 3) if row.get("speedup") else None


def _ratio(x, y):
    return round(x / y, 3) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None


def _minus(x, y):
    return round(x - y, 4) if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None


def _hidden(host_sync, exposed):
    return round(max(0.0, host_sync - exposed), 4) if host_sync is not None and exposed is not None else None


# ------------------------------------------------------------------------------ main
def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="spec")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (batches 1,4, prompt 16, 12 tokens)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a ~2-minute subset: K 1,3; α 0.8,1.0; batches 1,32")
    ap.add_argument("--alphas", default="0.5,0.7,0.8,0.9,1.0")
    ap.add_argument("--ks", default="1,2,3,4,5")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--costs", default="free,mtp", help="drafting costs: free, mtp")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--kv-cache-mb", type=int, default=None,
                    help="cap on each engine's exactly sized cache (default: free memory after the model less "
                         "--reserve-mb); a batch whose cache exceeds it at some K is skipped there and says so")
    ap.add_argument("--reserve-mb", type=int, default=8192, help="left free for graphs, activations, the MTP drafter")
    ap.add_argument("--budget-s", type=int, default=None,
                    help="skip cases that would start after this (default 330, --quick 90: whole runs < 7 / 2.5 min)")
    ap.add_argument("--reruns", type=int, default=3, help="runs again of a case whose requests left their reference")
    ap.add_argument("--converge-runs", type=int, default=6,
                    help="runs at α 1 before a batch's cases that bring its references to the speculating engine")
    ap.add_argument("--mtp-draft-vocab", type=int, default=32768,
                    help="the MTP drafter's reduced vocabulary (0: the full head), where the runtime has one")
    ap.add_argument("--mtp-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="the MTP drafter's CUDA graphs (default: the runtime's choice), where the runtime has them")
    ap.add_argument("--breakdown", action="store_true", help="verify vs decode per op at batch 1 (spec_breakdown.py)")
    ap.add_argument("--breakdown-k", type=int, default=3)
    ap.add_argument("--breakdown-ctx", type=int, default=256, help="cached tokens before the profiled step")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: beside --json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ks, args.alphas, args.batches, args.max_tokens = "1,3", "0.8,1.0", "1,32", 32
    if args.budget_s is None:
        args.budget_s = 90 if args.quick else 330
    if args.device == "cpu":            # a smoke run: small batches, short prompts and outputs
        args.batches, args.max_tokens, args.prompt_len, args.max_num_tokens, args.kv_cache_mb = "1,4", 12, 16, 256, 256
        args.breakdown_ctx = 16
        torch.set_num_threads(1)        # tiny steps: one thread beats two fighting over CI's cores
    floats = lambda s: [float(x) for x in s.split(",") if x]   # noqa: E731
    args.alphas, args.ks, args.batches = floats(args.alphas), [int(x) for x in floats(args.ks)], \
        [int(x) for x in floats(args.batches)]
    args.costs = [c for c in args.costs.split(",") if c]
    if args.mtp_draft_vocab >= args.vocab:      # small test vocabularies: a quarter of them
        args.mtp_draft_vocab = args.vocab // 4
    if set(args.costs) - {"free", "mtp"}:
        ap.error(f"--costs takes free and mtp, got {args.costs}")
    args.dtype = "bf16" if torch.device(args.device).type == "cuda" else "fp32"
    if args.plot is None and args.json is not None:
        args.plot = args.json.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    device = torch.device(a.device)
    doc = record(__file__, argv, note="random weights; acceptance set by the oracle drafter (benchmarks/oracle.py): "
                 "the target's own greedy continuation, each position replaced with probability 1 - alpha",
                 machine=machine(device), preset=a.preset, dtype=a.dtype,
                 settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                 cases=[], errors=[], notes=[])
    doc["machine"]["ceilings"] = measure() if device.type == "cuda" else cpu_ceilings()
    t0 = time.perf_counter()
    cfg = ModelConfig.from_dict(preset_config(a.preset, a.vocab))
    model = build_model(cfg, dtype=BuildConfig(dtype=a.dtype).torch_dtype, device=device)
    init_random_(model, a.seed, device=device)
    sync(device)
    doc["model"] = {"params": sum(p.numel() for p in model.parameters()), "layers": cfg.num_hidden_layers,
                    "mtp_layers": cfg.num_nextn_predict_layers, "experts": cfg.num_experts,
                    "top_k": cfg.num_experts_per_token, "init_s": round(time.perf_counter() - t0, 2)}
    log.info("model: %.2fB parameters on %s in %.1fs", doc["model"]["params"] / 1e9, device, doc["model"]["init_s"])
    if device.type == "cuda":
        torch.cuda.empty_cache()        # the ceilings' buffers: free memory is what engines can have
    if a.kv_cache_mb is None:
        a.kv_cache_mb = (torch.cuda.mem_get_info(device)[0] >> 20) - a.reserve_mb if device.type == "cuda" else 1024
        doc["settings"]["kv_cache_mb"] = a.kv_cache_mb
    log.info("engine caches capped at %d MiB each", a.kv_cache_mb)
    run = Run(a, doc, base_bytes=torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)
    if a.breakdown:
        import spec_breakdown  # noqa: PLC0415 (only this mode)
        doc["breakdown"] = spec_breakdown.run(model, a.breakdown_k, device, ctx=a.breakdown_ctx,
                                              ceil=doc["machine"]["ceilings"])
        run.save()
        spec_breakdown.report(doc["breakdown"], doc["machine"]["ceilings"])
        return doc
    ps = {b: prompts(b, a.prompt_len, cfg.vocab_size, b) for b in a.batches}
    base = plain_cases(run, model, ps)
    sweep(run, model, ps, base)
    settle(run)
    for c in doc["cases"]:
        c.pop("outputs", None)
    k3_model(doc["cases"], cfg.num_hidden_layers)
    doc["goals"] = goals(doc["cases"])
    run.save()
    report(doc)
    plot(doc, a.plot)
    return doc


if __name__ == "__main__":
    # logging is the script's to configure, not main()'s: a smoke test may call main() in-process
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("k3trt.model.checkpoint_io", "k3trt.runtime.kv_cache", "k3trt.runtime.llm"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    main()
