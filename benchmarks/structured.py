"""Per-step overhead of grammar masking (structured output) against unconstrained decoding, measured
in the same run, at several batch sizes, with speculation off and with n-gram speculation.

    PYTHONPATH=. python benchmarks/structured.py [--device cpu|cuda] [--batches 1,32,128]
        [--prompt-len 64] [--max-tokens 64] [--speculative none,ngram] [--spec-tokens 3]
        [--reps 2] [--threads N] [--workdir DIR] [--json OUT]

The tiny preset (random weights; fp32 engine on the CPU, bf16 on CUDA), greedy, a fixed max_tokens
with EOS ignored, token-id prompts (a short random pattern repeated, so n-gram drafts exist).
Guided requests follow a realistic JSON schema that cannot end within max_tokens: an array of at
least 64 objects with bounded fields (integer and number ranges, a string of at most 12 characters,
a boolean, an enum array of at most 3), whitespace runs of at most 2 (`max_whitespace=2`).

Per speculative mode and batch B, B requests are submitted at once; the timed region is the decode
phase (every step after each request has its first token), so prefill and grammar compilation
(warmed up before) stay out. Unconstrained and guided runs alternate, `--reps` times each; each
figure is the run with the median tokens/s. Reported: decode tokens/s, median step latency, the
tokens/s loss of guided against unconstrained, and where the guided step's time goes: bitmask
fill on the CPU (Grammars.fill), grammar advance at commit (GuidedState.commit), mask apply
(host time of Grammars.apply, and on CUDA its GPU time from events). On CUDA the run also
measures the copy bandwidth and bf16 GEMM rate (benchmarks/ceilings.py) for the record.

Reading it: with random weights, unconstrained outputs do not repeat, so n-gram gets no drafts for
them, while the repetitive JSON does: the ngram rows compare verification of drafts against none
(see the accepted lengths), not mask overhead alone. The tiny model's step is host-bound, so its
time varies between processes; the fill / commit / apply columns are the steadier measure of what
masking adds to a step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3trt.builder.build import build_engine
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams

log = logging.getLogger("structured")

ITEM = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "price": {"type": "number", "minimum": 0, "maximum": 1000},
    "in_stock": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco", "gift"]}, "maxItems": 3}},
    "required": ["id", "name", "price", "in_stock", "tags"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 64}
GUIDED = {"json_schema": SCHEMA, "max_whitespace": 2}


def engine_for(work: Path, dtype: str, max_batch: int, max_num_tokens: int) -> Path:
    ckpt, engine = work / "tiny-ckpt", work / f"tiny-engine-{dtype}-b{max_batch}-t{max_num_tokens}"
    if not ckpt.exists():
        make_checkpoint("tiny", ckpt, seed=0)
    if not engine.exists():
        caps = [c for c in (1, 2, 4, 8, 16, 32, 64, 128) if c < max_batch] + [max_batch]
        build_engine(ckpt, engine, dtype=dtype, capacities=caps, max_num_tokens=max_num_tokens,
                     spec_tokens=0, block_size=64)
    return engine


class Probe:
    """Host time of Grammars.fill / Grammars.apply / GuidedState.commit, and the GPU time of apply
    (CUDA events), summed over the steps it is armed for."""

    def __init__(self, llm: LLM):
        from k3trt.runtime.structured.state import GuidedState
        self.llm, self.cuda = llm, llm.session.device.type == "cuda"
        self.armed, self.t = False, {"fill": 0.0, "apply": 0.0, "commit": 0.0}
        self.events: list = []
        g = llm._grammar_runtime()
        fill, apply, commit = g.fill, g.apply, GuidedState.commit
        self._restore = lambda: setattr(GuidedState, "commit", commit)

        def timed(name, fn):
            def wrapper(*a, **k):
                if not self.armed:
                    return fn(*a, **k)
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.t[name] += time.perf_counter() - t0
            return wrapper

        def apply_ev(logits, rows):
            if not (self.armed and self.cuda and rows):
                return apply(logits, rows)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            apply(logits, rows)
            e1.record()
            self.events.append((e0, e1))

        g.fill, g.apply = timed("fill", fill), timed("apply", apply_ev)
        timed_commit = timed("commit", commit)
        GuidedState.commit = lambda s, tokens: timed_commit(s, tokens)

    def arm(self) -> None:
        self.armed, self.t, self.events = True, dict.fromkeys(self.t, 0.0), []

    def read(self, steps: int) -> dict:
        self.armed = False
        out = {f"{k}_ms": round(v * 1e3 / steps, 4) for k, v in self.t.items()}
        if self.cuda:
            torch.cuda.synchronize()
            out["apply_gpu_ms"] = round(sum(a.elapsed_time(b) for a, b in self.events) / steps, 4)
        return out

    def close(self) -> None:
        self._restore()


def prompts_for(batch: int, prompt_len: int, vocab: int, special: set[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        pat = [t for t in torch.randint(3, min(vocab, 100_000), (16,), generator=g).tolist() if t not in special][:8]
        out.append((pat * prompt_len)[:prompt_len])
    return out


def measure(llm: LLM, probe: Probe | None, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Submit every prompt, step through prefill, then time the decode steps to completion."""
    ids = [llm.add_request(p, params) for p in prompts]
    n_out = dict.fromkeys(ids, 0)
    done: set[str] = set()

    def step() -> None:
        for o in llm.step():
            if o.request_id in n_out:
                n_out[o.request_id] = len(o.token_ids)
                if o.finished:
                    done.add(o.request_id)
                    if o.error:
                        raise RuntimeError(f"{o.request_id}: {o.error}")

    while not all(n_out.values()):
        step()
    if llm.session.device.type == "cuda":
        torch.cuda.synchronize()
    spec0 = llm.stats()["speculative"]
    before = sum(n_out.values())
    if probe is not None:
        probe.arm()
    times = []
    while len(done) < len(ids):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    extra = probe.read(len(times)) if probe is not None else {}
    spec = llm.stats()["speculative"]
    vsteps, drafted, accepted = (spec[k] - spec0[k] for k in ("verify_steps", "drafted_tokens", "accepted_tokens"))
    tokens = sum(n_out.values()) - before
    wall = sum(times)
    return {"decode_tokens": tokens, "decode_steps": len(times), "decode_s": round(wall, 5),
            "tokens_per_s": round(tokens / wall, 2), "step_ms": round(statistics.median(times) * 1e3, 4),
            "mean_step_ms": round(wall * 1e3 / len(times), 4),
            "mean_accepted_length": round((accepted + vsteps) / vsteps, 3) if vsteps else None, **extra}


