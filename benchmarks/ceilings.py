"""Measure the two ceilings a roofline needs, on the GPU at hand, in the same run as the figures
they judge: device-to-device copy bandwidth (bytes read + written) and the bf16 GEMM rate.

    python benchmarks/ceilings.py            # prints JSON
    from ceilings import measure             # {"copy_gbps": …, "gemm_tflops": …, …}

Random data throughout (a GEMM on zeros runs faster than on real data); medians of CUDA-event
timings after warm-up.
"""

from __future__ import annotations

import json
import statistics

import torch


def median_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median CUDA-event time of fn() in ms, after `warmup` calls (the other benchmarks use it too)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gbps(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def gemm_tflops(n: int = 8192) -> float:
    """bf16 n×n×n matrix product rate through torch (cuBLAS)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: torch.matmul(a, b, out=out))
    return 2 * n ** 3 / ms / 1e9


def measure() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sms": props.multi_processor_count,
            "copy_gbps": round(copy_gbps(), 1), "gemm_tflops": round(gemm_tflops(), 1)}


if __name__ == "__main__":
    print(json.dumps(measure()))
