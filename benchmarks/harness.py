"""What every benchmark script shares: the ceilings a roofline needs, measured on the device at hand
in the same run as the figures they judge; GPU timing; the JSON record with the command that makes
it again; a table printer; and the request driver.

    python benchmarks/harness.py                 # prints the ceilings as JSON
    from harness import measure, median_ms, graph_us, record, write_json, print_table, Progress

Ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 GEMM rate, on random
data (a GEMM on zeros runs faster than on real data), medians of CUDA-event timings after warm-up.
Scripts run with `PYTHONPATH=.` from the repository root; their own folder is on sys.path, which is
how they import this module.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch


# ------------------------------------------------------------------------------ timing
def median_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median CUDA-event time of fn() in ms, after `warmup` calls."""
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


def capture_graph(fn, calls: int = 10):
    """fn() run once eagerly and once on a side stream (compile, allocator), then `calls` of it
    captured in one CUDA graph, replayed once."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return graph


def graph_us(fn, calls: int = 10, reps: int = 7) -> float:
    """Median µs per call of fn() captured `calls` times in one CUDA graph and replayed `reps`
    times: launch overhead out, as a step's graph replays it."""
    graph = capture_graph(fn, calls)
    ms = median_ms(graph.replay, warmup=1, reps=reps)
    del graph
    return ms * 1000 / calls


def best_s(fn, reps: int = 5) -> float:
    """Best host wall time of fn() in seconds after one warm-up call (CPU timings)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------------------ ceilings
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
    """The GPU's name, SM count and both ceilings."""
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sms": props.multi_processor_count,
            "copy_gbps": round(copy_gbps(), 1), "gemm_tflops": round(gemm_tflops(), 1)}


def cpu_ceilings() -> dict:
    """A crude stand-in for a CPU smoke run: a 64 MB copy and a 512³ fp32 product, host-timed."""
    src = torch.rand(16 << 20)
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() * 4 / best_s(lambda: dst.copy_(src)) / 1e9
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    tflops = 2 * 512 ** 3 / best_s(lambda: a @ b) / 1e12
    return {"device": device_name("cpu"), "copy_gbps": round(gbps, 1), "gemm_tflops": round(tflops, 3),
            "note": "CPU stand-in (host timer)"}


def device_name(device: str | torch.device = "cuda") -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------ the record
def command(script: str, argv: list[str] | None = None) -> str:
    """`PYTHONPATH=. python benchmarks/<script> <args>`: what to paste into a shell at the repo root to
    make a JSON again. script: the caller's __file__ (or its name); argv: what its main() parsed
    (None: this process's own arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["PYTHONPATH=. python", f"benchmarks/{os.path.basename(script)}",
                     *map(shlex.quote, args)])


def version(module: str) -> str | None:
    """A module's __version__, else its distribution's version, else None (not installed)."""
    try:
        return __import__(module).__version__
    except Exception:                  # not importable, or no __version__: ask the installed metadata
        try:
            return importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            return None


def machine(device: str | torch.device = "cuda") -> dict:
    """Where a record was measured: device, library versions, cores (and the load of a shared CPU)."""
    out = {"device": device_name(device), "torch": torch.__version__, "triton": version("triton"),
           "cuda": torch.version.cuda, "python": platform.python_version(), "cores": os.cpu_count()}
    if torch.device(device).type == "cpu":
        out["torch_threads"] = torch.get_num_threads()
        out["load_average_1m"] = os.getloadavg()[0]   # a shared machine's figures vary with it
    return out


def record(script: str, argv: list[str] | None = None, **fields) -> dict:
    """A results document: the command that makes it again first, then the script's fields."""
    return {"command": command(script, argv), **fields}


def write_json(path: Path | None, doc: dict) -> None:
    """Write doc atomically (a killed run keeps the last complete file); None: nowhere."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------ the table
def _cell(v, width: int, fmt: str) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return format("-" if v is None else str(v), f">{width}s")
    return format(v, f">{width}{fmt}")


def print_table(title: str, ceil: dict | None, columns: list[tuple[str, str, int, str]], rows: list[dict],
                note: str = "") -> None:
    """One table: a title line with the device and the ceilings of the run, then a row per dict.
    columns: (header, key, width, number format); a key "ratio:<a>/<b>" prints rows' a / b."""
    head = title
    if ceil:
        head += (f"; {ceil.get('device', '?')}: copy {ceil['copy_gbps']} GB/s, "
                 f"GEMM {ceil['gemm_tflops']} TFLOP/s")
    print("\n" + head)
    line = " ".join(format(h, f">{w}s") for h, _, w, _ in columns)
    print(line)
    print("-" * len(line))
    for r in rows:
        cells = []
        for _, key, w, fmt in columns:
            if key.startswith("ratio:"):
                a, b = (r.get(k) for k in key[6:].split("/"))
                v = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
            else:
                v = r.get(key)
            cells.append(_cell(v, w, fmt))
        print(" ".join(cells))
    if note:
        print(f"({note})")
    sys.stdout.flush()


# ------------------------------------------------------------------------------ requests
class Progress:
    """Requests driven through ``LLM.step``: submitted together, stepped until each has its first
    token (prefill), then every decode step timed until all have finished.

        prog = Progress(llm, prompts, params)
        prog.prefill()
        before = prog.tokens
        times = prog.decode()          # seconds per step
    """

    def __init__(self, llm, prompts, params):
        self.llm = llm
        self.n_out = dict.fromkeys([llm.add_request(p, params) for p in prompts], 0)
        self.done: set[str] = set()

    @property
    def tokens(self) -> int:
        """Output tokens of these requests so far."""
        return sum(self.n_out.values())

    def step(self) -> None:
        """One engine step; a request of ours that ended in an error fails the benchmark."""
        for o in self.llm.step():
            if o.request_id in self.n_out:
                self.n_out[o.request_id] = len(o.token_ids)
                if o.finished:
                    self.done.add(o.request_id)
                    if o.error:
                        raise RuntimeError(f"{o.request_id}: {o.error}")

    def prefill(self) -> None:
        while not all(self.n_out.values()):
            self.step()

    def decode(self) -> list[float]:
        times = []
        while len(self.done) < len(self.n_out):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return times


if __name__ == "__main__":
    print(json.dumps(measure()))
