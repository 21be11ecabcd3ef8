"""How the SM90 MLA kernel's time per call moves under sustained load: one cell called back to back
for --seconds, each call timed with CUDA events, the SM clock and board power sampled by
nvidia-smi meanwhile; the bf16 GEMM rate and copy rate measured first in the same run.

    PYTHONPATH=. python benchmarks/mla_sustained.py --cells 48:128:32768,48:128:8192,12:128:32768 \
        [--seconds 3] [--json out.json]

Prints, per cell and per window of the run, µs per call (median), the SM clock and the power, and
the last window's time over the first (> 1: slower once warm). A single profiled launch (Nsight
Compute) sees the first window; issue 11's benchmark (CUDA-graph replays of 10 calls) sees later
ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import torch

from harness import measure
from mla_verify import D_QK, D_V, Q_ROWS, make_cache, parse_cells


class Sampler:
    """nvidia-smi's SM clock (MHz) and power (W) every 50 ms, with host timestamps."""

    def __init__(self):
        self.samples: list[tuple[float, float, float]] = []
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             "-lms", "50"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.monotonic(), mhz, watts))

    def between(self, t0, t1):
        sel = [(m, w) for t, m, w in self.samples if t0 <= t < t1]
        if not sel:
            return float("nan"), float("nan")
        return statistics.median(m for m, _ in sel), statistics.median(w for _, w in sel)

    def close(self):
        self._proc.terminate()


def run_cell(heads, batch, ctx, seconds, windows, sampler):
    from k3trt.plugins import mla_cuda
    inp = make_cache(batch, ctx, "bf16")
    q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16)
    call = lambda: mla_cuda.mla_verify_cuda(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS,  # noqa: E731
                                            D_QK ** -0.5, 1.0, D_V)
    call()
    torch.cuda.synchronize()
    time.sleep(1.0)  # let the clock recover from the previous cell
    events, stamps = [], []
    t_start = time.monotonic()
    while time.monotonic() - t_start < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()  # (one call in flight: the host stamp brackets the GPU's time)
        events.append(a.elapsed_time(b) * 1e3)
        stamps.append(time.monotonic())
    rows = []
    span = (stamps[-1] - t_start) / windows
    for w in range(windows):
        t0, t1 = t_start + w * span, t_start + (w + 1) * span
        us = [e for e, t in zip(events, stamps) if t0 <= t < t1]
        mhz, watts = sampler.between(t0, t1)
        rows.append(dict(window_s=round(t0 - t_start, 2), calls=len(us),
                         us=round(statistics.median(us), 1) if us else None, sm_mhz=mhz, watts=watts))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="48:128:32768,48:128:8192,12:128:32768")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cells = parse_cells(args.cells, "--cells")  # (before the GPU work: a typo fails at once)
    ceil = measure()
    print(json.dumps(ceil), flush=True)
    sampler = Sampler()
    out = dict(ceilings=ceil, cells=[])
    try:
        print(f"{'H':>3} {'B':>4} {'ctx':>6} {'t (s)':>6} {'calls':>6} {'us':>9} {'SM MHz':>7} "
              f"{'W':>6}")
        for heads, batch, ctx in cells:
            rows = run_cell(heads, batch, ctx, args.seconds, args.windows, sampler)
            for r in rows:
                print(f"{heads:>3} {batch:>4} {ctx:>6} {r['window_s']:>6} {r['calls']:>6} "
                      f"{r['us']:>9} {r['sm_mhz']:>7} {r['watts']:>6}", flush=True)
            first, last = rows[0]["us"], rows[-1]["us"]
            print(f"    last / first window: {last / first:.3f}")
            out["cells"].append(dict(heads=heads, batch=batch, ctx=ctx, windows=rows))
    finally:
        sampler.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
