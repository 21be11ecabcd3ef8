"""Where a verify step's time over a decode step goes, at batch 1: benchmarks/spec_speedup.py
--breakdown runs this on its model.

One GraphSession at capacity 1 with steps of 1 row (decode) and K+1 rows (verify) over a cache
filled by a prefill of `ctx` tokens. Three steps, each timed as its graph replays (CUDA events;
the CPU: the static step, host-timed) and profiled once uncaptured (torch.profiler), with the
kernel time gathered by the model part that launched it (``PARTS``: a table of module-name
patterns; what matches none is "other"):

  decode          1 row
  verify          K+1 rows, as the runtime runs them
  verify-same     K+1 rows, every row routed to the first row's experts (a measurement-only switch
                  over the routers: the step reads the experts a decode step reads; its output is
                  not the model's). verify - verify-same is the MoE expert-count effect, inherent
                  to verifying more rows; verify-same - decode is the rest, what a faster verify
                  step can remove.

Also the kernels whose time grows most from decode to verify, each with the part that launched it
(the profiler's CPU op above the kernel) and, where known, why it grows (``WHY``), each step
against its roofline (benchmarks/roofline.py, with the ceilings of the run), and issue 46's goal
(verify within 1.1x decode) with and without the expert-count effect.

The router's logits are an fp32 GEMM (moe.Router: x.float() @ weight.float().t()): at one row
cuBLAS runs a GEMV, at K+1 rows a SIMT sgemm with a split-K reduce, two kernels per MoE layer that
only a verify step pays. ``router_gemms`` times the candidates for it (each as a graph of one call
per MoE layer) at 1 and K+1 rows, with their largest difference from the runtime's logits and
whether a row's logits at K+1 rows equal its logits alone (a verify row then routes as its decode
step would): the evidence for changing moe.Router, which this benchmark leaves as it is.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict

import torch
from harness import best_s, median_ms, print_table
from roofline import Sizes, roofline

from k3trt.model.kda import KDA
from k3trt.model.moe import Router
from k3trt.runtime.engine import Seq, make_batch
from k3trt.runtime.graphs import GraphSession
from k3trt.runtime.kv_cache import plan_cache

BLOCK = 64

# module name pattern -> part (first match wins); the MTP layer is not in a target step
PARTS: list[tuple[str, str]] = [
    (r"model\.layers\.\d+\.self_attn", "attention"),          # split into kda / mla by type below
    (r"model\.layers\.\d+\.mlp\.gate", "moe router"),
    (r"model\.layers\.\d+\.mlp\.experts", "moe experts"),
    (r"model\.layers\.\d+\.mlp\.shared_experts", "moe shared experts"),
    (r"model\.layers\.\d+\.mlp\.routed_expert_(down_proj|up_proj|norm)", "moe latent proj + norm"),
    (r"model\.layers\.0\.mlp", "dense mlp (layer 0)"),
    (r"model\.embed_tokens", "embedding"),
    (r"model\.norm", "final norm"),
    (r"lm_head", "lm_head"),
]


# kernel name pattern -> why a verify step runs it more than a decode step (first match wins)
WHY: list[tuple[str, str]] = [
    (r"simt_sgemm|splitKreduce_kernel<32, 16, int, float, float", "fp32 GEMM (the router's logits, moe.Router): "
     "1 row is a GEMV, K+1 rows cuBLAS's SIMT sgemm + split-K reduce"),
    (r"_kda_slots_kernel|_short_conv_slots_kernel", "KDA / short-conv states saved at each of the K+1 positions "
     "(rejected drafts roll back to one)"),
    (r"_moe_gemm_kernel", "routed experts: K+1 rows touch more distinct experts"),
    (r"indexFuncSmallIndex", "index_add / index_copy over the step's rows"),
]


def why(kernel: str) -> str:
    return next((w for pattern, w in WHY if re.search(pattern, kernel)), "")


# the router-logit GEMMs router_gemms compares: (name, fn(x, w, w32)), the first as moe.Router runs it
ROUTER_GEMMS = [
    ("fp32 x @ w.T (moe.Router)", lambda x, w, w32: x.float() @ w.float().t()),
    ("fp32, weight kept in fp32", lambda x, w, w32: x.float() @ w32.t()),
    ("fp32 (w @ x.T).T", lambda x, w, w32: (w32 @ x.float().t()).t()),
    ("bf16 mm, fp32 out (CUDA)", lambda x, w, w32: torch.mm(x, w.t(), out_dtype=torch.float32)),
]


def router_gemms(model, q: int) -> list[dict]:
    routers = [m for m in model.modules() if isinstance(m, Router)]
    w, n = routers[0].weight.detach(), len(routers) - model.cfg.num_nextn_predict_layers   # a step's MoE layers
    w32, g = w.float(), torch.Generator(device=w.device).manual_seed(1)
    x = torch.randn(q, w.shape[1], generator=g, device=w.device).to(w.dtype)
    ref = ROUTER_GEMMS[0][1](x, w, w32)
    out = []
    for name, fn in ROUTER_GEMMS:
        row = {"gemm": name}
        try:
            with torch.inference_mode():
                y = fn(x, w, w32)
                alone = torch.cat([fn(x[i:i + 1], w, w32) for i in range(q)])
                row.update({"ms_1": _calls_ms(fn, x[:1], w, w32, n), f"ms_{q}": _calls_ms(fn, x, w, w32, n),
                            "max_diff": float((y - ref).abs().max()), "row_invariant": bool(torch.equal(y, alone))})
        except (RuntimeError, NotImplementedError, TypeError) as e:   # a variant this torch or device lacks
            row["error"] = str(e).splitlines()[0][:80]
        out.append(row)
    return out


def _calls_ms(fn, x, w, w32, n: int) -> float:
    """ms of n calls (one per MoE layer): a graph replay on CUDA, host time on the CPU."""
    if x.device.type != "cuda":
        return round(best_s(lambda: [fn(x, w, w32) for _ in range(n)], reps=3) * 1e3, 4)
    for _ in range(3):                  # cuBLAS picks and allocates before the capture
        fn(x, w, w32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn(x, w, w32)
    return round(median_ms(graph.replay, warmup=2, reps=20), 4)


def kernel_parts(events, names: set[str]) -> dict[str, str]:
    """Kernel name (first 60 characters) -> the part whose range holds the CPU op that launched it."""
    out: dict[str, str] = {}
    for e in events:
        for kernel in getattr(e, "kernels", None) or ():
            up = e
            while up is not None and up.name not in names:
                up = getattr(up, "cpu_parent", None)
            out.setdefault(kernel.name[:60], up.name if up is not None else "other")
    return out


def part_of(name: str, module: torch.nn.Module) -> str | None:
    for pattern, part in PARTS:
        if re.fullmatch(pattern, name):
            return ("kda" if isinstance(module, KDA) else "mla") if part == "attention" else part
    return None


@contextlib.contextmanager
def labelled(model: torch.nn.Module):
    """Every PARTS module's forward inside a profiler range named after its part."""
    handles, stack = [], []
    for name, mod in model.named_modules():
        part = part_of(name, mod)
        if part is None:
            continue

        def pre(_m, _a, part=part):
            rf = torch.autograd.profiler.record_function(part)
            rf.__enter__()
            stack.append(rf)

        def post(_m, _a, _o):
            stack.pop().__exit__(None, None, None)
        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def decode_row_experts(model: torch.nn.Module):
    """Measurement only: every row of a step routed to the first row's experts and weights (at
    batch 1, the decode row's). Restores the routers on exit."""
    routers = [m for m in model.modules() if isinstance(m, Router)]

    def first_row(forward):
        def route(x):
            ids, weights = forward(x)
            return ids[:1].expand_as(ids).contiguous(), weights[:1].expand_as(weights).contiguous()
        return route
    for r in routers:
        r.forward = first_row(r.forward)
    try:
        yield
    finally:
        for r in routers:
            del r.forward           # the class's forward again