def ceilings() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ceilings import measure as measure_ceilings
    return measure_ceilings()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speculative", default="none,ngram", help="comma list of none, ngram")
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="runs of each case (alternating); the median counts")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: fp32 on the CPU, bf16 on CUDA)")
    ap.add_argument("--no-ceilings", action="store_true", help="CUDA: skip the copy / GEMM ceilings")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "k3trt-structured-bench")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    batches = [int(b) for b in args.batches.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    import xgrammar
    machine = {"device": torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine()),
               "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
               "xgrammar": getattr(xgrammar, "__version__", None) or _dist_version("xgrammar"),
               "python": platform.python_version(), "load_average_1m": os.getloadavg()[0]}
    if cuda and not args.no_ceilings:
        machine["ceilings"] = ceilings()
    results = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "machine": machine,
               "schema": GUIDED, "preset": "tiny", "dtype": dtype, "cuda": cuda,
               "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "runs": []}
    print(f"device: {machine['device']} ({machine['cores']} cores, torch {machine['torch']}, "
          f"xgrammar {machine['xgrammar']})"
          + (f"; copy {machine['ceilings']['copy_gbps']} GB/s, bf16 GEMM {machine['ceilings']['gemm_tflops']} "
             f"TFLOP/s" if "ceilings" in machine else ""), flush=True)
    max_batch = max(batches)
    engine = engine_for(args.workdir, dtype, max_batch, max(256, max_batch * args.prompt_len))
    plain = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, guided=GUIDED)
    for mode in args.speculative.split(","):
        llm = LLM(engine, device=args.device, verify_checksums=False, prefix_caching=False,
                  speculative=mode, spec_tokens=None if mode == "none" else args.spec_tokens,
                  kv_cache_memory=(4 << 30) if cuda else None)
        special = set(llm.tokenizer.special_ids.values())
        probe = Probe(llm)
        for b in batches:                                        # warm-up: shapes, kernels, the grammar
            wp = prompts_for(b, args.prompt_len, llm.vocab_size, special, seed=99)
            for p in (plain, guided):
                measure(llm, None, wp, SamplingParams(max_tokens=6, ignore_eos=True, guided=p.guided))
        for b in batches:
            prompts = prompts_for(b, args.prompt_len, llm.vocab_size, special, seed=b)
            runs: dict[str, list[dict]] = {"plain": [], "guided": []}
            for _ in range(args.reps):
                runs["plain"].append(measure(llm, None, prompts, plain))
                runs["guided"].append(measure(llm, probe, prompts, guided))
            pick = {k: sorted(v, key=lambda r: r["tokens_per_s"])[(len(v) - 1) // 2] for k, v in runs.items()}
            u, g = pick["plain"], pick["guided"]
            row = {"speculative": mode, "spec_tokens": 0 if mode == "none" else args.spec_tokens, "batch": b,
                   "unconstrained": u, "guided": g,
                   "tokens_per_s_loss_pct": round(100 * (1 - g["tokens_per_s"] / u["tokens_per_s"]), 2),
                   "step_ms_increase_pct": round(100 * (g["mean_step_ms"] / u["mean_step_ms"] - 1), 2),
                   # the guided step's extra time not spent in fill / commit / apply (host)
                   "other_ms": round(g["mean_step_ms"] - u["mean_step_ms"]
                                     - g["fill_ms"] - g["commit_ms"] - g["apply_ms"], 4),
                   "spread_tokens_per_s_pct": {k: round(100 * (max(r["tokens_per_s"] for r in v)
                                                              / min(r["tokens_per_s"] for r in v) - 1), 2)
                                               for k, v in runs.items()},
                   "all_runs": runs}
            results["runs"].append(row)
            print(f"  {mode:5s} b{b:<4d}: plain {u['tokens_per_s']} tok/s {u['step_ms']} ms, guided {g['tokens_per_s']}"
                  f" tok/s {g['step_ms']} ms, loss {row['tokens_per_s_loss_pct']}%", flush=True)
            if args.json:                                        # as it goes: a killed run keeps its rows
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=2) + "\n")
        probe.close()
        llm.close()
        del llm, probe
        if cuda:
            torch.cuda.empty_cache()
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def print_table(results: dict) -> None:
    m = results["machine"]
    print(f"\nstructured output overhead, tiny preset ({results['dtype']}), greedy, max_tokens "
          f"{results['max_tokens']}, prompt {results['prompt_len']}; device {m['device']}"
          + (f"; copy {m['ceilings']['copy_gbps']} GB/s, bf16 GEMM {m['ceilings']['gemm_tflops']} TFLOP/s"
             if "ceilings" in m else "") + ("" if results["cuda"] else f", {m['torch_threads']} torch threads"))
    cuda = results["cuda"]
    head = (f"{'spec':6s} {'batch':>5s} | {'plain tok/s':>11s} {'step ms':>8s} | {'guided tok/s':>12s} {'step ms':>8s}"
            f" | {'loss %':>6s} | {'fill':>6s} {'commit':>6s} {'apply':>6s}" + (f" {'gpu':>6s}" if cuda else "")
            + f" {'other':>6s} | {'acc len u/g':>11s}")
    print(head)
    print("-" * len(head))
    for r in results["runs"]:
        u, g = r["unconstrained"], r["guided"]
        mode = "none" if r["speculative"] == "none" else f"{r['speculative']}{r['spec_tokens']}"
        acc = f"{u['mean_accepted_length'] or '-'}/{g['mean_accepted_length'] or '-'}"
        print(f"{mode:6s} {r['batch']:5d} | {u['tokens_per_s']:11.1f} {u['step_ms']:8.3f} | {g['tokens_per_s']:12.1f}"
              f" {g['step_ms']:8.3f} | {r['tokens_per_s_loss_pct']:6.2f} | {g['fill_ms']:6.3f} {g['commit_ms']:6.3f}"
              f" {g['apply_ms']:6.3f}" + (f" {g['apply_gpu_ms']:6.3f}" if cuda else "") + f" {r['other_ms']:6.3f} | {acc:>11s}")
    print("(step ms: median decode step; loss: decode tokens/s of guided vs unconstrained; fill / commit / apply: "
          "the guided step's host ms in Grammars.fill, GuidedState.commit, Grammars.apply"
          + (", gpu: apply's GPU ms (events)" if cuda else "") + "; other: mean guided step - mean unconstrained "
          "step - fill - commit - apply; acc len: mean accepted length, unconstrained / guided)", flush=True)


if __name__ == "__main__":
    main()
