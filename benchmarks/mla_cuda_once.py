"""One call of the SM90 MLA kernel per schedule at one shape, for a profiler to look at
(Nsight Compute where the machine's runtime lets it read counters):

    ncu --clock-control none -k regex:mla_verify --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python benchmarks/mla_cuda_once.py --heads 12 --batch 128 --ctx 8192 --schedules shared,pair

Each schedule runs three times (the first compiles nothing but warms up), in the order given.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--schedules", default="shared,pair")
    ap.add_argument("--resident", type=int, default=0,
                    help="draw every page from this many (as mla_ab.py --resident: the kernel's "
                         "own pace, HBM out of the way)")
    args = ap.parse_args(argv)
    from mla_verify import D_QK, D_V, Q_ROWS, check_resident, make_cache
    check_resident(args.resident)

    from k3trt.plugins import mla_cuda
    inp = make_cache(args.batch, args.ctx, args.kv, pages=args.resident or None)
    q = torch.randn(args.batch * Q_ROWS, args.heads, D_QK, device="cuda", dtype=torch.bfloat16)
    for sched in args.schedules.split(","):
        splits = mla_cuda.default_splits(args.batch, Q_ROWS, args.heads, 0, sched)
        for _ in range(3):
            mla_cuda.mla_verify_cuda(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS, 192 ** -0.5,
                                     0.25 if args.kv == "fp8" else 1.0, D_V, splits,
                                     schedule=sched)
        torch.cuda.synchronize()
        print(f"{sched}: ran 3 calls, splits {splits}", flush=True)


if __name__ == "__main__":
    main()
