"""step_trace's reading of a profiler trace, on a trace made by hand: busy and idle per step, the
kernels outside graphs, the host's waits, and each gap's launching call."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from step_trace import _gaps  # noqa: E402  (benchmarks/ is not a package)


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}


def _trace() -> list[dict]:
    """Two 100 µs steps. Step 0: a graph (two kernels, 0-40) then a copy 45-50 (a 5 µs gap: a
    launch's latency, not counted) and an index kernel 70-80 (a 20 µs gap). Step 1: the graph at
    100-160, the index kernel 190-195 (30 µs); the window's last 5 µs are under GAP_US."""
    ev = [_x("user_annotation", "k3trt_step", 0, 100), _x("user_annotation", "k3trt_step", 100, 100),
          _x("cuda_runtime", "cudaStreamSynchronize", 60, 8, correlation=99)]
    for step, t in ((0, 0), (1, 100)):
        c = 10 * step
        ev += [_x("cuda_runtime", "cudaGraphLaunch", t, 1, correlation=c + 1),
               _x("kernel", "gemm", t, 25 if step == 0 else 30, correlation=c + 1),
               _x("kernel", "moe", t + (25 if step == 0 else 30), 15 if step == 0 else 30, correlation=c + 1),
               _x("cuda_runtime", "cudaLaunchKernel", t + 50, 1, correlation=c + 2)]
    ev += [_x("cuda_runtime", "cudaMemcpyAsync", 42, 1, correlation=3),
           _x("gpu_memcpy", "Memcpy HtoD", 45, 5, correlation=3),
           _x("kernel", "index_kernel", 70, 10, correlation=2),
           _x("kernel", "index_kernel", 190, 5, correlation=12)]
    return ev


def test_busy_idle_and_what_ran_outside_graphs():
    fig, gaps = _gaps(_trace())
    assert fig["steps"] == 2 and fig["step_ms"] == pytest.approx(0.1)
    busy_us = 40 + 5 + 10 + 60 + 5
    assert fig["gpu_busy_ms"] == pytest.approx(busy_us / 2 / 1e3)
    assert fig["gpu_idle_ms"] == pytest.approx((200 - busy_us) / 2 / 1e3)
    assert fig["graph_kernels_ms"] == pytest.approx((40 + 60) / 2 / 1e3)
    assert fig["kernels_outside_graphs"] == 1.5          # per step: two index kernels and one copy
    top = {r["kernel"]: r for r in fig["outside_graphs"]}
    assert top["index_kernel"]["per_step"] == 1.0 and top["index_kernel"]["ms"] == pytest.approx(0.0075)
    assert fig["host_waits_ms"] == {"cudaStreamSynchronize": pytest.approx(0.004)}
    # gaps over GAP_US: before the index kernels (20 and 30 µs) and step 1's graph (20); the last
    # 5 µs and the copy's 5 are not
    assert [(g["kernel"], g["us"], g["launch"], g["step"]) for g in gaps] == \
        [("index_kernel", 20, "cudaLaunchKernel", 0), ("gemm", 20, "cudaGraphLaunch", 1),
         ("index_kernel", 30, "cudaLaunchKernel", 1)]


def test_work_launched_in_the_steps_counts_past_the_hosts_end_and_earlier_work_does_not():
    ev = _trace() + [_x("cuda_runtime", "cudaLaunchKernel", 150, 1, correlation=50),
                     _x("kernel", "ahead", 210, 20, correlation=50),          # launched ahead: 210-230
                     _x("cuda_runtime", "cudaLaunchKernel", -30, 1, correlation=60),
                     _x("kernel", "before", -20, 15, correlation=60),       # launched before the steps
                     _x("cuda_driver", "cuLaunchKernel", 160, 1, correlation=70),
                     _x("kernel", "triton", 170, 10, correlation=70)]       # a driver-API launch (Triton)
    fig, gaps = _gaps(ev)
    busy_us = 40 + 5 + 10 + 60 + 5 + 20 + 10
    assert {r["kernel"] for r in fig["outside_graphs"]} == {"index_kernel", "Memcpy HtoD", "ahead", "triton"}
    assert fig["step_ms"] == pytest.approx(0.115)                  # the window ends at 230
    assert fig["gpu_busy_ms"] == pytest.approx(busy_us / 2 / 1e3)
    assert ("ahead", 15) in [(g["kernel"], g["us"]) for g in gaps] and "before" not in str(fig)
