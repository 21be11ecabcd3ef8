"""Benchmark k3trt::mla_verify's kernels at K3 shapes (576 / 512) against the roofline.

    PYTHONPATH=. python benchmarks/mla_verify.py --json out.json [--heads 12,48,96]
        [--batch 1,32,128] [--ctx 1024,8192,32768] [--kv bf16,fp8] [--configs cuda,n64w8s2]
    PYTHONPATH=. python benchmarks/mla_verify.py --ab base=/tmp/base[:pair] [--ab ...] ...
    PYTHONPATH=. python benchmarks/mla_verify.py --breakdown [--timeline] ...

Modes (the cells: --heads x --batch x --ctx, plus --extra; --resident N draws every page from N
that stay in L2, the kernel's own pace without HBM's):
- default: the table below.
- --ab LABEL=DIR[:SCHEDULE] (repeatable): the SM90 kernel built from DIR's sources (a baseline
  `git show`n from another commit into a folder, with the tree's file list and constants; "." is
  the tree) against the tree's production build (B), each checked against the fp32 reference and
  all timed interleaved (CUDA-graph replays round by round, so a lent GPU's drift moves them alike).
  SCHEDULE: the variant's kernel (default: pick_schedule's).
- --breakdown: device time of the verify and merge kernels per call (CUPTI records) beside the
  graph time; --timeline adds, for the pair kernel, per-CTA phase times from its timeline build.

Kernels (--configs): "cuda" = the SM90 CUDA kernel, which the op runs on the H200 (default), and
Triton configs by name.

Per case (local heads H, batch B, context L, KV dtype, kernel config): time per call from CUDA-graph
replays of 10 calls (as the FlashMLA anchor was measured), achieved GB/s (KV bytes, each token's
576 values read once) and TFLOP/s (2·4H·B·L·(576+512)), the roofline time (the larger of bytes
over the copy rate and flops over the GEMM rate, both measured in this run by harness.measure), and
their ratio. Baselines in the same run: the same work as four single-row decode passes of the
kernel, and a plain torch implementation (where its score matrix fits). Every case is checked
against the fp32 reference on its first request. Buffers are not rotated: small cases run from L2,
like the anchor's.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import itertools
import json
import math
import multiprocessing as mp
import sys
import time

import torch
from harness import command, measure
from mla_variants import D_QK, D_V, Q_ROWS, ab_cell, breakdown_cell, build_variant, graph_time_us, parse_ab

import k3trt.plugins.mla_verify  # noqa: F401  (registers torch.ops.k3trt.mla_verify)
from k3trt.plugins import mla_cuda
from k3trt.plugins.mla_verify import gather_pages, mla_verify_ref
from k3trt.plugins.plans import KernelConfig, kernel_config
from k3trt.plugins.plans import make_plan as mk
from k3trt.testing import rel_norm_error

PAGE = 64
FP8 = torch.float8_e4m3fn
# FlashMLA SM90 dense decode, bf16 KV, 4 causal rows, this H200 (shared/anchors/flashmla_h200.md)
FLASHMLA_US = {
    (12, 1, 1024): 13.1, (12, 1, 8192): 26.2, (12, 1, 32768): 46.1, (12, 32, 1024): 22.7,
    (12, 32, 8192): 86.0, (12, 32, 32768): 310.0, (12, 128, 1024): 45.8, (12, 128, 8192): 296.4,
    (12, 128, 32768): 1236.9, (48, 1, 1024): 18.6, (48, 1, 8192): 26.5, (48, 1, 32768): 46.3,
    (48, 32, 1024): 32.5, (48, 32, 8192): 188.3, (48, 32, 32768): 739.2, (48, 128, 1024): 127.7,
    (48, 128, 8192): 761.9, (48, 128, 32768): 3085.9, (96, 1, 1024): 22.3, (96, 1, 8192): 32.3,
    (96, 1, 32768): 66.3, (96, 32, 1024): 60.0, (96, 32, 8192): 365.5, (96, 32, 32768): 1445.6,
    (96, 128, 1024): 209.8, (96, 128, 8192): 1493.8, (96, 128, 32768): 5981.3}


def flashmla_us(heads: int, batch: int, ctx: int, device: str) -> float | None:
    """FlashMLA's time for a cell, only on an H200: the anchors are H200 times, and a ratio on any
    other card would compare two devices."""
    return FLASHMLA_US.get((heads, batch, ctx)) if "H200" in device else None


def check_resident(pages: int) -> None:
    """--resident N: 0 for the real cache, else a page count."""
    if pages < 0:
        raise SystemExit(f"--resident: {pages} pages (need 0 for the real cache, or > 0)")


def parse_cells(text: str, flag: str, sep: str = ",") -> list[tuple[int, int, int]]:
    """heads:batch:ctx cells separated by sep; a malformed one is named with its flag."""
    cells = []
    for cell in (c for c in text.split(sep) if c):
        parts = cell.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"{flag}: cell {cell!r} is not heads:batch:ctx (three positive integers)")
        cells.append(tuple(int(p) for p in parts))
    return cells


def parse_config(spec: str, rows: int):
    """'n64w4s2d2' (BLOCK_N 64, 4 warps, 2 stages, d_v split over 2 programs; 'd' optional)
    → KernelConfig for `rows` folded rows."""
    body, _, dvs = spec.partition("d")
    n, rest = body[1:].split("w")
    w, s = rest.split("s")
    return KernelConfig(kernel_config(rows, D_V).block_m, int(n), int(w), int(s), int(dvs or 1))


def make_plan(batch, q_rows, heads, spec, kv_fp8, splits=None):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return mk(batch, q_rows, heads, D_QK, D_V, kv_fp8=kv_fp8, num_sms=sms,
              config=parse_config(spec, q_rows * heads), num_splits=splits)


def _warm_one(key):
    """Compile one kernel specialisation in a worker (fills the shared Triton cache)."""
    from k3trt.plugins import mla_triton  # noqa: PLC0415 (optional: triton)

    spec, kv, q_rows, heads, split = key
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    q = torch.randn(2 * q_rows, heads, D_QK, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(4, PAGE, D_QK, device="cuda").to(kv_dtype)
    table = torch.arange(4, device="cuda", dtype=torch.int32).view(2, 2)
    lens = torch.tensor([100, 7], device="cuda", dtype=torch.int32)
    plan = make_plan(2, q_rows, heads, spec, kv == "fp8", splits=2 if split else 1)
    mla_triton.mla_verify_fwd(plan, q, cache, table, lens, q_rows, 0.1, 1.0, D_V)
    torch.cuda.synchronize()
    return key


def precompile(keys, workers):
    t = time.time()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        list(pool.map(_warm_one, sorted(keys)))
    print(f"precompiled {len(keys)} kernels in {time.time() - t:.1f}s", flush=True)


def torch_verify(q, cache, table, seq_lens, q_rows, scale, kv_scale):
    """Plain torch: gather every page of the table, bf16 matmuls, fp32 softmax."""
    batch = table.shape[0]
    kv = gather_pages(cache, table.long()).reshape(batch, -1, D_QK).to(q.dtype)
    if cache.dtype == FP8:
        kv = kv * kv_scale
    qb = q.view(batch, -1, D_QK)
    s = torch.bmm(qb, kv.transpose(1, 2)).float() * scale
    heads = q.shape[1]
    row = torch.arange(q_rows, device=q.device).repeat_interleave(heads)
    vis = seq_lens[:, None] - (q_rows - 1 - row)[None, :]
    pos = torch.arange(kv.shape[1], device=q.device)
    s = s.masked_fill(pos[None, None, :] >= vis[..., None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.bmm(torch.softmax(s, -1).to(q.dtype), kv[..., :D_V])
    return out.view(-1, heads, D_V), lse.view(-1, heads)


@dataclasses.dataclass
class Inputs:
    cache: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor


def make_cache(batch, ctx, kv, pages=None):
    """Random pages in a random order; with `pages`, every table entry is one of that many pages
    (a cache small enough to stay in L2: the kernel's pace without HBM's)."""
    per = math.ceil(ctx / PAGE)
    blocks = pages or batch * per + 1
    cache = torch.randn(blocks, PAGE, D_QK, device="cuda", dtype=torch.bfloat16)
    if kv == "fp8":
        cache = (cache * 4).to(FP8)
    if pages:
        table = torch.randint(0, pages, (batch, per), device="cuda", dtype=torch.int32)
    else:
        table = torch.randperm(blocks, device="cuda")[: batch * per].view(batch, per).int()
    return Inputs(cache, table, torch.full((batch,), ctx, device="cuda", dtype=torch.int32))


def kernel_call(spec, batch, q_rows, heads, kv_fp8):
    """(fn(q, cache, table, lens, scale, kv_scale) -> (out, lse), split count) of the kernel under
    test: "cuda" = the SM90 CUDA kernel as the op runs it on the H200 (its default splits, split
    rule and merge), else a Triton config name (parse_config) launched per its capacity plan."""
    if spec == "cuda":
        _, splits = mla_cuda.default_plan(mla_cuda.FP8 if kv_fp8 else torch.bfloat16, batch, q_rows,
                                          heads)
        return (lambda q, c, t, n, sc, ks: mla_cuda.mla_verify_cuda(q, c, t, n, q_rows, sc, ks, D_V,
                                                                    splits)), splits
    from k3trt.plugins import mla_triton  # noqa: PLC0415 (optional: triton)
    plan = make_plan(batch, q_rows, heads, spec, kv_fp8)
    return (lambda q, c, t, n, sc, ks: mla_triton.mla_verify_fwd(plan, q, c, t, n, q_rows, sc, ks,
                                                                 D_V)), plan.num_splits


def run_case(inp, heads, batch, ctx, kv, spec, ceil, baselines):
    kv_fp8 = kv == "fp8"
    scale, kv_scale = 192 ** -0.5, (0.25 if kv_fp8 else 1.0)
    q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16)
    fwd, splits = kernel_call(spec, batch, Q_ROWS, heads, kv_fp8)
    call = lambda: fwd(q, inp.cache, inp.table, inp.seq_lens, scale, kv_scale)  # noqa: E731
    out, lse = call()
    ref_out, _ = mla_verify_ref(q[:Q_ROWS], inp.cache, inp.table[:1], inp.seq_lens[:1], Q_ROWS,
                                scale, kv_scale, D_V)
    err = rel_norm_error(out[:Q_ROWS].float(), ref_out.float())
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    us = graph_time_us(call)
    nbytes = batch * ctx * D_QK * inp.cache.element_size()
    flops = 2 * Q_ROWS * heads * batch * ctx * (D_QK + D_V)
    t_mem, t_mma = nbytes / ceil["copy_gbps"] / 1e3, flops / ceil["gemm_tflops"] / 1e6
    roof = max(t_mem, t_mma)
    row = dict(heads=heads, batch=batch, ctx=ctx, kv=kv, config=spec, splits=splits,
               us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), tflops=round(flops / us / 1e6, 1),
               roofline_us=round(roof, 2), bound="memory" if t_mem >= t_mma else "compute",
               fraction=round(roof / us, 3), rel_err=float(f"{err:.3g}"), nan=nan)
    fm = flashmla_us(heads, batch, ctx, ceil["device"])
    if fm:
        row["flashmla_us"] = fm
        row["speedup_vs_flashmla"] = round(fm / us, 2)
    if baselines:
        qs = [q.view(batch, Q_ROWS, heads, D_QK)[:, j].contiguous() for j in range(Q_ROWS)]
        lens = [inp.seq_lens - (Q_ROWS - 1 - j) for j in range(Q_ROWS)]
        fwd1, _ = kernel_call(spec, batch, 1, heads, kv_fp8)

        def four():
            for j in range(Q_ROWS):
                fwd1(qs[j], inp.cache, inp.table, lens[j], scale, kv_scale)
        row["four_single_us"] = round(graph_time_us(four), 2)
        row["speedup_vs_four"] = round(row["four_single_us"] / us, 2)
        score_bytes = batch * Q_ROWS * heads * inp.table.shape[1] * PAGE * 4
        if score_bytes <= (2 << 30):
            t_out, _ = torch_verify(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS, scale, kv_scale)
            row["torch_rel_err"] = float(f"{rel_norm_error(out.float(), t_out.float()):.3g}")
            row["torch_us"] = round(graph_time_us(
                lambda: torch_verify(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS, scale, kv_scale),
                calls=3, reps=3), 1)
            row["speedup_vs_torch"] = round(row["torch_us"] / us, 2)
    return row


def print_table(rows, header=True):
    cols = ["heads", "batch", "ctx", "kv", "config", "splits", "us", "gbps", "tflops", "roofline_us",
            "bound", "fraction", "flashmla_us", "speedup_vs_flashmla", "four_single_us",
            "speedup_vs_four", "torch_us", "rel_err"]
    if header:
        print(" ".join(f"{c[:10]:>10}" for c in cols))
    for r in rows:
        print(" ".join(f"{str(r.get(c, '-'))[:10]:>10}" for c in cols))
    sys.stdout.flush()


def cells_by_cache(shapes, kvs, resident):
    """(kv, cache inputs, heads) for every cell, one cache per (kv, batch, ctx)."""
    for kv in kvs:
        for batch, ctx in sorted({(b, c) for _, b, c in shapes}):
            inp = make_cache(batch, ctx, kv, pages=resident or None)
            for heads in sorted({h for h, b, c in shapes if (b, c) == (batch, ctx)}):
                yield kv, inp, heads
            del inp
            torch.cuda.empty_cache()


def kernel_modes(args, shapes, kvs, ceil):
    """--ab or --breakdown: rows, printed as they come."""
    if args.ab:
        variants = {label: (mla_cuda.load_extension() if folder == "." else build_variant(folder),
                            schedule) for label, folder, schedule in parse_ab(args.ab)}
        variants["B"] = (mla_cuda.load_extension(), None)
    timeline = build_variant(mla_cuda.SOURCE_DIR, timeline=True) if args.timeline else None
    rows = []
    for kv, inp, heads in cells_by_cache(shapes, kvs, args.resident):
        if args.ab:
            rows.append(ab_cell(variants, inp, heads, kv, ceil, args.resident))
        else:
            rows.append(breakdown_cell(inp, heads, kv, ceil, timeline))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--heads", type=ints, default=[12, 48, 96])
    ap.add_argument("--batch", type=ints, default=[1, 32, 128])
    ap.add_argument("--ctx", type=ints, default=[1024, 8192, 32768])
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--configs", default="cuda",
                    help="kernels to time: cuda (the SM90 kernel the op runs on the H200) and/or "
                         "Triton configs such as n64w8s2 (BLOCK_N 64, 8 warps, 2 stages)")
    ap.add_argument("--extra", default="", help="extra cases H:B:L;… beyond the grid")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--resident", type=int, default=0,
                    help="draw every page from this many (e.g. 256: 9 MB of fp8, inside L2), so "
                         "HBM does not bound the kernel")
    ap.add_argument("--ab", action="append", default=[],
                    help="LABEL=DIR[:SCHEDULE]: the SM90 kernel built from DIR against the tree's "
                         "(repeatable; DIR . is the tree)")
    ap.add_argument("--breakdown", action="store_true",
                    help="device time of the verify and merge kernels beside the graph time")
    ap.add_argument("--timeline", action="store_true",
                    help="with --breakdown: the pair kernel's per-CTA phase times")
    ap.add_argument("--json", default="mla_verify_h200.json")
    args = ap.parse_args(argv)
    check_resident(args.resident)
    parse_ab(args.ab)  # (before any build: a malformed spec fails at once)
    if args.timeline and not args.breakdown:
        ap.error("--timeline goes with --breakdown")

    kvs, specs = args.kv.split(","), args.configs.split(",")
    shapes = [(h, b, c) for b in args.batch for c in args.ctx for h in args.heads]
    shapes += parse_cells(args.extra, "--extra", sep=";")
    if args.ab or args.breakdown:
        ceil = measure()
        print(json.dumps(ceil), flush=True)
        rows = kernel_modes(args, shapes, kvs, ceil)
        with open(args.json, "w") as f:
            json.dump({"command": command(__file__, argv), "ceilings": ceil,
                       "resident": args.resident, "rows": rows}, f, indent=1)
        return
    keys = {}
    for s, kv, h, q, split in itertools.product([x for x in specs if x != "cuda"], kvs,
                                                {x[0] for x in shapes},
                                                (Q_ROWS,) if args.no_baselines else (Q_ROWS, 1),
                                                (False, True)):
        # one binary per tile shape: heads only matter through BLOCK_M
        keys[(s, kv, parse_config(s, q * h).block_m, split)] = (s, kv, q, h, split)
    if keys:
        precompile(list(keys.values()), args.workers)
    if "cuda" in specs:
        mla_cuda.load_extension()
    ceil = measure()
    print(json.dumps(ceil), flush=True)

    rows = []
    for kv, inp, heads in cells_by_cache(shapes, kvs, args.resident):
        batch, ctx = inp.table.shape[0], int(inp.seq_lens[0])
        for i, spec in enumerate(specs):
            rows.append(run_case(inp, heads, batch, ctx, kv, spec, ceil,
                                 baselines=not args.no_baselines and i == 0))
            print_table(rows[-1:], header=len(rows) == 1)
    print("\nsummary")
    print_table(rows)
    with open(args.json, "w") as f:
        json.dump({"command": command(__file__, argv), "ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
