"""A/B of two builds of the SM90 MLA kernel in one run: the sources in --a (a baseline copy, e.g.
`git show`n from an earlier commit into a folder) against the tree's, each case checked against
the fp32 reference, both timed interleaved (CUDA-graph replays of 10 calls, round by round, so a
lent GPU's drift moves both alike), with the copy rate measured in the same run.

    PYTHONPATH=. python benchmarks/mla_ab.py --a /tmp/base --cells 12:32:8192,12:128:1024 \
        [--kv bf16,fp8] [--json out.json]

Prints µs per call for A and B, B's fraction of the roofline and A/B (> 1: B is faster).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ceilings import measure
from mla_cuda_check import compare, interleaved_graph_us
from mla_verify import make_cache

Q_ROWS, D_QK, D_V = 4, 576, 512


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="folder with the baseline's mla_cuda sources")
    ap.add_argument("--cells", default="12:32:8192,12:128:1024,12:128:8192,48:32:1024,96:32:8192")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from k3trt.plugins import mla_cuda
    from k3trt.plugins.mla_verify import mla_verify_ref
    exts = {"A": mla_cuda.load_extension(src_dir=args.a), "B": mla_cuda.load_extension()}
    ceil = measure()
    print(json.dumps(ceil), flush=True)
    print(f"{'kv':>5} {'H':>3} {'B':>4} {'ctx':>6} {'A us':>8} {'B us':>8} {'B frac':>7} {'A/B':>6} "
          f"{'errA':>8} {'errB':>8}")
    rows = []
    for kv in args.kv.split(","):
        for cell in args.cells.split(","):
            heads, batch, ctx = (int(x) for x in cell.split(":"))
            inp = make_cache(batch, ctx, kv)
            kv_scale = 0.25 if kv == "fp8" else 1.0
            q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16)
            ref = mla_verify_ref(q[:2 * Q_ROWS], inp.cache, inp.table[:2], inp.seq_lens[:2], Q_ROWS,
                                 192 ** -0.5, kv_scale, D_V)
            calls, errs = {}, {}
            for label, ext in exts.items():
                def call(ext=ext, q=q, inp=inp, kv_scale=kv_scale):
                    return mla_cuda.mla_verify_cuda(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS,
                                                    192 ** -0.5, kv_scale, D_V, ext=ext)
                out, lse = call()
                c = compare(out[:2 * Q_ROWS], lse[:2 * Q_ROWS], *ref, f"{label} {kv} {cell}")
                errs[label] = c["rel_err"] if c["ok"] else f"BAD {c['rel_err']}"
                calls[label] = call
            us = interleaved_graph_us(calls)
            nbytes = batch * ctx * D_QK * inp.cache.element_size()
            flops = 2 * Q_ROWS * heads * batch * ctx * (D_QK + D_V)
            roof = max(nbytes / ceil["copy_gbps"] / 1e3, flops / ceil["gemm_tflops"] / 1e6)
            row = dict(kv=kv, heads=heads, batch=batch, ctx=ctx, a_us=round(us["A"], 2),
                       b_us=round(us["B"], 2), b_fraction=round(roof / us["B"], 3),
                       a_over_b=round(us["A"] / us["B"], 3), err_a=errs["A"], err_b=errs["B"])
            rows.append(row)
            print(f"{kv:>5} {heads:>3} {batch:>4} {ctx:>6} {us['A']:>8.1f} {us['B']:>8.1f} "
                  f"{row['b_fraction']:>7.3f} {row['a_over_b']:>6.3f} {str(errs['A'])[:8]:>8} "
                  f"{str(errs['B'])[:8]:>8}", flush=True)
            inp = q = calls = None
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command="PYTHONPATH=. python benchmarks/mla_ab.py " + " ".join(
                argv if argv is not None else sys.argv[1:]), ceilings=ceil, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
