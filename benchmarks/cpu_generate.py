"""CPU generation throughput of the torch runtime: a regression reference (the GPU figures come from
benchmarks/e2e.py). Random-weight checkpoints, greedy decoding with EOS ignored, token-id prompts.

    PYTHONPATH=. python benchmarks/cpu_generate.py [--presets tiny,small] [--batches 1,8,32]
        [--prompt-len 64] [--max-tokens 32] [--speculative none,ngram,self] [--spec-tokens 3]
        [--threads N] [--workdir DIR] [--json OUT]

Per preset, speculative mode and batch size B: B prompts submitted at once, run to completion;
reported are the output tokens per second over the whole run (prefill included), the decode-only
rate (output tokens after the first, over the time after the last first token), the time to first
token, and with speculation the mean accepted length (tokens per verify step that had drafts), the
acceptance rate and the decode speedup over `none` at the same batch. Speculative modes: none,
ngram (prompt lookup; prompts are a short random pattern repeated, so drafts exist), self (the
target drafting for itself, `draft:<engine>/rank0`: 100% acceptance, the pure cost of verification
plus a draft model as large as the target), mtp, or draft:DIR. Greedy, EOS ignored, token-id
prompts. The preset's checkpoint and fp32 engine are made once under --workdir (kept between runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from k3trt.builder.build import build_engine
from k3trt.model.make_checkpoint import make_checkpoint
from k3trt.runtime.llm import LLM
from k3trt.runtime.params import SamplingParams

from harness import machine, record, write_json   # benchmarks/ (the script's folder) is on sys.path

log = logging.getLogger("cpu_generate")


def engine_for(preset: str, work: Path, max_batch: int, max_num_tokens: int) -> Path:
    ckpt, engine = work / f"{preset}-ckpt", work / f"{preset}-engine-b{max_batch}-t{max_num_tokens}"
    if not ckpt.exists():
        make_checkpoint(preset, ckpt, seed=0)
    if not engine.exists():
        caps = [c for c in (1, 2, 4, 8, 16, 32, 64, 128) if c < max_batch] + [max_batch]
        build_engine(ckpt, engine, dtype="fp32", capacities=caps, max_num_tokens=max_num_tokens,
                     spec_tokens=0, block_size=64)
    return engine


def measure(llm: LLM, batch: int, prompt_len: int, max_tokens: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [(torch.randint(1, 100_000, (8,), generator=g).tolist() * prompt_len)[:prompt_len]
               for _ in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    steps0 = llm.stats()["steps"]
    spec0 = llm.stats()["speculative"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    first = max(o.stats["time_to_first_token_s"] for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    decode_s = wall - first
    spec = llm.stats()["speculative"]
    steps, drafted, accepted = (spec[k] - spec0[k] for k in ("verify_steps", "drafted_tokens", "accepted_tokens"))
    return {"batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens, "output_tokens": n_out,
            "wall_s": round(wall, 4), "tokens_per_s": round(n_out / wall, 2),
            "decode_tokens_per_s": round((n_out - batch) / decode_s, 2) if decode_s > 0 else None,
            "time_to_first_token_s": round(first, 4), "steps": llm.stats()["steps"] - steps0,
            "mean_accepted_length": round((accepted + steps) / steps, 3) if steps else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--speculative", default="none,ngram,self",
                    help="comma list of none, ngram, self (draft = target), mtp, draft:DIR")
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "k3trt-cpu-bench")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = record(__file__, machine=machine("cpu"), runs=[])
    for preset in args.presets.split(","):
        max_batch = max(batches)
        engine = engine_for(preset, args.workdir, max_batch, max(256, max_batch * args.prompt_len))
        base: dict[int, float] = {}
        for mode in args.speculative.split(","):
            spec = f"draft:{engine / 'rank0'}" if mode == "self" else mode
            llm = LLM(engine, verify_checksums=False, prefix_caching=False,    # distinct prompts anyway
                      speculative=spec, spec_tokens=None if spec == "none" else args.spec_tokens)
            measure(llm, 1, 8, 2)                                              # warm-up
            for b in batches:
                r = {"preset": preset, "speculative": mode, **measure(llm, b, args.prompt_len, args.max_tokens)}
                if mode == "none":
                    base[b] = r["decode_tokens_per_s"]
                elif base.get(b) and r["decode_tokens_per_s"]:
                    r["decode_speedup"] = round(r["decode_tokens_per_s"] / base[b], 3)
                results["runs"].append(r)
                print(f"{preset:6s} {mode:6s} batch {b:3d}: {r['tokens_per_s']:8.1f} tok/s overall, "
                      f"{r['decode_tokens_per_s']} tok/s decode, TTFT {r['time_to_first_token_s']:.3f}s, "
                      f"accepted length {r['mean_accepted_length']}, speedup {r.get('decode_speedup', '-')}",
                      flush=True)
    print(json.dumps(results, indent=2))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
