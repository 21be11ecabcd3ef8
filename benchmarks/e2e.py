"""End-to-end speed of the medium preset (K3's per-layer dimensions, 4 layers, 32 experts top-16)
against its roofline, with baselines from the same run.

    PYTHONPATH=. python benchmarks/e2e.py --json $OUT/e2e.json                  # H200, ~5 min
    PYTHONPATH=. python benchmarks/e2e.py --preset tiny --device cpu --quick    # CPU smoke, seconds

One process: the copy bandwidth and bf16 GEMM rate (benchmarks/harness.py; a crude CPU stand-in
with --device cpu), then the model built on the device with random weights (init_random_ drawing
on the device; no checkpoint on disk), then the cases, each through LLM.from_model with token-id
prompts, greedy, EOS ignored, a fixed max_tokens, prefix caching off:

  decode     batches 1, 8, 32, 128, CUDA graphs on: decode tokens/s, median step latency, and the
             step's roofline (``roofline``) and measured / roofline
  prefill    P prompts of L tokens, max_tokens 1 (eager prefill, chunked at max_num_tokens)
  spec       the layer-skip self-draft (layerskip:N, K drafts) at batch 1 and 8: tokens/s, accepted
             length, speedup over decode at the same batch; its roofline is the verify step's
  eager      the same engine with cuda_graphs=False at batch 1 and 32 (graphs / eager speedup), and
             "eager-ref" at batch 1: also without plugins (every k3trt op's CUDA kernel disabled, so
             each runs its plain-torch reference)
  hf         transformers' DeepseekV3ForCausalLM at the same dimensions (random bf16 weights)
             ``generate`` greedy at batch 1 and 8, where transformers imports (else: why not)

Decode figures time the decode phase only (every step after each request has its first token).
Every case is caught on failure and the run goes on; the JSON is rewritten after each case; cases
past --budget-s (wall time since start) are skipped and say so. The speed goals are checked at the
end (``goals``); benchmarks/roofline.py holds the roofline model, benchmarks/e2e_hf.py the
transformers baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
from harness import Progress, cpu_ceilings, machine, measure, record, write_json  # benchmarks/ is on sys.path
from roofline import Sizes, roofline, with_roofline
from torch._library.custom_ops import CustomOpDef

from k3trt.config import ModelConfig
from k3trt.engine.build_config import BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.model.loader import build_model
from k3trt.model.presets import preset_config
from k3trt.model.weights import init_random_
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams

log = logging.getLogger("e2e")
VOCAB = 129408          # the tokenizer's vocabulary rounded up, as make_checkpoint makes it


# ------------------------------------------------------------------------------ one engine
def make_llm(model, args, *, max_batch: int, spec: str = "none", graphs: bool | None = None) -> LLM:
    k = args.spec_tokens if spec != "none" else 0
    caps = Capacities.plan(max_batch=max_batch, max_num_tokens=args.max_num_tokens, spec_tokens=k,
                           verify=sorted({b for b in (1, 8, 32, 128) if b < max_batch} | {max_batch}))
    build = BuildConfig(dtype=args.dtype, block_size=64, max_num_tokens=args.max_num_tokens,
                        max_seq_len=args.max_seq_len)
    return LLM.from_model(model, build=build, capacities=caps, prefix_caching=False, speculative=spec,
                          spec_tokens=k or None, cuda_graphs=graphs, kv_cache_memory=args.kv_cache_gb << 30)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab - 16, (n, length), generator=g).tolist()


def sync(llm: LLM) -> None:
    if llm.session.device.type == "cuda":
        torch.cuda.synchronize()


def run_decode(llm: LLM, ps: list[list[int]], max_tokens: int) -> dict:
    """Submit every prompt, step through prefill, then time the decode steps to completion."""
    prog = Progress(llm, ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    prog.prefill()
    sync(llm)
    prefill_s = time.perf_counter() - t0
    spec0, graphs0 = llm.stats()["speculative"], dict(llm.stats()["graphs"])
    before = prog.tokens
    times = prog.decode()
    spec, graphs = llm.stats()["speculative"], llm.stats()["graphs"]
    vsteps, accepted = (spec.get(k, 0) - spec0.get(k, 0) for k in ("verify_steps", "accepted_tokens"))
    tokens, wall = prog.tokens - before, sum(times)
    out = {"prefill_s": round(prefill_s, 4), "decode_tokens": tokens, "decode_steps": len(times),
           "decode_s": round(wall, 5), "tokens_per_s": round(tokens / wall, 2) if wall else None,
           "step_ms": round(statistics.median(times) * 1e3, 4) if times else None,
           "mean_step_ms": round(wall * 1e3 / len(times), 4) if times else None,
           "session": type(llm.session).__name__,
           "graph_steps": {k: v - graphs0.get(k, 0) for k, v in graphs.items() if v - graphs0.get(k, 0)}}
    if vsteps:
        out["mean_accepted_length"] = round((accepted + vsteps) / vsteps, 3)
        out["acceptance_rate"] = spec.get("acceptance_rate")
    drafter = llm.spec.drafter
    if getattr(drafter, "session", None) is not None:
        out["draft_graph_steps"] = dict(getattr(drafter.session, "graph_stats", {}))
    return out


# ------------------------------------------------------------------------------ the cases
class Run:
    """The results document, rewritten after every case; per-case failures are recorded, not raised."""

    def __init__(self, args, doc: dict):
        self.args, self.doc, self.t0 = args, doc, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        write_json(self.args.json, self.doc)

    def case(self, name: str, fn, **meta) -> dict | None:
        if self.elapsed() > self.args.budget_s:
            log.warning("%s: skipped (past the %ds budget)", name, self.args.budget_s)
            self.doc["cases"].append({"name": name, **meta, "skipped": f"past the {self.args.budget_s}s budget"})
            self.save()
            return None
        log.info("%s ...", name)
        t0 = time.perf_counter()
        try:
            row = {"name": name, **meta, **fn()}
        except Exception as e:                     # keep going: one case's failure is one row
            log.error("%s failed: %s: %s", name, type(e).__name__, e)
            row = {"name": name, **meta, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc(limit=6)[-3000:]}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        row["case_s"] = round(time.perf_counter() - t0, 2)
        log.info("%s: %s", name, {k: v for k, v in row.items() if k in ("tokens_per_s", "step_ms", "ratio",
                                                                         "error", "mean_accepted_length")})
        self.doc["cases"].append(row)
        self.save()
        return row


def free(llm: LLM | None) -> None:
    if llm is not None:
        llm.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_cases(run: Run, model, sz: Sizes, ceil: dict) -> None:
    a, vocab = run.args, model.cfg.vocab_size
    ctx = a.prompt_len + a.max_tokens / 2                   # mean context of a decode step
    warm = lambda llm, b: run_decode(llm, prompts(b, 16, vocab, 7), 3)   # noqa: E731  (shapes, allocator)

    llm = None
    try:                        # one graphs-on engine: decode at every batch, then prefill
        t0 = time.perf_counter()
        llm = make_llm(model, a, max_batch=max(a.batches))
        run.doc["engine_setup_s"] = round(time.perf_counter() - t0, 2)
        for b in a.batches:
            def decode(b=b):
                warm(llm, b)
                row = run_decode(llm, prompts(b, a.prompt_len, vocab, b), a.max_tokens)
                return with_roofline(row, sz, ceil, seqs=b, q=1, ctx=ctx)
            run.case(f"decode b{b}", decode, kind="decode", batch=b)

        def prefill():
            n, L = a.prefill_prompts, a.prefill_len
            run_decode(llm, prompts(min(n, 2), L, vocab, 99), 1)                 # compiles the prefill path
            t0 = time.perf_counter()
            llm.generate(prompts(n, L, vocab, 98), SamplingParams(max_tokens=1, ignore_eos=True))
            sync(llm)
            s = time.perf_counter() - t0
            steps = -(-n * L // a.max_num_tokens)
            r = roofline(sz, seqs=n, q=L, ctx=0, copy_gbps=ceil["copy_gbps"], gemm_tflops=ceil["gemm_tflops"],
                         prefill=True)
            # the weights are read once per step (chunk of max_num_tokens), not once in all
            extra = (steps - 1) * r["weight_bytes"] / (ceil["copy_gbps"] * 1e9) * 1e3
            r["roofline_ms"] = round(max(r["bytes_ms"] + extra, r["flops_ms"]), 4)
            return {"prompt_tokens": n * L, "steps": steps, "wall_s": round(s, 4),
                    "tokens_per_s": round(n * L / s, 1), "roofline": r,
                    "ratio": round(s * 1e3 / r["roofline_ms"], 3)}
        run.case("prefill", prefill, kind="prefill", batch=a.prefill_prompts, prompt_len=a.prefill_len)
    except Exception as e:
        log.error("graphs engine failed: %s: %s", type(e).__name__, e)
        run.doc["errors"].append(f"graphs engine: {type(e).__name__}: {e}")
    finally:
        free(llm)
        llm = None

    for spec in a.speculative:
        try:
            if run.elapsed() > a.budget_s:
                raise RuntimeError(f"past the {a.budget_s}s budget")
            llm = make_llm(model, a, max_batch=max(a.spec_batches), spec=spec)
            for b in a.spec_batches:
                def speculate(b=b):
                    warm(llm, b)
                    row = run_decode(llm, prompts(b, a.prompt_len, vocab, b), a.max_tokens)
                    return with_roofline(row, sz, ceil, seqs=b, q=a.spec_tokens + 1, ctx=ctx, save_states=True)
                run.case(f"{spec} K{a.spec_tokens} b{b}", speculate, kind="spec", speculative=spec,
                         spec_tokens=a.spec_tokens, batch=b)
        except Exception as e:
            log.error("%s engine: %s: %s", spec, type(e).__name__, e)
            run.doc["errors"].append(f"{spec} engine: {type(e).__name__}: {e}")
        finally:
            free(llm)
            llm = None

    try:
        llm = make_llm(model, a, max_batch=max(a.eager_batches + a.eager_ref_batches), graphs=False)
        for ref, batches in ((False, a.eager_batches), (True, a.eager_ref_batches)):
            for b in batches:
                def eager(b=b, ref=ref):
                    with plugin_kernels_off() if ref else contextlib.nullcontext([]) as off:
                        warm(llm, b)
                        row = run_decode(llm, prompts(b, a.prompt_len, vocab, b), a.eager_tokens)
                    row["plugins_off"] = off
                    return with_roofline(row, sz, ceil, seqs=b, q=1, ctx=a.prompt_len + a.eager_tokens / 2)
                run.case(f"eager{'-ref' if ref else ''} b{b}", eager, kind="eager-ref" if ref else "eager", batch=b)
    except Exception as e:
        log.error("eager engine: %s: %s", type(e).__name__, e)
        run.doc["errors"].append(f"eager engine: {type(e).__name__}: {e}")
    finally:
        free(llm)


@contextlib.contextmanager
def plugin_kernels_off():
    """Every k3trt op's CUDA kernel disabled for the block: each runs its plain-torch reference
    (the "no plugins" baseline). Yields the ops' names."""
    ops = {id(v): v for name, mod in list(sys.modules.items()) if name.startswith("k3trt.plugins")
           for v in vars(mod).values() if isinstance(v, CustomOpDef) and "cuda" in getattr(v, "_backend_fns", {})}
    for op in ops.values():
        op.set_kernel_enabled("cuda", False)
    try:
        yield sorted(op._name for op in ops.values())
    finally:
        for op in ops.values():
            op.set_kernel_enabled("cuda", True)


