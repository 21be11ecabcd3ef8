"""One-shot H200 check of the SM90 CUDA MLA verification kernel (k3trt/plugins/mla_cuda) against
the reference and the existing Triton op.

    PYTHONPATH=. python benchmarks/mla_cuda_check.py --json $OUT/mla_cuda.json

Stages (each guarded; a failure is printed in full and the script goes on; the JSON is rewritten
after every stage, so partial results survive):
  1. JIT-compile the extension (prints compile time and ptxas's register / spill report); a
     compiler error is printed and the script exits non-zero (after timing Triton, if --triton-
     anyway).
  2. Smoke test in a child process (so a crash or hang of the new kernel cannot take the CUDA
     context of this process down): small shapes vs mla_verify_ref.
  3. Ceilings (copy GB/s, bf16 GEMM TFLOP/s) via benchmarks/ceilings.py.
  4. Timing of the Triton op (torch.ops.k3trt.mla_verify) and the CUDA kernel's variants
     (schedules x --split-rules), with CUDA-graph replays of 10 calls, all variants of
     a case interleaved round by round (interleaved_graph_us), at H=12, batch 32/128, context
     8K/32K by default, bf16 and fp8; each variant also checked against the fp32 reference on the
     case's first requests.
  5. Full correctness list (lengths not multiple of 64, zero length, batch 1/32, H=12/48, bf16/fp8,
     NaN-poisoned outputs and scratch, NaN in unused cache slots).
Prints a table: µs, GB/s, fraction of roofline for both kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import command  # noqa: E402

Q_ROWS, D_QK, D_V, PAGE = 4, 576, 512, 64
FP8 = torch.float8_e4m3fn


class Report(dict):
    """The run's JSON, rewritten to `path` after every stage (save), so partial results survive a
    crash or a device command's time limit."""

    def __init__(self, path: str | None, argv: list[str] | None):
        super().__init__(command=command(__file__, argv), stages={}, correctness=[], timing=[])
        self.path = path

    def save(self) -> None:
        if self.path:
            try:
                with open(self.path, "w") as f:
                    json.dump(self, f, indent=1, default=str)
            except Exception as e:  # noqa: BLE001
                print(f"(could not write {self.path}: {e})", flush=True)


def banner(msg):
    print(f"\n===== {msg} =====", flush=True)


