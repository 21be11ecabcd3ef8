"""Per-step overhead of grammar masking (structured output) against unconstrained decoding, measured
in the same run, at several batch sizes, with speculation off and with n-gram speculation.

    PYTHONPATH=. python benchmarks/structured.py [--device cpu|cuda] [--preset tiny|small|medium]
        [--graphs auto|on|off] [--batches 1,32,128] [--prompt-len 64] [--max-tokens N]
        [--speculative none,ngram] [--spec-tokens 3] [--reps N] [--threads N] [--workdir DIR] [--json OUT]

    # the H200 run (one command, ~1.5 minutes with model init and graph capture):
    PYTHONPATH=. python benchmarks/structured.py --device cuda --preset medium --batches 1,32,128 \
        --speculative none --json $OUT/structured_medium.json

Presets: tiny (a checkpoint and engine dir made in --workdir; fp32 engine on the CPU, bf16 on CUDA),
small and medium (models/presets.py; medium has K3's per-layer dimensions, ~9B parameters): built
directly on the device with random weights (build_model + init_random_ on the device, no checkpoint
on disk) and run through LLM.from_model. Greedy, a fixed max_tokens with EOS ignored, token-id
prompts (a short random pattern repeated, so n-gram drafts exist). Guided requests follow a
realistic JSON schema that cannot end within max_tokens: an array of at least 64 objects with
bounded fields (integer and number ranges, a string of at most 12 characters, a boolean, an enum
array of at most 3), whitespace runs of at most 2 (`max_whitespace=2`).

Per speculative mode and batch B, B requests are submitted at once; the timed region is the decode
phase (every step after each request has its first token), so prefill and grammar compilation
(warmed up before) stay out. Unconstrained and guided runs alternate, `--reps` times each; each
figure is the run with the median tokens/s. Reported: decode tokens/s, median step latency, the
tokens/s loss of guided against unconstrained, and where the guided step's time goes, per step:
  cut     GrammarRuntime.cut_drafts (before the forward: drafts cut at the first refused token)
  fill    GrammarRuntime.fill (after the forward is launched: the K+1 mask rows per request)
  hidden  how much of fill ran while the GPU was still busy with the forward (CUDA): per step
          min(fill, GPU forward time - host launch time - gap before fill), from CUDA events; and
          busy_after_fill_pct, the share of steps whose forward was still running when fill ended
  commit  GuidedState.commit (grammar advance by the accepted tokens)
  apply   GrammarRuntime.apply host time (apply_hidden: the part of it under the forward, as for fill),
          and on CUDA its GPU time (events)
  launch  host time of the forward call (StepLoop.forward), and on CUDA the forward's GPU time
On CUDA the run also measures the copy bandwidth and bf16 GEMM rate (benchmarks/harness.py).
Progress is logged; with --json the file is rewritten after every batch (a killed run keeps its rows).

Reading it: with random weights, unconstrained outputs do not repeat, so n-gram gets no drafts for
them, while the repetitive JSON does: the ngram rows compare verification of drafts against none
(see the accepted lengths), not mask overhead alone. The tiny model's step is host-bound, so its
time varies between processes; the fill / commit / apply columns are the steadier measure of what
masking adds to a step.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import Progress, record, version, write_json
from harness import machine as machine_info
from harness import measure as measure_ceilings  # benchmarks/ (the script's folder) is on sys.path

from k3trt.builder.build import build_engine
from k3trt.config import ModelConfig
from k3trt.engine.build_config import DTYPES, BuildConfig
from k3trt.engine.capacities import Capacities
from k3trt.model.loader import build_model
from k3trt.model.make_checkpoint import VOCAB_MULTIPLE, make_checkpoint
from k3trt.model.presets import preset_config
from k3trt.model.weights import init_random_
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams
from k3trt.runtime.structured.state import GuidedState
from k3trt.runtime.tokenizer import Tokenizer, write_k3_tokenizer

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


def model_for(preset: str, device: str, dtype: str, work: Path, seed: int = 0):
    """(model, tokenizer dir): a preset built on `device` with random weights drawn there."""
    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        tok_dir.mkdir(parents=True, exist_ok=True)
        write_k3_tokenizer(tok_dir)
    tok = Tokenizer.from_dir(tok_dir)
    vocab = -(-tok.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    cfg = ModelConfig.from_dict(preset_config(preset, vocab, pad_token_id=tok.pad_token_id))
    t0 = time.perf_counter()
    model = build_model(cfg, dtype=DTYPES[dtype], device=device)
    log.info("%s: %.2fB parameters allocated on %s in %.1fs; drawing random weights there", preset,
             sum(p.numel() for p in model.parameters()) / 1e9, device, time.perf_counter() - t0)
    init_random_(model, seed, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    log.info("%s ready in %.1fs", preset, time.perf_counter() - t0)
    return model, tok_dir


class Probe:
    """Per-step host times of the forward call, GrammarRuntime.cut_drafts / fill / apply and
    GuidedState.commit; on CUDA the GPU time of the forward and of apply (events), and how much of
    fill ran while the forward was still on the GPU. Summed over the steps it is armed for."""

    KEYS = ("launch", "cut", "fill", "hidden", "commit", "apply", "apply_hidden")

    def __init__(self, llm: LLM):
        self.llm, self.cuda = llm, llm.session.device.type == "cuda"
        self.armed = False
        self.arm()
        self.armed = False
        g = llm.loop.grammars
        cut, fill, apply, commit, forward = g.cut_drafts, g.fill, g.apply, GuidedState.commit, llm.loop.forward
        self._restore = lambda: setattr(GuidedState, "commit", commit)
        self._fwd: tuple | None = None     # (host launch start, host launch end, e0, e1) of this step

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

        def forward_ev(plan):
            if not self.armed:
                return forward(plan)
            e0 = e1 = None
            if self.cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            out = forward(plan)
            if self.cuda:
                e1.record()
            t1 = time.perf_counter()
            self.t["launch"] += t1 - t0
            self._fwd = (t0, t1, e0, e1)
            if self.cuda:
                self.fwd_events.append((e0, e1))
            return out

        def fill_ev(rows, fault):
            if not self.armed:
                return fill(rows, fault)
            t0 = time.perf_counter()
            out = fill(rows, fault)
            t1 = time.perf_counter()
            self.t["fill"] += t1 - t0
            if self.cuda and self._fwd is not None:
                l0, l1, e0, e1 = self._fwd
                busy = not e1.query()
                self.busy += busy
                self.fills.append((l0, l1, t0, t1, e0, e1))
            return out

        def apply_ev(logits, rows):
            if not (self.armed and rows):
                return apply(logits, rows)
            t0 = time.perf_counter()
            if not self.cuda:
                apply(logits, rows)
            else:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                apply(logits, rows)
                e1.record()
                self.apply_events.append((e0, e1))
                if self._fwd is not None:
                    self.applies.append((*self._fwd[:1], t0, time.perf_counter(), *self._fwd[2:]))
            self.t["apply"] += time.perf_counter() - t0

        g.cut_drafts, g.fill, g.apply = timed("cut", cut), fill_ev, apply_ev
        llm.loop.forward = forward_ev
        timed_commit = timed("commit", commit)
        GuidedState.commit = lambda s, tokens: timed_commit(s, tokens)

    def arm(self) -> None:
        self.armed, self.t = True, dict.fromkeys(self.KEYS, 0.0)
        self.fwd_events, self.apply_events, self.fills, self.applies, self.busy = [], [], [], [], 0

    def read(self, steps: int) -> dict:
        self.armed = False
        if self.cuda:
            torch.cuda.synchronize()
            for l0, l1, f0, f1, e0, e1 in self.fills:
                gpu = e0.elapsed_time(e1) / 1e3           # the forward's GPU time (from its launch)
                self.t["hidden"] += max(0.0, min(f1 - f0, gpu - (f0 - l0)))
            for l0, f0, f1, e0, e1 in self.applies:       # apply's host time under the forward, too
                self.t["apply_hidden"] += max(0.0, min(f1 - f0, e0.elapsed_time(e1) / 1e3 - (f0 - l0)))
        out = {f"{k}_ms": round(v * 1e3 / steps, 4) for k, v in self.t.items()}
        if self.cuda:
            out["forward_gpu_ms"] = round(sum(a.elapsed_time(b) for a, b in self.fwd_events) / steps, 4)
            out["apply_gpu_ms"] = round(sum(a.elapsed_time(b) for a, b in self.apply_events) / steps, 4)
            if self.fills:
                out["busy_after_fill_pct"] = round(100 * self.busy / len(self.fills), 1)
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
    prog = Progress(llm, prompts, params)
    prog.prefill()
    if llm.session.device.type == "cuda":
        torch.cuda.synchronize()
    spec0 = llm.stats()["speculative"]
    before = prog.tokens
    if probe is not None:
        probe.arm()
    times = prog.decode()
    extra = probe.read(len(times)) if probe is not None else {}
    spec = llm.stats()["speculative"]
    vsteps, drafted, accepted = (spec[k] - spec0[k] for k in ("verify_steps", "drafted_tokens", "accepted_tokens"))
    tokens = prog.tokens - before
    wall = sum(times)
    return {"decode_tokens": tokens, "decode_steps": len(times), "decode_s": round(wall, 5),
            "tokens_per_s": round(tokens / wall, 2), "step_ms": round(statistics.median(times) * 1e3, 4),
            "mean_step_ms": round(wall * 1e3 / len(times), 4),
            "mean_accepted_length": round((accepted + vsteps) / vsteps, 3) if vsteps else None, **extra}


# per preset: (max_tokens, reps, KV cache GiB on CUDA); medium fits one ~4-minute device command
DEFAULTS = {"tiny": (64, 2, 4), "small": (64, 2, 4), "medium": (48, 3, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small", "medium"])
    ap.add_argument("--graphs", default="auto", choices=["auto", "on", "off"],
                    help="decode/verify steps as CUDA graphs (auto: on CUDA in bf16/fp16; on off CUDA: the "
                         "padded static steps, uncaptured)")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (default: 64; medium 48)")
    ap.add_argument("--speculative", default="none,ngram", help="comma list of none, ngram")
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--reps", type=int, default=None, help="runs of each case (alternating); the median counts "
                                                            "(default 2; medium 3)")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: fp32 on the CPU, bf16 on CUDA)")
    ap.add_argument("--no-ceilings", action="store_true", help="CUDA: skip the copy / GEMM ceilings")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "k3trt-structured-bench")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here (after every batch)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    logging.getLogger("k3trt.runtime.graphs").setLevel(logging.INFO)
    max_tokens, reps, cache_gib = DEFAULTS[args.preset]
    args.max_tokens, args.reps = args.max_tokens or max_tokens, args.reps or reps
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    cuda = args.device == "cuda"
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.speculative.split(",")
    args.workdir.mkdir(parents=True, exist_ok=True)
    machine = {**machine_info(args.device), "xgrammar": version("xgrammar")}
    if cuda and not args.no_ceilings:
        machine["ceilings"] = measure_ceilings()
    results = record(__file__, machine=machine, schema=GUIDED, preset=args.preset, dtype=dtype, cuda=cuda,
                     graphs=args.graphs, prompt_len=args.prompt_len, max_tokens=args.max_tokens, reps=args.reps,
                     runs=[])
    log.info("device: %s (%s cores, torch %s, xgrammar %s)%s", machine["device"], machine["cores"], machine["torch"],
             machine["xgrammar"], f"; copy {machine['ceilings']['copy_gbps']} GB/s, bf16 GEMM "
             f"{machine['ceilings']['gemm_tflops']} TFLOP/s" if "ceilings" in machine else "")
    max_batch = max(batches)
    max_num_tokens = max(256, max_batch * args.prompt_len)
    options = dict(prefix_caching=False, kv_cache_memory=(cache_gib << 30) if cuda else None)
    if graphs is not None:
        options["cuda_graphs"] = graphs
    if args.preset == "tiny":
        engine = engine_for(args.workdir, dtype, max_batch, max_num_tokens)

        def make_llm(mode: str, k: int | None) -> LLM:
            return LLM(engine, device=args.device, verify_checksums=False, speculative=mode, spec_tokens=k, **options)
    else:
        model, tok_dir = model_for(args.preset, args.device, dtype, args.workdir)
        build = BuildConfig(dtype=dtype, block_size=64, max_num_tokens=max_num_tokens,
                            max_seq_len=args.prompt_len + args.max_tokens + 64)
        verify = [c for c in (1, 2, 4, 8, 16, 32, 64, 128) if c < max_batch] + [max_batch]
        caps = Capacities.plan(max_batch=max_batch, max_num_tokens=max_num_tokens,
                               spec_tokens=args.spec_tokens if "ngram" in modes else 0, verify=verify)

        def make_llm(mode: str, k: int | None) -> LLM:
            return LLM.from_model(model, build=build, capacities=caps, tokenizer_dir=tok_dir, speculative=mode,
                                  spec_tokens=k, **options)
    plain = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, guided=GUIDED)
    for mode in modes:
        t0 = time.perf_counter()
        llm = make_llm(mode, None if mode == "none" else args.spec_tokens)
        results.setdefault("graph_stats", {})
        log.info("[%s] engine ready in %.1fs (%.0fs since start)", mode, time.perf_counter() - t0,
                 time.perf_counter() - t_start)
        special = set(llm.tokenizer.special_ids.values())
        probe = Probe(llm)
        for b in batches:                                        # warm-up: shapes, kernels, the grammar
            wp = prompts_for(b, args.prompt_len, llm.vocab_size, special, seed=99)
            for p in (plain, guided):
                measure(llm, None, wp, SamplingParams(max_tokens=6, ignore_eos=True, guided=p.guided))
        log.info("[%s] warmed up (%.0fs since start)", mode, time.perf_counter() - t_start)
        for b in batches:
            prompts = prompts_for(b, args.prompt_len, llm.vocab_size, special, seed=b)
            runs: dict[str, list[dict]] = {"plain": [], "guided": []}
            for _ in range(args.reps):
                runs["plain"].append(measure(llm, probe, prompts, plain))
                runs["guided"].append(measure(llm, probe, prompts, guided))
            pick = {k: sorted(v, key=lambda r: r["tokens_per_s"])[(len(v) - 1) // 2] for k, v in runs.items()}
            u, g = pick["plain"], pick["guided"]
            row = {"speculative": mode, "spec_tokens": 0 if mode == "none" else args.spec_tokens, "batch": b,
                   "unconstrained": u, "guided": g,
                   "tokens_per_s_loss_pct": round(100 * (1 - g["tokens_per_s"] / u["tokens_per_s"]), 2),
                   "step_ms_increase_pct": round(100 * (g["mean_step_ms"] / u["mean_step_ms"] - 1), 2),
                   # the guided step's host time in grammar work that did not run under the GPU forward
                   "exposed_grammar_ms": round(g["cut_ms"] + g["fill_ms"] - g["hidden_ms"] + g["commit_ms"]
                                               + g["apply_ms"] - g["apply_hidden_ms"], 4),
                   # the guided step's extra time not explained by its grammar work (exposed)
                   "other_ms": round(g["mean_step_ms"] - u["mean_step_ms"] - g["cut_ms"] - g["fill_ms"]
                                     + g["hidden_ms"] - g["commit_ms"] - g["apply_ms"] + g["apply_hidden_ms"], 4),
                   "spread_tokens_per_s_pct": {k: round(100 * (max(r["tokens_per_s"] for r in v)
                                                              / min(r["tokens_per_s"] for r in v) - 1), 2)
                                               for k, v in runs.items()},
                   "all_runs": runs}
            results["runs"].append(row)
            log.info("[%s] b%d: plain %.1f tok/s (step %.3f ms), guided %.1f tok/s (step %.3f ms), loss %.2f%%; "
                     "fill %.3f ms (%.3f hidden), commit %.3f, apply %.3f (%.0fs since start)", mode, b,
                     u["tokens_per_s"], u["step_ms"], g["tokens_per_s"], g["step_ms"], row["tokens_per_s_loss_pct"],
                     g["fill_ms"], g["hidden_ms"], g["commit_ms"], g["apply_ms"], time.perf_counter() - t_start)
            results["graph_stats"][mode] = llm.stats()["graphs"]
            write_json(args.json, results)                       # as it goes: a killed run keeps its rows
        probe.close()
        llm.close()
        del llm, probe
        if cuda:
            torch.cuda.empty_cache()
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    print_table(results)
    write_json(args.json, results)


def print_table(results: dict) -> None:
    m, cuda = results["machine"], results["cuda"]
    print(f"\nstructured output overhead, {results['preset']} preset ({results['dtype']}, graphs "
          f"{results.get('graphs', 'auto')}), greedy, max_tokens {results['max_tokens']}, prompt "
          f"{results['prompt_len']}; device {m['device']}"
          + (f"; copy {m['ceilings']['copy_gbps']} GB/s, bf16 GEMM {m['ceilings']['gemm_tflops']} TFLOP/s"
             if "ceilings" in m else "") + ("" if cuda else f", {m['torch_threads']} torch threads"))
    head = (f"{'spec':6s} {'batch':>5s} | {'plain tok/s':>11s} {'step ms':>8s} | {'guided tok/s':>12s} {'step ms':>8s}"
            f" | {'loss %':>6s} | {'cut':>6s} {'fill':>6s} {'hidden':>6s} {'commit':>6s} {'apply':>6s}"
            + (f" {'a.hid':>6s} {'gpu':>6s} {'fwd':>7s}" if cuda else "") + f" {'other':>6s} | {'acc len u/g':>11s}")
    print(head)
    print("-" * len(head))
    for r in results["runs"]:
        u, g = r["unconstrained"], r["guided"]
        mode = "none" if r["speculative"] == "none" else f"{r['speculative']}{r['spec_tokens']}"
        acc = f"{u['mean_accepted_length'] or '-'}/{g['mean_accepted_length'] or '-'}"
        print(f"{mode:6s} {r['batch']:5d} | {u['tokens_per_s']:11.1f} {u['step_ms']:8.3f} | {g['tokens_per_s']:12.1f}"
              f" {g['step_ms']:8.3f} | {r['tokens_per_s_loss_pct']:6.2f} | {g['cut_ms']:6.3f} {g['fill_ms']:6.3f}"
              f" {g['hidden_ms']:6.3f} {g['commit_ms']:6.3f} {g['apply_ms']:6.3f}"
              + (f" {g['apply_hidden_ms']:6.3f} {g['apply_gpu_ms']:6.3f} {g['forward_gpu_ms']:7.3f}" if cuda else "")
              + f" {r['other_ms']:6.3f} | {acc:>11s}")
    print("(step ms: median decode step; loss: decode tokens/s of guided vs unconstrained; cut / fill / commit / "
          "apply: the guided step's host ms in GrammarRuntime.cut_drafts (before the forward), GrammarRuntime.fill (after its "
          "launch), GuidedState.commit, GrammarRuntime.apply; hidden: the part of fill that ran while the GPU forward was "
          "still running" + (", a.hid: the same for apply, gpu: apply's GPU ms, fwd: the forward's GPU ms (events)" if cuda else "")
          + "; other: mean guided step - mean unconstrained step - the exposed grammar time; acc len: mean "
          "accepted length, unconstrained / guided)", flush=True)


if __name__ == "__main__":
    main()
