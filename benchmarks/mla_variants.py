"""The SM90 MLA kernel's variants for benchmarks/mla_verify.py: its own builder (A/B baselines
from another folder, the timeline build), CUDA-graph timing, and one cell of --ab and of
--breakdown."""

from __future__ import annotations

import hashlib
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from k3trt.plugins import mla_cuda
from k3trt.plugins.mla_verify import mla_verify_ref
from k3trt.testing import rel_norm_error

from harness import capture_graph   # benchmarks/ (the script's folder) is on sys.path

Q_ROWS = 4  # query rows a request (K3's speculative verification)
D_QK, D_V = 576, 512


def replay_us(graph, calls: int) -> float:
    """µs per call of one replay of a graph of `calls` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def graph_time_us(fn, calls: int = 10, reps: int = 7) -> float:
    graph = capture_graph(fn, calls)
    times = [replay_us(graph, calls) for _ in range(reps)]
    del graph
    return statistics.median(times)


def interleaved_graph_us(calls: dict, per_graph: int = 10, rounds: int = 9) -> dict:
    """Median µs per call of each fn in `calls`, each captured in a CUDA graph of `per_graph` calls
    and replayed in rounds (A B C, A B C, ...), so that a lent GPU's clock drifting during the run
    moves every variant alike (timed one after another they moved by up to 15%)."""
    graphs = {label: capture_graph(fn, per_graph) for label, fn in calls.items()}
    torch.cuda.synchronize()
    times = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, g in graphs.items():
            times[label].append(replay_us(g, per_graph))
    return {label: statistics.median(t) for label, t in times.items()}


def build_variant(folder: str, timeline: bool = False):
    """The SM90 extension built from `folder`'s kernel sources, a module of its own beside the
    production build: an A/B baseline, or with `timeline` the pair kernel's per-CTA phase stamps
    (-DMLA_TIMELINE, read back by mod.timeline(ctas))."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 (heavy: only when building)

    folder = os.path.abspath(folder)
    flags = ["-DMLA_TIMELINE"] if timeline else []
    name = f"{mla_cuda.EXTENSION}_{hashlib.sha1(f'{folder}:{timeline}'.encode()).hexdigest()[:8]}"
    include = mla_cuda.constants.write_header(mla_cuda.header_dir(name))
    return load(name=name, sources=[os.path.join(folder, f) for f in mla_cuda.SOURCES],
                extra_cuda_cflags=[*mla_cuda.CUDA_FLAGS, *flags], extra_cflags=["-O3", *flags],
                extra_include_paths=[folder, include])


def variant_call(mod, schedule, q, inp, kv_scale, splits=None):
    """fn() -> (out, lse): build `mod` run as the op runs the production one (its default splits,
    split rule and merge), with `schedule` (None: pick_schedule's)."""
    batch, heads = inp.table.shape[0], q.shape[1]
    schedule, auto = mla_cuda.default_plan(inp.cache.dtype, batch, Q_ROWS, heads, 0, schedule)
    splits = splits or auto
    spread = mla_cuda.wave_splits(batch, Q_ROWS, heads, splits, mla_cuda.sm_count(0), schedule)
    out = torch.empty(batch * Q_ROWS, heads, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch * Q_ROWS, heads, dtype=torch.float32, device=q.device)

    def fn():
        mla_cuda.launch(mod, q, inp.cache, inp.table, inp.seq_lens, Q_ROWS, 192 ** -0.5, kv_scale,
                        out, lse, schedule, splits, spread, mla_cuda.MIN_SPLIT_BLOCKS,
                        mla_cuda.FULL_SPLIT_BLOCKS)
        return out, lse
    return fn


def ab_cell(variants, inp, heads, kv, ceil, resident):
    """One cell of --ab: µs of every variant (B: the production build) and each one's error."""
    batch, ctx = inp.table.shape[0], inp.seq_lens[0].item()
    kv_scale = 0.25 if kv == "fp8" else 1.0
    q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16)
    n = min(2, batch)
    ref, _ = mla_verify_ref(q[:n * Q_ROWS], inp.cache, inp.table[:n], inp.seq_lens[:n], Q_ROWS,
                            192 ** -0.5, kv_scale, D_V)
    calls, errs = {}, {}
    for label, (mod, schedule) in variants.items():
        calls[label] = variant_call(mod, schedule, q, inp, kv_scale)
        out, lse = calls[label]()
        bad = bool(torch.isnan(out).any() or torch.isnan(lse).any())
        err = rel_norm_error(out[:n * Q_ROWS].float(), ref.float())
        errs[label] = "NaN" if bad else float(f"{err:.3g}")
    us = interleaved_graph_us(calls)
    nbytes = batch * ctx * D_QK * inp.cache.element_size()
    t_mem = 0.0 if resident else nbytes / ceil["copy_gbps"] / 1e3
    roof = max(t_mem, 2 * Q_ROWS * heads * batch * ctx * (D_QK + D_V) / ceil["gemm_tflops"] / 1e6)
    return dict(kv=kv, heads=heads, batch=batch, ctx=ctx,
                us={k: round(v, 2) for k, v in us.items()},
                b_fraction=round(roof / us["B"], 3),
                over_b={k: round(us[k] / us["B"], 3) for k in us if k != "B"}, errors=errs)


