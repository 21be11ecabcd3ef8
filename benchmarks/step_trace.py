"""Where the GPU waits during a run of runtime steps: a torch.profiler trace read back as GPU busy
and idle time per step, the kernels launched outside CUDA graphs, the host's waits on the device,
and each idle gap put down to the code that launched the work ending it.

    profile = trace_steps(start, steps=8)   # start() -> (step, finish): a fresh run, warmed up
    report_trace("K3 b1", profile)

Two passes, each over `steps` steps of its own fresh run (a run of fixed length may not last both).
The first, with no Python stacks, gives the figures: the window is the first step's start to the
end of the last work the steps launched (the host's clock and the device's, as the trace aligns
them); busy is the union of the kernels, copies and memsets the steps launched; idle the rest. The
second records Python stacks (which slow the host), only to name the k3trt or benchmark function
that launched the kernel after each idle gap of the first pass's kind, matched by the gap's place
in its step. On the CPU there is no device trace: the record says so and holds the host figures alone.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from harness import print_table
from torch.profiler import ProfilerActivity, profile, record_function

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
SYNC = re.compile(r"Synchronize|cudaMemcpy$|cudaMemcpy[^A]|cudaStreamWaitEvent")
OWN = re.compile(r"(k3trt|benchmarks)/")
GAP_US = 10.0           # shorter gaps are a launch's own latency, not the device waiting


def _trace(start, steps: int, stack: bool) -> tuple[list[dict], float]:
    step, finish = start()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=acts, with_stack=stack) as prof:
        for _ in range(steps):
            with record_function("k3trt_step"):
                step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    finish()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    return events, wall


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _innermost(frames: list[dict], ts: float) -> str | None:
    """The innermost of `frames` (sorted by start) that holds time `ts`."""
    best = None
    for f in frames:
        if f["ts"] > ts:
            break
        if f["ts"] + f["dur"] >= ts and (best is None or f["dur"] <= best["dur"]):
            best = f
    return None if best is None else best["name"]


def _gaps(events: list[dict]) -> tuple[dict, list[dict]]:
    """Figures of one trace, and its idle gaps with the launch call of the activity after each."""
    steps = sorted((e for e in events if e.get("name") == "k3trt_step" and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:
        return {}, []
    lo, host_end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    # launches: the runtime API's, and the driver API's (Triton launches through cuLaunchKernel)
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") in LAUNCH_CATS and "args" in e}
    # the steps' own device work: what they launched (a step launched ahead runs past the host's end)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS
                  and lo <= runtime.get(e.get("args", {}).get("correlation"), {}).get("ts", -1) <= host_end),
                 key=lambda e: e["ts"])
    hi = max([host_end] + [e["ts"] + e["dur"] for e in gpu])
    busy = _union([(max(e["ts"], lo), e["ts"] + e["dur"]) for e in gpu if e["ts"] + e["dur"] > lo])
    gaps, last = [], lo
    for a, b in busy:
        if a - last > GAP_US:
            nxt = next(e for e in gpu if e["ts"] >= a)
            launch = runtime.get(nxt.get("args", {}).get("correlation"))
            step = max((i for i, s in enumerate(steps) if s["ts"] <= a), default=0)
            gaps.append({"us": a - last, "kernel": nxt["name"][:80], "launch": launch["name"] if launch else None,
                         "launch_ts": launch["ts"] if launch else None, "tid": launch.get("tid") if launch else None,
                         "step": step, "at": a - steps[step]["ts"]})
        last = b
    if hi - last > GAP_US:
        gaps.append({"us": hi - last, "kernel": "(the window's end)", "launch": None, "launch_ts": None,
                     "tid": None, "step": len(steps) - 1, "at": hi - steps[-1]["ts"]})
    n, window = len(steps), hi - lo
    graph_of = {c for c, e in runtime.items() if e["name"] == "cudaGraphLaunch"}
    kernels = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        if e["args"].get("correlation") not in graph_of:
            kernels[e["name"][:80]][0] += 1
            kernels[e["name"][:80]][1] += e["dur"]
    in_graphs = sum(e["dur"] for e in gpu if e["args"].get("correlation") in graph_of)
    syncs = defaultdict(float)
    for e in runtime.values():
        if SYNC.search(e["name"]) and lo <= e["ts"] <= hi:
            syncs[e["name"]] += e["dur"]
    busy_us = sum(b - a for a, b in busy)
    fig = {"steps": n, "step_ms": round(window / n / 1e3, 4), "gpu_busy_ms": round(busy_us / n / 1e3, 4),
           "gpu_idle_ms": round((window - busy_us) / n / 1e3, 4),
           "graph_kernels_ms": round(in_graphs / n / 1e3, 4),
           "kernels_outside_graphs": sum(c for c, _ in kernels.values()) / n,
           "outside_graphs": sorted(({"kernel": k, "per_step": round(c / n, 2), "ms": round(t / n / 1e3, 4)}
                                     for k, (c, t) in kernels.items()), key=lambda r: -r["ms"]),
           "host_waits_ms": {k: round(v / n / 1e3, 4) for k, v in sorted(syncs.items(), key=lambda kv: -kv[1])}}
    return fig, gaps


def _name(gaps: list[dict], events: list[dict]) -> None:
    """Each gap's launching function: the innermost k3trt / benchmarks Python frame of the launch
    call in the stacked trace nearest in step and place to the gap."""
    frames = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and OWN.search(e.get("name", "")):
            frames[e.get("tid")].append(e)
    for fs in frames.values():
        fs.sort(key=lambda e: e["ts"])
    _, stacked = _gaps(events)
    for g in gaps:
        near = min((s for s in stacked if s["step"] == g["step"] and s["kernel"] == g["kernel"]),
                   key=lambda s: abs(s["at"] - g["at"]), default=None)
        if near is not None and near["launch_ts"] is not None:
            g["caller"] = _innermost(frames.get(near["tid"], []), near["launch_ts"])


def trace_steps(start, steps: int = 8, top: int = 12) -> dict:
    """The figures of `steps` steps of a run `start()` begins (module doc): it returns the run's
    step function, warmed up, and a function that finishes the run."""
    events, wall = _trace(start, steps, stack=False)
    fig, gaps = _gaps(events)
    if not fig or not torch.cuda.is_available():
        return {"steps": steps, "step_ms": round(wall * 1e3 / steps, 4), "device_trace": False}
    _name(gaps, _trace(start, steps, stack=True)[0])
    by = defaultdict(lambda: [0, 0.0])
    for g in gaps:
        key = (g.get("caller") or "?", g["kernel"])
        by[key][0] += 1
        by[key][1] += g["us"]
    fig["idle_by_launch"] = sorted(({"caller": c, "next_kernel": k, "gaps_per_step": round(n / steps, 2),
                                     "ms": round(us / steps / 1e3, 4)} for (c, k), (n, us) in by.items()),
                                   key=lambda r: -r["ms"])[:top]
    fig["outside_graphs"] = fig["outside_graphs"][:top]
    fig["device_trace"] = True
    return fig


def report_trace(title: str, fig: dict, ceil: dict | None = None) -> None:
    if not fig.get("device_trace"):
        print(f"{title}: {fig['step_ms']} ms a step (no device trace)")
        return
    print(f"\n{title}: {fig['step_ms']} ms a step, GPU busy {fig['gpu_busy_ms']} ms, idle {fig['gpu_idle_ms']} ms; "
          f"in graphs {fig['graph_kernels_ms']} ms; {fig['kernels_outside_graphs']:.0f} kernels outside graphs; "
          f"host waits {fig['host_waits_ms']}")
    print_table(f"{title}: GPU idle by the launch that ended it (per step)", ceil,
                [("caller", "caller", 60, "s"), ("next kernel", "next_kernel", 44, "s"),
                 ("gaps", "gaps_per_step", 6, ".1f"), ("ms", "ms", 8, ".3f")], fig["idle_by_launch"])
    print_table(f"{title}: kernels outside CUDA graphs (per step)", ceil,
                [("kernel", "kernel", 70, "s"), ("n", "per_step", 6, ".1f"), ("ms", "ms", 8, ".3f")],
                fig["outside_graphs"])
