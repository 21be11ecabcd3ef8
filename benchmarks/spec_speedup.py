"""Speculative decoding's speedup against acceptance, with the step's cost taken apart.

    PYTHONPATH=. python benchmarks/spec_speedup.py --json $OUT/spec_speedup.json          # H100 / H200, < 9 min
    PYTHONPATH=. python benchmarks/spec_speedup.py --quick --json $OUT/spec_speedup.json    # < 3 min
    PYTHONPATH=. python benchmarks/spec_speedup.py --breakdown --preset medium --json $OUT/spec_breakdown.json
    PYTHONPATH=. python benchmarks/spec_speedup.py --device cpu --preset tiny [--quick]    # CPU smoke

Acceptance is set, not hoped for: the oracle drafter (benchmarks/oracle.py) proposes the target's
own greedy continuation, taken from the plain greedy run of the same prompts, with each position's
draft replaced with probability 1 - α. So the figures hold for any weights (random here): they are
what k3trt delivers for a model whose drafts are accepted at rate α. One process:

  ceilings   copy bandwidth and bf16 GEMM rate (harness.py; a CPU stand-in with --device cpu)
  model      the preset (default ``spec``: K3's per-layer sizes, 8 layers, 8 experts top-2, one MTP
             layer) run as deep as K3 (--layers, 93) on its own layers' weights in turn
             (deep_model.py: every layer reads its weights from HBM and has its own KV cache and
             KDA state), so the MTP layer is K3's share of a step. A batch whose cache (every
             request at --max-seq-len, KDA states for K + 1 positions at the goals' K = 3) does not
             fit the device at that depth runs at the deepest that fits; its rows say so (``layers``)
  engines    per depth one plain, then per K one per depth, each alone on the device with its cache
             sized from need; a batch whose cache would pass --kv-cache-mb is skipped at that K with the
             reason; the next engine checks the last one is gone and its memory returned
  plain      per batch, plain greedy decoding (CUDA graphs, the one-step-ahead launch): tokens/s,
             and the reference outputs; then the (batch, 1) graph replayed alone: decode ms
  sync       per batch, the same prompts with speculation off per request on a speculating engine:
             synchronous steps, whose host time (step - decode ms) is the host work of a step
  sweep      per K an engine with the oracle drafter; per batch, drafting cost and α: tokens/s
             against plain at the same batch. Verify steps launch ahead of the host's commit
             (runtime/spec_ahead.py) where the runtime allows, the oracle drafting on the device.
             Drafting costs: ``free`` (the oracle alone: the engine's ceiling) and ``mtp`` (the
             runtime's MTP drafter, mtp_ahead.MTPAhead, on the target's MTP layer run on every
             proposal, host or device, with its hidden-state hand-over, its tokens discarded; its
             reduced draft vocabulary, --mtp-draft-vocab, and CUDA graphs on host proposals).
             After each batch the (batch, K+1) verify graph replayed alone: verify ms
  profile    per batch and K, its first case traced again over --profile-steps steps (step_trace.py):
             GPU busy and idle ms a step, the idle put down to the function that launched the work
             ending each gap, the kernels outside CUDA graphs, the host's waits on the device

Columns: draft ms per token (host proposals: wall time, device work synchronised; device
proposals: CUDA-event time of the cost drafter and the lookup), verify ms and its ratio to decode
ms, the verify graph (plain rows: the decode graph) against its roofline (roofline.py: bytes / copy
bandwidth or flops / GEMM rate, the ceilings of this run), host ms exposed (step - draft - verify:
the GPU waits) and hidden (the sync step's host work less the exposed part; an estimate), ahead
(steps launched before the host's commit / steps), the ceiling ``ideal×`` = E[tokens per step] ×
decode ms / verify ms (free drafts, no host time; E = Σ_{i≤K} α^i) and the measured speedup's share
of it. A verify step may take another argmax than plain decoding where two logits are within bf16
rounding; the request then leaves its reference and the oracle stops drafting for it, so such a run
is not at α. Before a batch's cases its references are brought to the speculating engine (runs at α
1, free drafts, each taking the last run's outputs as the references of the requests that left
theirs, up to --converge-runs runs); a case then runs again the same way while requests leave their
reference. Each row's figures come from its last run (``run``, 1-based) and ``held`` says whether
every request kept its reference there (``diverged``: those that did not); a row not held is not at
its α: the table marks it, the goals and the plot leave it out. Every row's output is compared with
the plain run's: ``exact``, and ``differ_from_plain`` requests (bf16 flips; the oracle's references,
not plain output, set α). Greedy, EOS ignored, fixed max_tokens, prefix caching off. The JSON is
rewritten after each case; cases past --budget-s are skipped and say so (K, α and costs run in the
order given: the goals' first). --breakdown: benchmarks/spec_breakdown.py instead of the sweep.
Plot: PNG beside the JSON when matplotlib imports.
"""