def kernel_us(fn, calls: int = 20) -> dict:
    """Mean device µs per call of each kernel fn launches (verify, merge), from CUPTI records. The
    merge is a programmatic dependent launch whose CTAs start at once and wait for the verify grid,
    so its device time spans the verify kernel's: graph minus verify is what the merge adds."""
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
            name = ("merge" if "merge" in e.key
                    else "verify" if "mla_verify" in e.key else e.key[:40])
            tot[name] = tot.get(name, 0.0) + us / calls
    return tot


# the pair kernel's timeline slots (pair.cu): clock64 at entry 1, barriers ready 2, Q loaded 3,
# first score tile 4, WG0 loop end 5, WG1 loop end 6, epilogue end 7, inside the epilogue 10, 11
PHASES = [("setup", 1, 2), ("q_load", 2, 3), ("first_tile", 3, 4), ("wg0_loop", 4, 5),
          ("wg1_loop", 3, 6), ("epilogue", 5, 7), ("epi_sums", 5, 10), ("epi_stage", 10, 11),
          ("epi_store", 11, 7)]


def timeline_summary(mod, fn, ctas: int) -> dict:
    """One launch of the timeline build: per-CTA phase times (µs: median, p90, max; clock64 at the
    SM clock implied by globaltimer), the spread of CTA start and end times, and the kernel span,
    over the CTAs that read blocks."""
    mod.timeline(ctas)  # reading zeroes the stamps: only this launch's remain
    fn()
    torch.cuda.synchronize()
    t = mod.timeline(ctas).double()
    t = t[t[:, 8] > 0]  # CTAs with no blocks of their own exit before the stamps
    g0, g1 = t[:, 0], t[:, 8]
    ghz = statistics.median(((t[:, 7] - t[:, 1]) / (g1 - g0).clamp(min=1)).tolist())
    q = lambda x: [round(float(torch.quantile(x, p)), 2) for p in (0.5, 0.9, 1.0)]  # noqa: E731
    out = {name: q((t[:, b] - t[:, a]) / ghz / 1e3) for name, a, b in PHASES}
    out.update(start_skew=q((g0 - g0.min()) / 1e3), end_skew=q((g1.max() - g1) / 1e3),
               cta_span=q((g1 - g0) / 1e3), kernel_span=round(float(g1.max() - g0.min()) / 1e3, 2),
               sm_ghz=round(ghz, 3), ctas_timed=len(t))
    return out


def breakdown_cell(inp, heads, kv, ceil, timeline_mod):
    """One cell of --breakdown: device µs of the verify and merge kernels, the graph time, the KV
    read time at the copy rate; with a timeline build, the pair kernel's phase times."""
    batch, ctx = inp.table.shape[0], inp.seq_lens[0].item()
    kv_scale = 0.25 if kv == "fp8" else 1.0
    q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16)
    fn = variant_call(mla_cuda.load_extension(), None, q, inp, kv_scale)
    k = kernel_us(fn)
    row = dict(kv=kv, heads=heads, batch=batch, ctx=ctx, verify_us=round(k.get("verify", 0.0), 2),
               merge_us=round(k.get("merge", 0.0), 2), graph_us=round(graph_time_us(fn), 2),
               kv_at_copy_us=round(batch * ctx * D_QK * inp.cache.element_size()
                                   / ceil["copy_gbps"] / 1e3, 2))
    if timeline_mod is not None:
        splits = mla_cuda.default_splits(batch, Q_ROWS, heads, 0, "pair")
        ctas = mla_cuda.tiles(batch, Q_ROWS, heads, "pair") * splits
        row["pair_timeline"] = timeline_summary(
            timeline_mod, variant_call(timeline_mod, "pair", q, inp, kv_scale, splits), ctas)
    return row


def parse_ab(specs: list[str]) -> list[tuple[str, str, str | None]]:
    """--ab LABEL=DIR[:SCHEDULE] -> (label, folder, schedule or None)."""
    out = []
    for spec in specs:
        label, eq, rest = spec.partition("=")
        folder, _, schedule = rest.partition(":")
        if not eq or not label or not folder or label == "B":
            raise SystemExit(f"--ab {spec!r}: need LABEL=DIR[:SCHEDULE] (LABEL not B)")
        out.append((label, folder, schedule or None))
    return out