# ------------------------------------------------------------------------------------------------
# inputs and comparison
# ------------------------------------------------------------------------------------------------
def make_inputs(lens, heads, kv, seed=0, q_rows=Q_ROWS):
    """Random q and a shuffled paged cache; every slot past a length, spare page and spare table
    entry holds NaN (fp8: 0x7F) so that any read of them shows."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv_dtype = FP8 if kv == "fp8" else torch.bfloat16
    batch = len(lens)
    q = torch.randn(batch * q_rows, heads, D_QK, generator=g).to(torch.bfloat16)
    per_req = [max(1, -(-n // PAGE)) for n in lens]
    num_blocks = sum(per_req) + 3
    if kv_dtype == FP8:
        cache = torch.full((num_blocks, PAGE, D_QK), 0x7F, dtype=torch.uint8)
    else:
        cache = torch.full((num_blocks, PAGE, D_QK), float("nan"), dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((batch, max(per_req) + 1), int(perm[-1]), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        ids = perm[used:used + per_req[b]]
        used += per_req[b]
        table[b, :len(ids)] = ids.int()
        vals = torch.randn(n, D_QK, generator=g) * (2.0 if kv_dtype == FP8 else 1.0)
        vals = vals.to(kv_dtype)
        if kv_dtype == FP8:
            vals = vals.view(torch.uint8)
        flat = cache[ids.long()].reshape(-1, D_QK)
        flat[:n] = vals
        cache[ids.long()] = flat.view(len(ids), PAGE, D_QK)
    if kv_dtype == FP8:
        cache = cache.view(FP8)
    return (q.cuda(), cache.cuda(), table.cuda(),
            torch.tensor(lens, dtype=torch.int32).cuda())


def compare(out, lse, ref_out, ref_lse, label, rows_per_req=None):
    """Dict of error figures; prints the worst (row, head) pairs when it fails."""
    o, r = out.float(), ref_out.float()
    nan_out = int(torch.isnan(o).sum())
    nan_lse = int(torch.isnan(lse).sum())
    finite = torch.isfinite(ref_lse)
    inf_match = bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)))
    o0 = torch.nan_to_num(o, nan=1e9)
    denom = r.norm().item()
    rel = (o0 - r).norm().item() / denom if denom > 0 else (o0 - r).norm().item()
    unseen_nonzero = int((o0[~finite] != 0).sum()) if (~finite).any() else 0
    lse_diff = float((lse[finite] - ref_lse[finite]).abs().max()) if finite.any() else 0.0
    if math.isnan(lse_diff):
        lse_diff = float("inf")
    ok = (nan_out == 0 and nan_lse == 0 and inf_match and rel < 1e-2 and lse_diff < 1e-2
          and unseen_nonzero == 0)
    res = dict(case=label, ok=ok, rel_err=float(f"{rel:.3g}"), lse_max_diff=float(f"{lse_diff:.3g}"),
               nan_out=nan_out, nan_lse=nan_lse, neginf_pattern_match=inf_match,
               unseen_rows_nonzero=unseen_nonzero)
    if not ok:
        per = ((o0 - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-6))  # [rows, heads]
        worst = torch.topk(per.flatten(), min(6, per.numel()))
        items = []
        for v, i in zip(worst.values.tolist(), worst.indices.tolist()):
            row, head = divmod(i, per.shape[1])
            items.append(dict(row=row, req=row // Q_ROWS,
                              head=head, rel=float(f"{v:.3g}"),
                              out=[round(x, 4) for x in o[row, head, :4].tolist()],
                              ref=[round(x, 4) for x in r[row, head, :4].tolist()],
                              lse=float(lse[row, head]), ref_lse=float(ref_lse[row, head])))
        res["worst"] = items
        bad_cols = ((o0 - r).abs() > 0.05 + 0.05 * r.abs()).float().sum(dim=(0, 1))
        res["bad_cols_first"] = bad_cols.nonzero().flatten()[:16].tolist()
        res["bad_cols_count"] = int((bad_cols > 0).sum())
        if not inf_match:
            mism = (torch.isneginf(lse) != torch.isneginf(ref_lse)).nonzero()[:6].tolist()
            res["neginf_mismatch_first"] = mism
    print(("  OK   " if ok else "  FAIL ") + json.dumps(res), flush=True)
    return res


def kernel_err():
    from k3trt.plugins import mla_cuda
    e = mla_cuda.kernel_error()
    if e:
        print(f"  KERNEL TIMEOUT: {e}", flush=True)
        mla_cuda.reset_kernel_error()
    return e


def correctness_cases(full: bool):
    base = [("lens0_1_63_65_700_2500 H12 bf16 s1", (0, 1, 63, 65, 700, 2500), 12, "bf16", 1),
            ("lens0_1_63_65_700_2500 H12 bf16 s5", (0, 1, 63, 65, 700, 2500), 12, "bf16", 5),
            ("lens0_1_63_65_700_2500 H12 fp8 s1", (0, 1, 63, 65, 700, 2500), 12, "fp8", 1),
            ("lens0_1_63_65_700_2500 H12 fp8 s5", (0, 1, 63, 65, 700, 2500), 12, "fp8", 5)]
    if not full:
        return base
    g = torch.Generator().manual_seed(7)
    lens32 = tuple(int(x) for x in torch.randint(1, 4000, (32,), generator=g))
    return base + [
        ("H48 (3 M tiles) bf16 default splits", (17, 300, 1500), 48, "bf16", None),
        ("H48 (3 M tiles) fp8 s3", (17, 300, 1500), 48, "fp8", 3),
        ("batch1 L20000 bf16 default splits", (20000,), 12, "bf16", None),
        ("batch1 L20000 fp8 default splits", (20000,), 12, "fp8", None),
        ("batch32 random lens bf16 default splits", lens32, 12, "bf16", None),
        ("batch32 random lens fp8 default splits", lens32, 12, "fp8", None),
        ("batch1 L1 bf16", (1,), 12, "bf16", None),
        ("batch2 L0,0 bf16 s4", (0, 0), 12, "bf16", 4),
        ("H16 (1 partial tile, 64 rows) bf16 s2", (129, 64), 16, "bf16", 2),
        ("H20 (2 tiles) bf16 s1", (3000, 2), 20, "bf16", 1),
    ]


def run_correctness(full: bool, schedules=("shared", "pair")):
    from k3trt.plugins import mla_cuda
    from k3trt.plugins.mla_verify import mla_verify_ref
    results = []
    cases = [(f"{label} [{sched}]", lens, heads, kv, splits, sched)
             for label, lens, heads, kv, splits in correctness_cases(full) for sched in schedules]
    for i, (label, lens, heads, kv, splits, sched) in enumerate(cases):
        try:
            q, cache, table, seq_lens = make_inputs(lens, heads, kv, seed=i)
            kv_scale = 0.5 if kv == "fp8" else 1.0
            scale = D_QK ** -0.5
            out = torch.full((q.shape[0], heads, D_V), float("nan"), dtype=q.dtype, device="cuda")
            lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
            mla_cuda.mla_verify_cuda(q, cache, table, seq_lens, Q_ROWS, scale, kv_scale, D_V,
                                     num_splits=splits, out=out, lse=lse, poison_scratch=True,
                                     schedule=sched)
            torch.cuda.synchronize()
            err = kernel_err()
            ref_out, ref_lse = mla_verify_ref(q, cache, table, seq_lens, Q_ROWS, scale, kv_scale,
                                              D_V)
            res = compare(out, lse, ref_out, ref_lse, label, rows_per_req=True)
            if err:
                res["ok"] = False
                res["kernel_timeout"] = err
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res = dict(case=label, ok=False, exception=repr(e)[:2000])
            print("  FAIL " + json.dumps(res), flush=True)
        results.append(res)
    return results


def smoke_child():
    """Entry of the child process: quick correctness, JSON on the last stdout line."""
    res = run_correctness(full=False)
    print("SMOKE_JSON " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
# --split-rules: how requests spread over the plan's splits (mla_cuda.MIN_SPLIT_BLOCKS): "auto" is
# the module's rule, "spread" spreads every request over up to all splits (two pages each, the
# rule before session 5's run 9), "m<N>" the module's rule with N pages per split at least
SPLIT_RULES = {"auto": {}, "spread": dict(max_spread=1 << 20, full_split_blocks=1 << 20)}


def split_rule(name: str) -> dict:
    if name in SPLIT_RULES:
        return SPLIT_RULES[name]
    if name.startswith("m") and name[1:].isdigit():
        return dict(min_split_blocks=int(name[1:]))
    raise SystemExit(f"--split-rules: {name!r} is not one of {sorted(SPLIT_RULES)} or m<N>")


def kernel_label(kernel, schedule, rule):
    """cuda-<schedule>, with -<rule> where the split rule is not the module's."""
    if kernel != "cuda":
        return kernel
    return f"cuda-{schedule}" + ("" if rule in (None, "auto") else f"-{rule}")