class Bench:
    """The capacity-1 session, its two batches, and how to time and profile one step."""

    def __init__(self, model, q: int, ctx: int):
        cfg, p = model.cfg, next(model.parameters())
        self.model, self.q, self.device = model, q, p.device
        per = -(-(ctx + 2 * q) // BLOCK)
        plan = plan_cache(cfg, budget_bytes=4 << 30, block_size=BLOCK, max_live=1, max_model_len=ctx + 2 * q,
                          kv_dtype=p.dtype, state_dtype=p.dtype, max_q=q, num_blocks=per + 1)
        self.s = GraphSession(model, cfg, plan, device=p.device, dtype=p.dtype, kv_dtype=p.dtype, max_q=q,
                              capacities=(1,), q_values=(1, q), max_blocks=per)
        blocks = list(range(per))
        g = torch.Generator().manual_seed(0)
        toks = torch.randint(16, cfg.vocab_size - 16, (ctx + q,), generator=g).tolist()
        with torch.inference_mode():
            self.s.prefill(make_batch([Seq(toks[:ctx], 0, blocks, 0, 1)], BLOCK, capacity=ctx))
        self.batches = {1: make_batch([Seq(toks[ctx:ctx + 1], ctx, blocks, 0, 1)], BLOCK, capacity=1),
                        q: make_batch([Seq(toks[ctx:ctx + q], ctx, blocks, 0, q)], BLOCK, capacity=1,
                                      save_kda_states=True)}

    def recapture(self) -> None:
        """Capture the graphs again (after a switch changed what the model runs)."""
        if self.s.capture:
            self.s._capture_all()

    def time_ms(self, q: int) -> float:
        st = self.s.steps[(1, q)]
        with torch.inference_mode():
            for _ in range(3):                      # packs this batch into the step's buffers
                self.s.verify(self.batches[q])
            if st.graph is not None:
                return median_ms(st.graph.replay, warmup=2, reps=30)
            return best_s(lambda: self.s._run_static(st), reps=3) * 1e3

    def profile(self, q: int) -> dict:
        """Time per part and per kernel of one uncaptured step (ms; the CPU: host time per part)."""
        st = self.s.steps[(1, q)]
        cuda = self.device.type == "cuda"
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        graph, st.graph = st.graph, None
        try:
            for _ in range(2):          # the second: the first pays the profiler's own start-up
                with torch.inference_mode(), labelled(self.model), torch.profiler.profile(activities=acts) as prof:
                    self.s.verify(self.batches[q])
                    if cuda:
                        torch.cuda.synchronize()
        finally:
            st.graph = graph
        names = {part for _, part in PARTS} | {"kda", "mla"}
        parts: dict[str, float] = defaultdict(float)
        kernels: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CPU and e.name in names:
                parts[e.name] += (e.device_time_total if cuda else e.cpu_time_total) / 1e3
            elif cuda and e.device_type == torch.autograd.DeviceType.CUDA and e.name not in names:
                kernels[e.name[:60]] += e.device_time_total / 1e3
        total = sum(kernels.values()) if cuda else sum(parts.values())
        parts["other"] = max(0.0, total - sum(parts.values()))
        return {"total_ms": round(total, 4), "parts": {k: round(v, 4) for k, v in sorted(parts.items())},
                "kernels": {k: round(v, 4) for k, v in kernels.items()},
                "kernel_parts": kernel_parts(prof.events(), names) if cuda else {}}


def rooflines(model, q: int, ctx: int, ceil: dict) -> dict:
    """The roofline (roofline.py) of the decode and the verify step, and the verify step's with
    every row on the decode row's experts (its routed-expert bytes at top-k, not at the distinct
    experts its rows touch)."""
    p = next(model.parameters())
    sz = Sizes.of(model, p.dtype)
    kw = dict(seqs=1, ctx=ctx, copy_gbps=ceil["copy_gbps"], gemm_tflops=ceil["gemm_tflops"])
    dec, ver = roofline(sz, q=1, **kw), roofline(sz, q=q, save_states=True, **kw)
    extra = sz.moe_layers * (ver["experts_per_moe_layer"] - sz.top_k) * sz.expert_bytes
    same = max(ver["bytes_ms"] - extra / (ceil["copy_gbps"] * 1e9) * 1e3, ver["flops_ms"])
    return {"decode": dec["roofline_ms"], "verify": ver["roofline_ms"], "verify-same": round(same, 4),
            "experts_per_moe_layer": {"decode": dec["experts_per_moe_layer"], "verify": ver["experts_per_moe_layer"]}}


def run(model, k: int, device: torch.device, *, ctx: int = 256, top: int = 12, ceil: dict | None = None) -> dict:
    q = k + 1
    b = Bench(model, q, ctx)
    steps = {"decode": (b.time_ms(1), b.profile(1)), "verify": (b.time_ms(q), b.profile(q))}
    with decode_row_experts(model):
        b.recapture()
        steps["verify-same"] = (b.time_ms(q), b.profile(q))
    b.recapture()
    out = {"batch": 1, "spec_tokens": k, "rows": q, "ctx": ctx,
           "step_ms": {name: round(ms, 4) for name, (ms, _) in steps.items()},
           "profiled_ms": {name: p["total_ms"] for name, (_, p) in steps.items()}}
    dec, ver, same = (steps[n][0] for n in ("decode", "verify", "verify-same"))
    out["verify_vs_decode"] = round(ver / dec, 3)
    out["moe_expert_count_ms"] = round(ver - same, 4)
    out["rest_ms"] = round(same - dec, 4)
    out["verify_same_vs_decode"] = round(same / dec, 3)
    if ceil is not None:
        out["roofline_ms"] = roof = rooflines(model, q, ctx, ceil)
        out["vs_roofline"] = {n: round(ms / roof[n], 3) for n, (ms, _) in steps.items()}
    parts = sorted(set().union(*(p["parts"] for _, p in steps.values())))
    out["parts"] = [{"part": part, **{n: p["parts"].get(part, 0.0) for n, (_, p) in steps.items()}} for part in parts]
    for row in out["parts"]:
        row["extra"] = round(row["verify"] - row["decode"], 4)
        row["extra_same"] = round(row["verify-same"] - row["decode"], 4)
    kd, kv = steps["decode"][1]["kernels"], steps["verify"][1]["kernels"]
    grow = sorted(((n, kd.get(n, 0.0), kv.get(n, 0.0)) for n in set(kd) | set(kv)), key=lambda r: r[1] - r[2])
    where = {**steps["decode"][1]["kernel_parts"], **steps["verify"][1]["kernel_parts"]}
    out["kernels_grown"] = [{"kernel": n, "part": where.get(n, "?"), "decode": d, "verify": v, "extra": round(v - d, 4),
                             "why": why(n)} for n, d, v in grow[:top]]
    out["router_gemms"] = router_gemms(model, q)
    out["goal"] = {"ratio": out["verify_vs_decode"], "ratio_same_experts": out["verify_same_vs_decode"], "goal": 1.1,
                   "met": out["verify_vs_decode"] <= 1.1, "met_same_experts": out["verify_same_vs_decode"] <= 1.1}
    del b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def report(r: dict, ceil: dict | None) -> None:
    s = r["step_ms"]
    print_table(f"verify ({r['rows']} rows) vs decode at batch 1, ctx {r['ctx']}: steps {s['decode']:.3f} / "
                f"{s['verify']:.3f} / {s['verify-same']:.3f} ms (decode / verify / verify-same; ratio "
                f"{r['verify_vs_decode']}, same experts {r['verify_same_vs_decode']}): MoE expert count "
                f"{r['moe_expert_count_ms']:.3f} ms, the rest {r['rest_ms']:.3f} ms", ceil,
                [("part", "part", 24, ""), ("decode", "decode", 8, ".4f"), ("verify", "verify", 8, ".4f"),
                 ("same-exp", "verify-same", 8, ".4f"), ("extra", "extra", 8, ".4f"),
                 ("extra same", "extra_same", 10, ".4f")],
                sorted(r["parts"], key=lambda p: -p["extra"]),
                note="ms of kernel time per part in one uncaptured step (torch.profiler); steps: graph replays")
    if "roofline_ms" in r:
        roof, x = r["roofline_ms"], r["vs_roofline"]
        print(f"roofline (benchmarks/roofline.py): decode {roof['decode']:.3f} ms (x{x['decode']}), verify "
              f"{roof['verify']:.3f} ms (x{x['verify']}; {roof['experts_per_moe_layer']['verify']} experts per MoE "
              f"layer against {roof['experts_per_moe_layer']['decode']}), verify-same {roof['verify-same']:.3f} ms "
              f"(x{x['verify-same']})")
    if r["kernels_grown"]:
        print_table("kernels that grow most from decode to verify", None,
                    [("kernel", "kernel", 60, ""), ("part", "part", 22, ""), ("decode", "decode", 8, ".4f"),
                     ("verify", "verify", 8, ".4f"), ("extra", "extra", 8, ".4f")], r["kernels_grown"])
        for kr in r["kernels_grown"]:
            if kr["why"]:
                print(f"  {kr['kernel'][:40]}: {kr['why']}")
    print_table(f"router logits, one call per MoE layer, at 1 and {r['rows']} rows", None,
                [("gemm", "gemm", 28, ""), ("ms 1 row", "ms_1", 9, ".4f"), (f"ms {r['rows']} rows", f"ms_{r['rows']}", 10, ".4f"),
                 ("max diff", "max_diff", 9, ".2e"), ("row-invariant", "row_invariant", 13, ""), ("error", "error", 40, "")],
                r["router_gemms"], note="max diff: against moe.Router's logits; row-invariant: a row's logits at "
                "K+1 rows equal its logits alone")
    g = r["goal"]
    print(f"goal b1_K{r['spec_tokens']}_verify_within_1.1x_decode: {'met' if g['met'] else 'NOT met'} (ratio="
          f"{g['ratio']}, goal=1.1); without the MoE expert-count effect: "
          f"{'met' if g['met_same_experts'] else 'NOT met'} (ratio={g['ratio_same_experts']})")
