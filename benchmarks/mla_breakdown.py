"""Where the SM90 MLA verification time goes: device time of each kernel (verify, split merge) per
call, from CUPTI records (torch.profiler) of back-to-back calls, beside the CUDA-graph time per call
that mla_cuda_check.py reports. Diagnostic for the fixed costs of a short split (issue 11, batch 32 /
8K); the claims live in mla_cuda_check.py's tables.

    PYTHONPATH=. python benchmarks/mla_breakdown.py [--cells 12:32:8192,12:128:1024] \
        [--splits auto,1,2,4,8] [--json out.json]

For each cell (heads:batch:ctx, bf16 or fp8 KV (--kv), 4 rows per request) and split count: µs per
call of the verify kernel and of the merge kernel, their sum, the graph time, the KV read time at the
copy rate measured in the same run (ceilings.py), and the verify kernel's time per page of a CTA.
--resident N draws every page from N that stay in L2 (mla_ab.py's): the kernel's own pace, so that
two split counts' verify times give a CTA's fixed cost and its cost per page. The merge is a
programmatic dependent launch whose CTAs start at once and wait for the verify grid, so its device
time spans the verify kernel's: graph minus verify is what the merge adds to a call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from harness import measure
from harness import command
from mla_verify import capture_graph, check_resident, make_cache, parse_cells, replay_us

Q_ROWS, D_QK, D_V, PAGE = 4, 576, 512, 64


def kernel_us(fn, calls: int = 20) -> dict:
    """Mean device µs per call of each kernel name fn launches."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    tot: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            name = "merge" if "merge" in e.key else ("verify" if "mla_verify" in e.key else e.key[:40])
            tot[name] = tot.get(name, 0.0) + us / calls
    return tot


PHASES = [("setup", 1, 2), ("q_load", 2, 3), ("first_tile", 3, 4), ("wg0_loop", 4, 5),
          ("wg1_loop", 3, 6), ("epilogue", 5, 7),  # clock64 slots (mla_verify_sm90_pair.cu)
          ("epi_sums", 5, 10), ("epi_stage", 10, 11), ("epi_store", 11, 7)]  # parts of the epilogue


def timeline_summary(fn_timeline, ctas: int) -> dict:
    """One launch of the diagnostic build: per-CTA phase times (µs, from clock64 at the SM clock
    implied by globaltimer), the spread of CTA start and end times, and the kernel span, over the
    CTAs that read blocks."""
    from k3trt.plugins import mla_cuda
    ext = mla_cuda.load_extension(timeline=True)
    ext.timeline(ctas)  # reading zeroes the stamps: only this launch's remain
    fn_timeline()
    torch.cuda.synchronize()
    t = ext.timeline(ctas).double()
    t = t[t[:, 8] > 0]  # CTAs with no blocks of their own exit before the stamps
    g0, g1 = t[:, 0], t[:, 8]
    ghz = statistics.median(((t[:, 7] - t[:, 1]) / (g1 - g0).clamp(min=1)).tolist())
    q = lambda x: [round(float(torch.quantile(x, p)), 2) for p in (0.5, 0.9, 1.0)]  # noqa: E731
    out = {name: q((t[:, b] - t[:, a]) / ghz / 1e3) for name, a, b in PHASES}
    out.update(start_skew=q((g0 - g0.min()) / 1e3), end_skew=q((g1.max() - g1) / 1e3),
               cta_span=q((g1 - g0) / 1e3), kernel_span=round(float(g1.max() - g0.min()) / 1e3, 2),
               sm_ghz=round(ghz, 3), sms_used=int(t[:, 9].unique().numel()), ctas_timed=len(t))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="12:32:8192,12:32:2048,12:32:32768,12:128:1024,12:128:8192,"
                                       "48:32:1024,96:32:1024")
    ap.add_argument("--splits", default="auto,1,2,4,8")
    ap.add_argument("--kv", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--resident", type=int, default=0,
                    help="draw every page from this many, which stay in L2 (0: a real cache)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeline", action="store_true",
                    help="also run the diagnostic build once per case and print per-CTA phase times "
                         "(µs: median, p90, max)")
    args = ap.parse_args(argv)
    cells = parse_cells(args.cells, "--cells")  # (before the build: a typo fails at once)
    check_resident(args.resident)
    if args.timeline and args.kv == "fp8":
        ap.error("--timeline stamps only the pair kernel, and an fp8 cache runs the swap kernel at "
                 "<= 48 rows a request from batch 32: leave out --timeline with --kv fp8")
    from k3trt.plugins import mla_cuda
    mla_cuda.load_extension()
    ceil = measure()
    dev = torch.cuda.get_device_properties(0)
    print(json.dumps(ceil), flush=True)
    rows = []
    hdr = f"{'H':>3} {'B':>4} {'ctx':>6} {'splits':>6} {'verify':>8} {'merge':>7} {'sum':>8} " \
          f"{'graph':>8} {'KV@copy':>8} {'us/page':>8}"
    print(hdr)
    for heads, batch, ctx in cells:
        inp = make_cache(batch, ctx, args.kv, args.resident or None)
        q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16)
        _, auto = mla_cuda.default_plan(inp.cache.dtype, batch, Q_ROWS, heads)
        for s in args.splits.split(","):
            splits = auto if s == "auto" else int(s)

            def fn(splits=splits, q=q, inp=inp):
                return mla_cuda.mla_verify_cuda(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS,
                                                192 ** -0.5, 1.0, D_V, splits)
            k = kernel_us(fn)
            g = capture_graph(fn, 10)
            graph = statistics.median(replay_us(g, 10) for _ in range(7))
            v, m = k.get("verify", 0.0), k.get("merge", 0.0)
            kv_us = batch * ctx * D_QK * (1 if args.kv == "fp8" else 2) / ceil["copy_gbps"] / 1e3
            pages = -(-ctx // PAGE) / splits
            rows.append(dict(heads=heads, batch=batch, ctx=ctx, splits=splits, verify_us=round(v, 2),
                             merge_us=round(m, 2), sum_us=round(v + m, 2), graph_us=round(graph, 2),
                             kv_at_copy_us=round(kv_us, 2), verify_us_per_page=round(v / pages, 3)))
            print(f"{heads:>3} {batch:>4} {ctx:>6} {splits:>6} {v:>8.1f} {m:>7.1f} {v + m:>8.1f} "
                  f"{graph:>8.1f} {kv_us:>8.1f} {v / pages:>8.3f}", flush=True)
            if args.timeline:
                ctas = -(-Q_ROWS * heads // 64) * splits * batch
                tl = timeline_summary(lambda: mla_cuda.mla_verify_cuda(
                    q, inp.cache, inp.table, inp.seq_lens, Q_ROWS, 192 ** -0.5, 1.0, D_V, splits,
                    ext=mla_cuda.load_extension(timeline=True)), ctas)
                rows[-1]["timeline"] = tl
                print("      " + json.dumps(tl), flush=True)
        inp = q = fn = None  # free the cache before the next cell
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=command(__file__, argv), device=dev.name, ceilings=ceil,
                           kv=args.kv, resident=args.resident, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