# ------------------------------------------------------------------------------ transformers
def hf_cases(run: Run, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    a = run.args
    try:
        import e2e_hf  # noqa: PLC0415 (optional: transformers)
        import transformers  # noqa: PLC0415 (optional: transformers)
    except Exception as e:
        why = f"transformers does not import: {type(e).__name__}: {e}"
        log.warning("hf baseline skipped: %s", why)
        run.doc["hf_skipped"] = why
        run.save()
        return
    run.doc["machine"]["transformers"] = transformers.__version__
    if run.elapsed() > a.budget_s:
        run.doc["hf_skipped"] = f"past the {a.budget_s}s budget"
        return
    try:
        model, info = e2e_hf.build(cfg, device, dtype)
        run.doc["hf_model"] = info
        log.info("hf DeepseekV3ForCausalLM: %.2fB parameters", run.doc["hf_model"]["params"] / 1e9)
    except Exception as e:
        run.doc["hf_skipped"] = f"building DeepseekV3ForCausalLM failed: {type(e).__name__}: {e}"
        log.error("hf baseline: %s", run.doc["hf_skipped"])
        return
    for b in a.hf_batches:
        def hf(b=b, model=model):
            ids = torch.tensor(prompts(b, a.prompt_len, cfg.vocab_size, b), device=device)
            return e2e_hf.time_generate(model, ids, a.hf_tokens)
        run.case(f"hf generate b{b}", hf, kind="hf", batch=b, transformers=transformers.__version__)
    del model
    free(None)

# ------------------------------------------------------------------------------ report
def goals(cases: list[dict]) -> dict:
    by = {c["name"]: c for c in cases if "error" not in c and "skipped" not in c}
    out = {}

    def ratio(name):
        return by.get(name, {}).get("ratio")
    for b in (1, 32):
        r = ratio(f"decode b{b}")
        out[f"decode_b{b}_within_1.3x_roofline"] = {"ratio": r, "met": r is not None and r <= 1.3}
    g = by.get("decode b1", {}).get("step_ms")
    for base, key in (("eager b1", "graphs_vs_eager_b1_5x"), ("eager-ref b1", "graphs_vs_eager_noplugins_b1_5x")):
        e = by.get(base, {}).get("step_ms")
        sp = round(e / g, 2) if g and e else None
        out[key] = {"speedup": sp, "met": sp is not None and sp >= 5}
    plain = by.get("decode b1", {}).get("tokens_per_s")
    spec = [(c["name"], c["tokens_per_s"]) for c in by.values() if c.get("kind") == "spec" and c["batch"] == 1]
    best = max(spec, key=lambda x: x[1] or 0, default=(None, None))
    sx = round(best[1] / plain, 2) if plain and best[1] else None
    out["self_draft_b1_2.5x"] = {"case": best[0], "speedup": sx, "met": sx is not None and sx >= 2.5}
    return out


def print_table(doc: dict) -> None:
    c = doc["machine"]["ceilings"]
    print(f"\ne2e: {doc['preset']} preset ({doc['dtype']}, {doc['model']['params'] / 1e6:.1f}M params) on "
          f"{doc['machine']['device']}; copy {c['copy_gbps']} GB/s, GEMM {c['gemm_tflops']} TFLOP/s; "
          f"prompt {doc['settings']['prompt_len']}, max_tokens {doc['settings']['max_tokens']}")
    head = f"{'case':26s} {'tok/s':>10s} {'step ms':>9s} {'roof ms':>8s} {'ratio':>6s} {'bound':>7s}  note"
    print(head)
    print("-" * len(head))
    for r in doc["cases"]:
        note = r.get("error") or r.get("skipped") or ""
        if "mean_accepted_length" in r:
            note = f"accepted length {r['mean_accepted_length']}"
        roof = r.get("roofline", {})
        fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else format("-", f">{f.split('.')[0]}s")  # noqa: E731
        print(f"{r['name']:26s} {fmt(r.get('tokens_per_s'), '10.1f')} {fmt(r.get('step_ms'), '9.3f')} "
              f"{fmt(roof.get('roofline_ms'), '8.3f')} {fmt(r.get('ratio'), '6.2f')} {roof.get('bound', '-'):>7s}  "
              f"{note[:60]}")
    if doc.get("hf_skipped"):
        print(f"hf baseline skipped: {doc['hf_skipped']}")
    for k, v in doc.get("goals", {}).items():
        print(f"goal {k}: {'met' if v['met'] else 'NOT met'} ({', '.join(f'{a}={b}' for a, b in v.items() if a != 'met')})")
    print("(step ms: median decode step (spec: draft + verify); roof: the step's roofline, max(bytes / copy, flops "
          "/ GEMM); ratio: measured / roofline; prefill: whole run)", flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke settings: small batches, few tokens")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--speculative", default="layerskip:1,layerskip:3", help="comma list of --speculative values")
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--spec-batches", default="1,8")
    ap.add_argument("--eager-batches", default="1,32")
    ap.add_argument("--eager-ref-batches", default="1", help="eager without plugins")
    ap.add_argument("--eager-tokens", type=int, default=24)
    ap.add_argument("--hf-batches", default="1,8", help="empty: no transformers baseline")
    ap.add_argument("--hf-tokens", type=int, default=32)
    ap.add_argument("--max-num-tokens", type=int, default=8192)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gb", type=int, default=12)
    ap.add_argument("--budget-s", type=int, default=420, help="skip cases that would start after this")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.prompt_len, args.max_tokens = "1,4", 16, 8
        args.prefill_prompts, args.prefill_len, args.spec_batches, args.eager_batches = 2, 64, "1", "1"
        args.eager_tokens, args.hf_batches, args.hf_tokens, args.max_num_tokens = 8, "1", 4, 256
        args.max_seq_len, args.kv_cache_gb, args.speculative = 512, 1, "layerskip:1"
        if args.device == "cpu":
            torch.set_num_threads(1)        # tiny steps: one thread beats two fighting over CI's cores
    ints = lambda s: [int(x) for x in s.split(",") if x]   # noqa: E731
    args.batches, args.spec_batches, args.eager_batches, args.eager_ref_batches, args.hf_batches = map(
        ints, (args.batches, args.spec_batches, args.eager_batches, args.eager_ref_batches, args.hf_batches))
    args.speculative = [s for s in args.speculative.split(",") if s]
    device = torch.device(args.device)
    args.dtype = "bf16" if device.type == "cuda" else "fp32"
    dtype = BuildConfig(dtype=args.dtype).torch_dtype

    doc = record(__file__, argv, machine=machine(device),
                     preset=args.preset, dtype=args.dtype,
                     settings={k: v for k, v in vars(args).items() if k != "json"}, cases=[], errors=[])
    run = Run(args, doc)
    log.info("ceilings ...")
    doc["machine"]["ceilings"] = ceil = measure() if device.type == "cuda" else cpu_ceilings()
    log.info("ceilings: copy %s GB/s, GEMM %s TFLOP/s", ceil["copy_gbps"], ceil["gemm_tflops"])
    run.save()

    t0 = time.perf_counter()
    cfg = ModelConfig.from_dict(preset_config(args.preset, args.vocab))
    model = build_model(cfg, dtype=dtype, device=device)
    init_random_(model, args.seed, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    sz = Sizes.of(model, dtype)
    doc["model"] = {"params": sum(p.numel() for p in model.parameters()), "init_s": round(time.perf_counter() - t0, 2),
                    "layers": cfg.num_hidden_layers, "kda_layers": list(cfg.kda_layers), "mla_layers": list(cfg.mla_layers),
                    "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token, "sizes": asdict(sz)}
    log.info("model: %.1fM parameters, built and initialised on %s in %.1fs", doc["model"]["params"] / 1e6,
             device, doc["model"]["init_s"])
    run.save()

    engine_cases(run, model, sz, ceil)
    del model
    free(None)
    if args.hf_batches:
        hf_cases(run, cfg, device, dtype)
    doc["goals"] = goals(doc["cases"])
    run.save()
    print_table(doc)
    return doc


if __name__ == "__main__":
    # logging is the script's to configure, not main()'s: the CPU smoke test calls main() in-process
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("k3trt.model.checkpoint_io", "k3trt.runtime.kv_cache"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    main()
