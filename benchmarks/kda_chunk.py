"""Prefill's chunked KDA (k3trt::kda_chunked, plain torch) at K3 sizes by chunk size: the per-chunk
[n, n, dk] decay tensors make traffic grow with the chunk, the per-chunk launches with their count.

    PYTHONPATH=. python benchmarks/kda_chunk.py [--tokens 2048] [--heads 96] [--chunks 16,32,64] [--json OUT]

Prints ms per call (median of CUDA-event timings) and the max difference to the 64-chunk result.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from k3trt.plugins.kda import kda_chunked

from harness import device_name, median_ms, record, write_json   # benchmarks/ (the script's folder) is on sys.path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chunks", default="64,32,16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = "cuda"
    T, H, D = args.tokens, args.heads, args.dim
    g = torch.Generator(device=dev).manual_seed(0)
    q = F.normalize(torch.randn(T, H, D, device=dev, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, D, device=dev, generator=g), dim=-1)
    v = torch.randn(T, H, D, device=dev, generator=g)
    gg = -5.0 * torch.sigmoid(torch.randn(T, H, D, device=dev, generator=g))
    beta = torch.rand(T, H, device=dev, generator=g)
    s0 = torch.zeros(H, D, D, device=dev)
    rows, ref = [], None
    for cs in (int(x) for x in args.chunks.split(",")):
        fn = lambda: kda_chunked(q, k, v, gg, beta, s0, D ** -0.5, cs)   # noqa: E731
        o, s = fn()
        ms = median_ms(fn, warmup=2, reps=5)
        ref = ref if ref is not None else (o, s)
        row = {"chunk": cs, "ms": round(ms, 3),
               "max_diff_out": (o - ref[0]).abs().max().item(), "max_diff_state": (s - ref[1]).abs().max().item()}
        rows.append(row)
        print(row, flush=True)
    write_json(args.json, record(__file__, device=device_name(), torch=torch.__version__, rows=rows))


if __name__ == "__main__":
    main()