def interleaved_graph_us(calls: dict, per_graph: int = 10, rounds: int = 9) -> dict:
    """Median µs per call of each fn in `calls`, each captured in a CUDA graph of `per_graph` calls
    and replayed in rounds (A B C, A B C, ...), so that a lent GPU's clock drifting during the run
    moves every variant alike (timing the variants one after another moved them by up to 15%)."""
    import statistics

    from mla_verify import capture_graph, replay_us
    graphs = {label: capture_graph(fn, per_graph) for label, fn in calls.items()}
    torch.cuda.synchronize()
    times = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, g in graphs.items():
            times[label].append(replay_us(g, per_graph))
    return {label: statistics.median(t) for label, t in times.items()}


def time_cases(variants, cases, ceil, report):
    """variants: (kernel, schedule, split rule name) tuples, kernel "cuda" or "triton"; all
    variants of a case are checked against the reference, then timed interleaved."""
    from mla_verify import flashmla_us, make_cache

    from k3trt.plugins.mla_verify import mla_verify_ref
    rows = []
    for kv in ("bf16", "fp8"):
        for heads, batch, ctx in cases:
            try:
                inp = make_cache(batch, ctx, kv)
            except Exception as e:  # noqa: BLE001
                print(f"  make_cache {batch}x{ctx} {kv} failed: {e!r}", flush=True)
                continue
            kv_fp8 = kv == "fp8"
            scale, kv_scale = 192 ** -0.5, (0.25 if kv_fp8 else 1.0)
            q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16)
            nchk = 2
            ref_out, ref_lse = mla_verify_ref(q[:nchk * Q_ROWS], inp.cache, inp.table[:nchk],
                                              inp.seq_lens[:nchk], Q_ROWS, scale, kv_scale, D_V)
            case_rows, calls = {}, {}
            for kernel, schedule, rule in variants:
                label = kernel_label(kernel, schedule, rule)
                row = dict(kernel=label, heads=heads, batch=batch, ctx=ctx, kv=kv)
                try:
                    call = cuda_call(row, q, inp, scale, kv_scale, schedule, rule) \
                        if kernel == "cuda" else triton_call(q, inp, scale, kv_scale)
                    out, lse = call()
                    torch.cuda.synchronize()
                    if kernel == "cuda" and kernel_err():
                        row["kernel_timeout"] = True
                    c = compare(out[:nchk * Q_ROWS], lse[:nchk * Q_ROWS], ref_out, ref_lse,
                                f"{label} {kv} B{batch} L{ctx}")
                    row["rel_err"], row["check_ok"] = c["rel_err"], c["ok"]
                    row["nan"] = bool(torch.isnan(out).any() or torch.isnan(lse).any())
                    calls[label] = call
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    row["exception"] = repr(e)[:2000]
                case_rows[label] = row
            try:
                us_by = interleaved_graph_us(calls)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                us_by = {}
                for row in case_rows.values():
                    row.setdefault("exception", repr(e)[:2000])
            nbytes = batch * ctx * D_QK * inp.cache.element_size()
            flops = 2 * Q_ROWS * heads * batch * ctx * (D_QK + D_V)
            t_mem = nbytes / ceil["copy_gbps"] / 1e3
            t_mma = flops / ceil["gemm_tflops"] / 1e6
            roof = max(t_mem, t_mma)
            for label, row in case_rows.items():
                if label in us_by:
                    us = us_by[label]
                    if row["kernel"].startswith("cuda") and kernel_err():
                        row["kernel_timeout"] = True
                    row.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                               roofline_us=round(roof, 2), fraction=round(roof / us, 3),
                               bound="memory" if t_mem >= t_mma else "compute")
                fm = flashmla_us(heads, batch, ctx, ceil["device"])
                if fm and kv == "bf16":
                    row["flashmla_us"] = fm
                print("  " + json.dumps(row), flush=True)
                rows.append(row)
                report["timing"].append(row)
            report.save()
            inp = calls = None  # noqa: F841  (free the cache and graphs before the next case)
            torch.cuda.empty_cache()
    return rows