from __future__ import annotations

import argparse
import logging
import time
import traceback
import weakref
from pathlib import Path

import torch
from deep_model import built_layers, deep_config, deep_view
from harness import cpu_ceilings, machine, measure, record, write_json
from oracle import OracleDrafter
from spec_cases import (converge, drive, finish_row, hidden_ms, measure_case, minus, profile_case, ratio, roofline_ms,
                        step_ms, sync)
from spec_engines import cache_plan, engine, fitting_batches, mtp_drafter, settle
from spec_report import goals, plot, report
from step_trace import report_trace

from k3trt.engine.build_config import BuildConfig
from k3trt.runtime.llm import LLM
from k3trt.runtime.mtp_ahead import MTPAhead

log = logging.getLogger("spec_speedup")
VOCAB = 129408          # the tokenizer's vocabulary rounded up, as make_checkpoint makes it
GOAL_K = 3              # the depth of a batch is the deepest whose cache fits at this K


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab - 16, (n, length), generator=g).tolist()


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


def plain_cases(run: Run, model, ps: dict, batches: list[int]) -> dict[int, dict]:
    """Plain decoding per batch: the baseline rows (with their outputs, the oracle's references)."""
    a, base, ceil = run.args, {}, run.doc["machine"]["ceilings"]
    batches = fitting_batches(run, model.cfg, 0, batches)
    if not batches:
        return base
    with engine(run, model, 0, batches) as llm:
        for b in batches:
            drive(llm, ps[b], 4)          # warm-up: shapes, kernels

            def plain(b=b):
                r = drive(llm, ps[b], a.max_tokens)
                r["decode_ms"] = step_ms(llm, b, 1)
                r["decode_roofline_ms"] = roofline_ms(a, ceil, model, b, 1)
                r["decode_vs_roofline"] = r["graph_vs_roofline"] = ratio(r["decode_ms"], r["decode_roofline_ms"])
                r["host_exposed_ms"] = minus(r["step_ms"], r["decode_ms"])
                return r
            row = run.case(f"plain b{b}", plain, kind="plain", batch=b, layers=model.cfg.num_hidden_layers)
            if row and "error" not in row:
                base[b] = row
    return base


def sweep(run: Run, views: dict, ps: dict, bases: dict[int, dict]) -> None:
    """Per K (in the order given), per depth: an engine with the oracle drafter over its batches."""
    a, host_sync = run.args, {}
    oracle = OracleDrafter(next(iter(views.values())).cfg.vocab_size)
    for base in bases.values():
        for b, row in base.items():
            oracle.set_references(ps[b], row["outputs"])
    for k in a.ks:
        for layers, model in views.items():
            if run.over_budget():
                run.doc["errors"].append(f"K={k} ({layers} layers): past the {a.budget_s}s budget")
                continue
            batches = fitting_batches(run, model.cfg, k, list(bases[layers]))
            if not batches:
                continue
            try:
                sweep_engine(run, model, oracle, k, batches, ps, bases[layers], host_sync)
            except Exception as e:
                log.error("K=%d engine (%d layers): %s: %s", k, layers, type(e).__name__, e)
                run.doc["errors"].append(f"K={k} engine ({layers} layers): {type(e).__name__}: {e}")
            finally:
                oracle.configure(alpha=1.0, cost=None)


