"""Where a decode step's time goes on the GPU: the graph replay alone (CUDA events), the runtime's
whole step around it, and the kernels of one uncaptured static step by CUDA time (torch.profiler).

    PYTHONPATH=. python benchmarks/profile_step.py [--preset medium] [--batches 1,32,128]
        [--ctx 256] [--q 1] [--top 18] [--json OUT]

The medium preset is built on the device with random weights (as benchmarks/e2e.py does). Each
batch gets a GraphSession over caches filled by a prefill of `ctx` tokens per sequence; then
  replay_ms   median GPU time of one replay of the (batch, q) graph,
  step_ms     median wall time of GraphSession.verify + argmax + .tolist() (host work included),
  phases_ms   the same step with a sync between phases: pack (host), submit (copy + replay call),
              gpu_wait, tail (logit rows, argmax, to the host),
  kernels     the top kernels of one uncaptured static step (the same kernels), by CUDA time.
For the roofline of these steps see benchmarks/e2e.py; this script only says where time goes.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from k3trt.config import ModelConfig
from k3trt.model.loader import build_model
from k3trt.model.presets import preset_config
from k3trt.model.weights import init_random_
from k3trt.runtime.engine import Seq, TorchSession, make_batch
from k3trt.runtime.graphs import GraphSession
from k3trt.runtime.kv_cache import plan_cache

from harness import device_name, median_ms, record, write_json   # benchmarks/ (the script's folder) is on sys.path

log = logging.getLogger("profile_step")
VOCAB = 129408
BLOCK = 64


def session_for(model, batch: int, q: int, ctx: int) -> tuple[GraphSession, list]:
    cfg = model.cfg
    max_len = ctx + 64
    plan = plan_cache(cfg, budget_bytes=8 << 30, block_size=BLOCK, max_live=batch, max_model_len=max_len,
                      kv_dtype=torch.bfloat16, state_dtype=torch.bfloat16, max_q=q if q > 1 else 0)
    s = GraphSession(model, cfg, plan, device="cuda", dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                     max_q=q if q > 1 else 0, capacities=(batch,), q_values=(q,), max_blocks=-(-max_len // BLOCK))
    per = -(-max_len // BLOCK)
    blocks = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    for i in range(batch):                       # prefill one sequence at a time (eager)
        toks = torch.randint(1, VOCAB, (ctx,), generator=g).tolist()
        s.prefill(make_batch([Seq(toks, 0, blocks[i], i, 1)], BLOCK, capacity=ctx))
    torch.cuda.synchronize()
    seqs = [Seq(torch.randint(1, VOCAB, (q,), generator=g).tolist(), ctx, blocks[i], i, q) for i in range(batch)]
    return s, seqs


def profile(model, batch: int, q: int, ctx: int, top: int) -> dict:
    s, seqs = session_for(model, batch, q, ctx)
    b = make_batch(seqs, BLOCK, capacity=batch, save_kda_states=q > 1)
    st = s.steps[(batch, q)]
    for _ in range(3):
        s.verify(b)
    replay_ms = median_ms(st.graph.replay, warmup=0, reps=20)
    walls = []
    for _ in range(20):
        t0 = time.perf_counter()
        s.verify(b).argmax(-1).tolist()
        walls.append((time.perf_counter() - t0) * 1e3)
    # the step in phases, synchronising between them: packing the inputs (host), submitting the
    # copy + replay (host; cudaGraphLaunch), waiting for the GPU, then picking the logit rows and
    # the argmax back to the host
    phases = {"pack": [], "submit": [], "gpu_wait": [], "tail": []}
    for _ in range(20):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        st.layout.pack(b, s.spare_slot, st.host)
        t.append(time.perf_counter())
        st.dev.copy_(st.host, non_blocking=True)
        st.graph.replay()
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        st.logits[st.views["logit_rows"][:len(b.logit_rows)]].argmax(-1).tolist()
        t.append(time.perf_counter())
        for (name, times), t0, t1 in zip(phases.items(), t, t[1:]):
            times.append((t1 - t0) * 1e3)
    # the same step uncaptured, under the profiler: kernels by name
    st_graph, st.graph = st.graph, None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        s.verify(b)
        torch.cuda.synchronize()
    st.graph = st_graph
    kernels = _by_kernel(prof)
    total = sum(k[1] for k in kernels)
    launches = sum(k[2] for k in kernels)
    out = {"batch": batch, "q": q, "ctx": ctx, "replay_ms": round(replay_ms, 4),
           "step_ms": round(statistics.median(walls), 4),
           "phases_ms": {k: round(statistics.median(v), 4) for k, v in phases.items()},
           "profiled_kernel_ms": round(total, 4),
           "kernel_launches": launches, "top_kernels": kernels[:top]}
    del s, st, st_graph
    torch.cuda.empty_cache()
    return out


def profile_prefill(model, tokens: int, top: int) -> dict:
    """One eager prefill chunk of `tokens` tokens of one fresh sequence: wall time and kernels."""
    plan = plan_cache(model.cfg, budget_bytes=4 << 30, block_size=BLOCK, max_live=1, max_model_len=tokens,
                      kv_dtype=torch.bfloat16, state_dtype=torch.bfloat16)
    s = TorchSession(model, model.cfg, plan, device="cuda", dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    blocks = list(range(-(-tokens // BLOCK)))
    toks = torch.randint(1, VOCAB, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    b = make_batch([Seq(toks, 0, blocks, 0, 1)], BLOCK, capacity=tokens)
    for _ in range(2):
        s.prefill(b)
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        s.prefill(b)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        s.prefill(b)
        torch.cuda.synchronize()
    kernels = _by_kernel(prof)
    return {"prefill_tokens": tokens, "wall_ms": round(statistics.median(walls), 3),
            "profiled_kernel_ms": round(sum(k[1] for k in kernels), 3), "top_kernels": kernels[:top]}


def _by_kernel(prof) -> list:
    by = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = by[e.name[:90]]
            k[0] += e.device_time_total / 1e3
            k[1] += 1
    return sorted(([n, round(v[0], 4), v[1]] for n, v in by.items()), key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--q", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--prefill", type=int, default=0, help="also profile one prefill chunk of this many tokens")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("k3trt.runtime.kv_cache", "k3trt.runtime.engine", "k3trt.runtime.graphs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    cfg = ModelConfig.from_dict(preset_config(args.preset, VOCAB))
    t0 = time.perf_counter()
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda")
    init_random_(model, 0, device="cuda")
    log.info("%s model on the GPU in %.1fs", args.preset, time.perf_counter() - t0)
    doc = record(__file__, device=device_name(), torch=torch.__version__, rows=[])
    for b in [int(x) for x in args.batches.split(",")]:
        try:
            r = profile(model, b, args.q, args.ctx, args.top)
        except Exception as e:                                   # keep going: device time is scarce
            log.exception("batch %d failed", b)
            r = {"batch": b, "error": f"{type(e).__name__}: {e}"}
        doc["rows"].append(r)
        write_json(args.json, doc)
        if "error" in r:
            continue
        print(f"\nbatch {b} q {args.q} ctx {args.ctx}: replay {r['replay_ms']} ms, step {r['step_ms']} ms "
              f"(phases {r['phases_ms']}), "
              f"profiled kernels {r['profiled_kernel_ms']} ms in {r['kernel_launches']} launches")
        for name, ms, n in r["top_kernels"]:
            print(f"  {ms:9.4f} ms {n:5d}x  {name}")
    if args.prefill:
        r = profile_prefill(model, args.prefill, args.top)
        doc["prefill"] = r
        write_json(args.json, doc)
        print(f"\nprefill {args.prefill} tokens: {r['wall_ms']} ms wall, profiled kernels {r['profiled_kernel_ms']} ms")
        for name, ms, n in r["top_kernels"]:
            print(f"  {ms:9.4f} ms {n:5d}x  {name}")


if __name__ == "__main__":
    main()