def cuda_call(row, q, inp, scale, kv_scale, schedule, rule):
    from k3trt.plugins import mla_cuda
    batch, heads = inp.table.shape[0], q.shape[1]
    schedule, splits = mla_cuda.default_plan(inp.cache.dtype, batch, Q_ROWS, heads, 0, schedule)
    row["splits"] = splits
    launch = split_rule(rule or "auto")
    return lambda: mla_cuda.mla_verify_cuda(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS, scale,
                                            kv_scale, D_V, splits, schedule=schedule, **launch)


def triton_call(q, inp, scale, kv_scale):
    import k3trt.plugins.mla_verify  # noqa: F401
    os.environ["K3TRT_MLA_KERNEL"] = "triton"    # the op would pick the CUDA kernel
    return lambda: torch.ops.k3trt.mla_verify(q, inp.cache, inp.table, inp.seq_lens, Q_ROWS, scale,
                                              kv_scale, D_V)


def print_table(rows):
    """One line per case: µs and fraction of the roofline for each kernel that ran it."""
    kernels = sorted({r["kernel"] for r in rows}, key=lambda k: (k != "triton", k))
    by = {}
    for r in rows:
        by.setdefault((r["kv"], r["heads"], r["batch"], r["ctx"]), {})[r["kernel"]] = r
    head = ["kv", "heads", "batch", "ctx"] + [f"{k}_{c}" for k in kernels for c in ("us", "frac")] \
        + ["flashmla_us", "worst_err"]
    print(" ".join(f"{c:>13}" for c in head))
    for (kv, heads, batch, ctx), d in sorted(by.items()):
        vals = [kv, heads, batch, ctx]
        for k in kernels:
            r = d.get(k, {})
            vals += [r.get("us", "-"), r.get("fraction", "-")]
        fm = next((r["flashmla_us"] for r in d.values() if "flashmla_us" in r), "-")
        errs = [r["rel_err"] for r in d.values() if "rel_err" in r]
        vals += [fm, max(errs) if errs else "-"]
        print(" ".join(f"{str(v)[:13]:>13}" for v in vals))
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="mla_cuda.json")
    ap.add_argument("--smoke-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", default="32,128")
    ap.add_argument("--heads", default="12", help="comma list of local head counts (12 = TP8, 96 = TP1)")
    ap.add_argument("--ctx", default="8192,32768")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--schedules", default="shared,pair",
                    help="CUDA kernel schedules to time and check (mla_cuda.SCHEDULES)")
    ap.add_argument("--split-rules", default="auto",
                    help="comma list of split rules to time: auto (the module's), spread, m<N>")
    ap.add_argument("--verbose-build", action="store_true")
    args = ap.parse_args(argv)
    rules = [x for x in args.split_rules.split(",") if x]
    for r in rules:
        split_rule(r)  # a bad name stops here, before the build
    if args.smoke_child:
        smoke_child()
        return 0
    report = Report(args.json, argv)
    t_start = time.time()
    props = torch.cuda.get_device_properties(0)
    report["device"] = dict(name=props.name, sms=props.multi_processor_count,
                            capability=torch.cuda.get_device_capability(0),
                            torch=torch.__version__, cuda=torch.version.cuda)
    print(json.dumps(report["device"]), flush=True)

    # Triton's kernels for the timed cases compile in worker processes meanwhile (its cache is
    # shared on disk), so that the two compilers overlap
    pool = fut = None
    if not args.no_triton:
        try:
            import concurrent.futures as cf
            import multiprocessing as mp

            from mla_verify import _warm_one
            keys = [("n64w8s2", kv, Q_ROWS, 12, split) for kv in ("bf16", "fp8")
                    for split in (False, True)]
            pool = cf.ProcessPoolExecutor(len(keys), mp_context=mp.get_context("spawn"))
            fut = [pool.submit(_warm_one, k) for k in keys]
        except Exception as e:  # noqa: BLE001
            print(f"(triton precompile not started: {e!r})", flush=True)

    # 1. compile
    banner("1. JIT compile")
    compiled = False
    t0 = time.time()
    try:
        from k3trt.plugins import mla_cuda
        mla_cuda.load_extension(verbose=True)
        compiled = True
        report["stages"]["compile"] = dict(ok=True, seconds=round(time.time() - t0, 1))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        msg = str(e)
        print("COMPILER ERROR:\n" + msg[-20000:], flush=True)
        report["stages"]["compile"] = dict(ok=False, seconds=round(time.time() - t0, 1),
                                           error=msg[-20000:])
    print(f"compile: {'ok' if compiled else 'FAILED'} in {time.time() - t0:.1f}s", flush=True)
    report.save()

    # 2. smoke test in a child process
    smoke_ok = False
    if compiled:
        banner("2. smoke test (child process)")
        t0 = time.time()
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                [os.getcwd(), os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--smoke-child"],
                                  capture_output=True, text=True, timeout=150, env=env)
            print(proc.stdout[-15000:], flush=True)
            if proc.returncode != 0:
                print(f"smoke child exit code {proc.returncode}; stderr:\n{proc.stderr[-8000:]}",
                      flush=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("SMOKE_JSON ")]
            res = json.loads(line[-1][len("SMOKE_JSON "):]) if line else []
            smoke_ok = bool(res) and all(r.get("ok") for r in res)
            report["stages"]["smoke"] = dict(ok=smoke_ok, rc=proc.returncode, cases=res,
                                             stderr_tail=proc.stderr[-3000:],
                                             seconds=round(time.time() - t0, 1))
        except subprocess.TimeoutExpired as e:
            print(f"smoke child TIMED OUT after {e.timeout}s; stdout tail:\n"
                  f"{(e.stdout or b'')[-5000:]!r}", flush=True)
            report["stages"]["smoke"] = dict(ok=False, timeout=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            report["stages"]["smoke"] = dict(ok=False, exception=repr(e))
        print(f"smoke: {'ok' if smoke_ok else 'FAILED'} in {time.time() - t0:.1f}s", flush=True)
        report.save()
    # the kernel runs in this process only if it ran cleanly in the child (no crash / hang);
    # with wrong numbers it still runs, to time it (the table shows the error)
    smoke_ran = compiled and report["stages"].get("smoke", {}).get("rc") == 0

    if fut:
        t0 = time.time()
        for f in fut:
            try:
                f.result(timeout=240)
            except Exception as e:  # noqa: BLE001
                print(f"(triton precompile of a case failed: {e!r})", flush=True)
        pool.shutdown()
        print(f"triton precompile: waited {time.time() - t0:.1f}s more", flush=True)

    # 3. ceilings
    banner("3. ceilings")
    try:
        from harness import measure
        ceil = measure()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        ceil = {"copy_gbps": 4250.0, "gemm_tflops": 780.0, "assumed": True, "error": repr(e)}
    report["ceilings"] = ceil
    print(json.dumps(ceil), flush=True)
    report.save()

    # 4. timing
    cases = [(h, b, c) for h in (int(x) for x in args.heads.split(","))
             for b in (int(x) for x in args.batch.split(","))
             for c in (int(x) for x in args.ctx.split(","))]
    rows = []
    variants = [] if args.no_triton else [("triton", None, None)]
    if smoke_ran:
        variants += [("cuda", sched, r) for sched in args.schedules.split(",") for r in rules]
    else:
        print("\n(skipping CUDA kernel timing: it did not compile or its smoke run crashed)")
    banner(f"4. timing, interleaved: {[kernel_label(*v) for v in variants]}")
    t0 = time.time()
    rows = time_cases(variants, cases, ceil, report)
    print(f"timing: {time.time() - t0:.1f}s", flush=True)
    banner("summary table (4 rows/request, µs per call, fraction of the roofline)")
    print_table(rows)
    report.save()

    # 5. full correctness
    if smoke_ran:
        banner("5. full correctness vs mla_verify_ref")
        t0 = time.time()
        report["correctness"] = run_correctness(full=True, schedules=args.schedules.split(","))
        n_ok = sum(r.get("ok", False) for r in report["correctness"])
        print(f"correctness: {n_ok}/{len(report['correctness'])} ok in {time.time() - t0:.1f}s",
              flush=True)
        report.save()
    print(f"\ntotal {time.time() - t_start:.1f}s", flush=True)
    report.save()
    all_ok = compiled and smoke_ok and all(r.get("ok") for r in report["correctness"])
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