def sweep_engine(run: Run, model, oracle: OracleDrafter, k: int, batches: list[int], ps: dict,
                 base: dict[int, dict], host_sync: dict) -> None:
    with engine(run, model, k, batches, drafter=oracle) as llm:
        sweep_batches(run, model, llm, oracle, k, batches, ps, base, host_sync)


def sweep_batches(run: Run, model, llm: LLM, oracle: OracleDrafter, k: int, batches: list[int], ps: dict,
                  base: dict[int, dict], host_sync: dict) -> None:
    a, ceil, layers = run.args, run.doc["machine"]["ceilings"], model.cfg.num_hidden_layers
    mtp = MTPAhead(mtp_drafter(run, model, llm, k, max(batches))) if "mtp" in a.costs else None
    for b in batches:
        if b not in host_sync:      # speculation off per request: synchronous q = 1 steps
            drive(llm, ps[b], 4, speculate=False)                      # warm-up
            r = drive(llm, ps[b], a.max_tokens, speculate=False)
            host_sync[b] = minus(r["step_ms"], base[b]["decode_ms"])
            base[b]["host_sync_ms"] = host_sync[b]
            base[b]["host_hidden_ms"] = hidden_ms(host_sync[b], base[b]["host_exposed_ms"])
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
                               cost=cost, alpha=alpha, layers=layers)
                if row and "error" not in row:
                    rows.append(row)
                    if a.profile_steps and len(rows) == 1:      # the batch's first case: the goals' own
                        try:
                            row["profile"] = profile_case(llm, ps[b], a.max_tokens, a.profile_steps)
                            report_trace(row["name"], row["profile"], ceil)
                        except Exception as e:          # the trace is an aid: its failure costs no case
                            log.error("%s profile: %s: %s", row["name"], type(e).__name__, e)
                            row["profile"] = {"error": f"{type(e).__name__}: {e}"}
        verify, roof = step_ms(llm, b, k + 1), roofline_ms(a, ceil, model, b, k + 1)
        for row in rows:            # the verify step alone, as the batch last ran it
            finish_row(row, verify, base[b]["decode_ms"], host_sync[b])
            row["verify_roofline_ms"] = roof
            row["verify_vs_roofline"] = row["graph_vs_roofline"] = ratio(verify, roof)
        run.save()
    oracle.configure(alpha=1.0, cost=None)      # the oracle outlives the engine: drop its MTP drafter


def depths(run: Run, raw: dict, small) -> dict[int, list[int]]:
    """Depth -> the batches run at it: --layers, or for a batch whose cache at K = GOAL_K does not
    fit --kv-cache-mb there, the deepest that fits (at least the built layers)."""
    a, out = run.args, {}
    for b in a.batches:
        L = a.layers
        while L > small.cfg.num_hidden_layers and \
                cache_plan(deep_config(raw, L), a, GOAL_K, [b]).total_bytes > a.kv_cache_mb << 20:
            L -= 1
        if L < a.layers:
            run.doc["notes"].append(f"batch {b}: {L} layers (the deepest whose cache fits at K={GOAL_K}), "
                                    f"not {a.layers}")
        out.setdefault(L, []).append(b)
    return out


