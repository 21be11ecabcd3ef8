"""A/B of builds of the SM90 MLA kernel in one run: the sources in each --a (a baseline copy, e.g.
`git show`n from an earlier commit into a folder; repeat --a for several) against the tree's (B),
each case checked against the fp32 reference, all timed interleaved (CUDA-graph replays of 10
calls, round by round, so a lent GPU's drift moves them alike), with the copy rate measured in the
same run.

    PYTHONPATH=. python benchmarks/mla_ab.py --a /tmp/base [--a name=/tmp/other] \
        [--variant s=shared] --cells 12:32:8192,12:128:1024 [--kv bf16,fp8] [--json out.json]

Prints µs per call for each build, B's fraction of the roofline and each A / B (> 1: B is faster).
--resident N draws every page from N pages that stay in L2: the time is then the kernel's own pace
(tensor cores, issue, latency), what bounds it on a card with more bandwidth (the H200 over the H100).
An --a is labelled A, A2, A3, ... unless given as name=folder, and runs the pair schedule unless
given as folder:schedule (B runs the tree's default, pick_schedule's). A --variant runs the tree's build
with another schedule and launch options (name=schedule[:option=int,...]), timed and compared
like an --a.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from harness import measure
from harness import command
from mla_cuda_check import compare, interleaved_graph_us
from mla_verify import check_resident, make_cache, parse_cells

Q_ROWS, D_QK, D_V = 4, 576, 512


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", action="append", default=[],
                    help="[name=]folder[:schedule] with a baseline's mla_cuda sources, run with "
                         "that schedule (default: pair) (repeatable)")
    ap.add_argument("--variant", action="append", default=[],
                    help="name=schedule[:option=int,...]: the tree's build run so, e.g. "
                         "wide=pair:min_split_blocks=1,max_spread=8 (repeatable)")
    ap.add_argument("--cells", default="12:32:8192,12:128:1024,12:128:8192,48:32:1024,96:32:8192")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--resident", type=int, default=0,
                    help="draw every page from this many (e.g. 256: 9 MB of fp8, inside L2), so "
                         "HBM does not bound the kernel; B frac is then against the GEMM rate alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cells = parse_cells(args.cells, "--cells")  # (before the builds: a typo fails at once)
    check_resident(args.resident)
    from k3trt.plugins import mla_cuda
    from k3trt.plugins.mla_verify import mla_verify_ref
    exts = {}  # label -> (build, launch options)
    for i, spec in enumerate(args.a):
        label, _, folder = spec.rpartition("=")
        folder, _, schedule = folder.partition(":")
        # (pair unless told: builds from before the swap kernel treat its code as the shared one)
        exts[label or ("A" if i == 0 else f"A{i + 1}")] = (
            mla_cuda.load_extension(src_dir=folder), dict(schedule=schedule or "pair"))
    for spec in args.variant:
        label, _, rest = spec.partition("=")
        schedule, _, opts = rest.partition(":")
        extra = {k: int(v) for k, v in (o.split("=") for o in opts.split(",") if o)}
        exts[label] = (mla_cuda.load_extension(), dict(schedule=schedule, **extra))
    exts["B"] = (mla_cuda.load_extension(), {})
    bases = [k for k in exts if k != "B"]
    ceil = measure()
    print(json.dumps(ceil), flush=True)
    print(f"{'kv':>5} {'H':>3} {'B':>4} {'ctx':>6} "
          + " ".join(f"{k + ' us':>8}" for k in exts) + f" {'B frac':>7} "
          + " ".join(f"{k + '/B':>6}" for k in bases) + " errors (max rel.)")
    rows = []
    for kv in args.kv.split(","):
        for heads, batch, ctx in cells:
            inp = make_cache(batch, ctx, kv, pages=args.resident or None)
            kv_scale = 0.25 if kv == "fp8" else 1.0
            q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16)
            ref = mla_verify_ref(q[:2 * Q_ROWS], inp.cache, inp.table[:2], inp.seq_lens[:2], Q_ROWS,
                                 192 ** -0.5, kv_scale, D_V)
            calls, errs = {}, {}
            for label, (ext, kw) in exts.items():
                def call(ext=ext, kw=kw, q=q, inp=inp, kv_scale=kv_scale):
                    return mla_cuda.mla_verify_cuda(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS,
                                                    192 ** -0.5, kv_scale, D_V, ext=ext, **kw)
                out, lse = call()
                c = compare(out[:2 * Q_ROWS], lse[:2 * Q_ROWS], *ref, f"{label} {kv} {heads}:{batch}:{ctx}")
                errs[label] = c["rel_err"] if c["ok"] else f"BAD {c['rel_err']}"
                calls[label] = call
            us = interleaved_graph_us(calls)
            nbytes = batch * ctx * D_QK * inp.cache.element_size()
            flops = 2 * Q_ROWS * heads * batch * ctx * (D_QK + D_V)
            t_mem = 0.0 if args.resident else nbytes / ceil["copy_gbps"] / 1e3
            roof = max(t_mem, flops / ceil["gemm_tflops"] / 1e6)
            row = dict(kv=kv, heads=heads, batch=batch, ctx=ctx,
                       us={k: round(v, 2) for k, v in us.items()},
                       b_fraction=round(roof / us["B"], 3),
                       over_b={k: round(us[k] / us["B"], 3) for k in bases}, errors=errs)
            rows.append(row)
            worst = max((e for e in errs.values() if not isinstance(e, str)), default=0.0)
            bad = [f"{k}: {e}" for k, e in errs.items() if isinstance(e, str)]
            print(f"{kv:>5} {heads:>3} {batch:>4} {ctx:>6} "
                  + " ".join(f"{us[k]:>8.1f}" for k in exts) + f" {row['b_fraction']:>7.3f} "
                  + " ".join(f"{row['over_b'][k]:>6.3f}" for k in bases)
                  + f" {' '.join(bad) or f'{worst:.1e}'}", flush=True)
            inp = q = calls = None
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=command(__file__, argv), ceilings=ceil, resident=args.resident,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