def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="spec")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: K3's 93 for the spec preset, "
                    "else the preset's own)")
    ap.add_argument("--distinct-layers", type=int, default=None,
                    help="built layers whose weights the deep model reads in turn (default: the preset's own)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (batches 1,4, prompt 16, 12 tokens)")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a ~3-minute subset: K 3,1; α 0.8,1.0; batches 1,32")
    ap.add_argument("--alphas", default="0.8,1.0,0.5,0.7,0.9")
    ap.add_argument("--ks", default="3,1,2,4,5")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--costs", default="mtp,free", help="drafting costs: mtp, free")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    ap.add_argument("--max-seq-len", type=int, default=320)
    ap.add_argument("--kv-cache-mb", type=int, default=None,
                    help="cap on each engine's exactly sized cache (default: free memory after the model less "
                         "--reserve-mb); a batch whose cache exceeds it at some K is skipped there and says so")
    ap.add_argument("--reserve-mb", type=int, default=16384,
                    help="left free for graphs, activations (batch 32 prefills 4K tokens), the MTP drafter")
    ap.add_argument("--budget-s", type=int, default=None,
                    help="skip cases that would start after this (default 450, --quick 120)")
    ap.add_argument("--reruns", type=int, default=3, help="runs again of a case whose requests left their reference")
    ap.add_argument("--converge-runs", type=int, default=6,
                    help="runs at α 1 before a batch's cases that bring its references to the speculating engine")
    ap.add_argument("--mtp-draft-vocab", type=int, default=32768,
                    help="the MTP drafter's reduced vocabulary (0: the full head)")
    ap.add_argument("--mtp-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="the MTP drafter's CUDA graphs on host proposals (default: on CUDA)")
    ap.add_argument("--profile-steps", type=int, default=6,
                    help="steps traced (step_trace.py) in each batch's first case per K: where the GPU waits (0: off)")
    ap.add_argument("--breakdown", action="store_true", help="verify vs decode per op at batch 1 (spec_breakdown.py)")
    ap.add_argument("--breakdown-k", type=int, default=3)
    ap.add_argument("--breakdown-ctx", type=int, default=256, help="cached tokens before the profiled step")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: beside --json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ks, args.alphas, args.batches = "3,1", "0.8,1.0", "1,32"
    if args.budget_s is None:
        args.budget_s = 120 if args.quick else 450
    if args.device == "cpu":            # a smoke run: small batches, short prompts and outputs
        args.batches, args.max_tokens, args.prompt_len, args.max_num_tokens, args.kv_cache_mb = "1,4", 12, 16, 256, 256
        args.breakdown_ctx, args.max_seq_len = 16, 64
        torch.set_num_threads(1)        # tiny steps: one thread beats two fighting over CI's cores
    if args.layers is None:
        args.layers = 93 if args.preset == "spec" and not args.breakdown else 0       # 0: the preset's own
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
    dtype = BuildConfig(dtype=a.dtype).torch_dtype
    raw, small = built_layers(a.preset, a.vocab, distinct=a.distinct_layers, dtype=dtype, device=device, seed=a.seed)
    a.layers = a.layers or small.cfg.num_hidden_layers
    sync(device)
    cfg = small.cfg
    doc["model"] = {"params": sum(p.numel() for p in small.parameters()), "layers": a.layers,
                    "distinct_layers": cfg.num_hidden_layers, "mtp_layers": cfg.num_nextn_predict_layers,
                    "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token,
                    "init_s": round(time.perf_counter() - t0, 2)}
    log.info("model: %.2fB parameters (%d layers built, run %d deep) on %s in %.1fs", doc["model"]["params"] / 1e9,
             cfg.num_hidden_layers, a.layers, device, doc["model"]["init_s"])
    if device.type == "cuda":
        torch.cuda.empty_cache()        # the ceilings' buffers: free memory is what engines can have
    if a.kv_cache_mb is None:
        a.kv_cache_mb = (torch.cuda.mem_get_info(device)[0] >> 20) - a.reserve_mb if device.type == "cuda" else 1024
        doc["settings"]["kv_cache_mb"] = a.kv_cache_mb
    log.info("engine caches capped at %d MiB each", a.kv_cache_mb)
    run = Run(a, doc, base_bytes=torch.cuda.memory_allocated(device) if device.type == "cuda" else 0)
    if a.breakdown:
        import spec_breakdown  # noqa: PLC0415 (only this mode)
        doc["breakdown"] = spec_breakdown.run(small, a.breakdown_k, device, ctx=a.breakdown_ctx,
                                              ceil=doc["machine"]["ceilings"])
        run.save()
        spec_breakdown.report(doc["breakdown"], doc["machine"]["ceilings"])
        return doc
    ps = {b: prompts(b, a.prompt_len, cfg.vocab_size, b) for b in a.batches}
    groups = sorted(depths(run, raw, small).items(), reverse=True)
    views = {layers: deep_view(raw, small, layers)[1] for layers, _ in groups}     # no weight memory each
    bases = {layers: plain_cases(run, views[layers], ps, batches) for layers, batches in groups}
    sweep(run, views, ps, bases)
    del views
    settle(run)
    for c in doc["cases"]:
        c.pop("outputs", None)
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
