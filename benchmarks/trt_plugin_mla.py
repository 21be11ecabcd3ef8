"""MlaVerify through the TensorRT plugin (the C++ library driven by the harness: enqueue on device
buffers, no TensorRT) against the torch op's own launch (torch.ops.k3trt.mla_verify, the SM90
CUDA kernel), at K3's MLA shapes: 576 / 512, page 64, K+1 = 4 rows per request.

    PYTHONPATH=. python benchmarks/trt_plugin_mla.py [--heads 12,96] [--batch 1,8,32,128]
        [--ctx 1024,8192] [--kv bf16,fp8] [--json benchmarks/results/trt_plugin_mla_h100.json]

Per cell (local heads H, batch B, context L, KV dtype): µs per call of each path from CUDA-graph
replays of 10 calls, replayed round-robin (plugin, op, op again) so that clock drift moves all
alike; "op again" is a second graph of the same op call, whose ratio to the first is the noise
floor the plugin's ratio is judged against. The roofline time (KV bytes over the copy rate, flops
over the GEMM rate, the larger; both measured in this run) and each path's ratio to it. Each cell
first checks the plugin's output against the op's (bitwise: the same kernels and plan) and against
the fp32 reference on the first request. A last row group times the plugin's mma.sync kernel
(SM120's; K3TRT_MLA_KERNEL=mma) on the same call, also checked against the reference. Needs an SM90 GPU (the plugin's SM90 path); the library
is built for sm_90a on first use (K3TRT_TRT_INCLUDE: TensorRT's headers).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch
from harness import machine, measure, print_table, record, write_json
from mla_variants import interleaved_graph_us

import k3trt.plugins.mla_verify  # noqa: F401  (registers torch.ops.k3trt.mla_verify)
from k3trt.plugins.mla_verify_ref import mla_verify_ref
from k3trt.testing import rel_norm_error
from k3trt.trt_plugin.harness import PluginHarness

D_QK, D_V, PAGE, Q_ROWS = 576, 512, 64, 4
FP8 = torch.float8_e4m3fn
RESULTS = Path(__file__).resolve().parent / "results" / "trt_plugin_mla.json"


def make_inputs(heads: int, batch: int, ctx: int, kv: str, gen: torch.Generator):
    per = -(-ctx // PAGE)
    blocks = batch * per + 1
    cache = torch.randn(blocks, PAGE, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    if kv == "fp8":
        cache = (cache * 4).to(FP8)
    table = torch.randperm(blocks, device="cuda", generator=gen)[: batch * per].view(batch, per).int()
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch * Q_ROWS, heads, D_QK, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, cache, table, lens


@contextlib.contextmanager
def mla_kernel(name: str):
    """K3TRT_MLA_KERNEL for the plugins created inside (the plugin reads it when created)."""
    before = os.environ.get("K3TRT_MLA_KERNEL")
    os.environ["K3TRT_MLA_KERNEL"] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ["K3TRT_MLA_KERNEL"]
        else:
            os.environ["K3TRT_MLA_KERNEL"] = before


def run_cell(h: PluginHarness, heads: int, batch: int, ctx: int, kv: str, ceil: dict) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 131 + ctx + heads)
    q, cache, table, lens = make_inputs(heads, batch, ctx, kv, gen)
    scale, kv_scale = 192 ** -0.5, (0.25 if kv == "fp8" else 1.0)
    attrs = {"q_per_req": Q_ROWS, "softmax_scale": scale, "kv_scale": kv_scale, "d_v": D_V}

    def op():
        return torch.ops.k3trt.mla_verify(q, cache, table, lens, Q_ROWS, scale, kv_scale, D_V)

    inputs = [q, cache, table, lens]
    with mla_kernel("sm90"):
        call = h.prepare("MlaVerify", inputs, attrs)
    with mla_kernel("mma"):
        mma = h.prepare("MlaVerify", inputs, attrs)
    with call, mma:
        call.enqueue()
        mma.enqueue()
        torch.cuda.synchronize()
        out, lse = call.outputs
        own_out, own_lse = op()
        same = bool(torch.equal(out, own_out) and torch.equal(lse, own_lse))
        ref, _ = mla_verify_ref(q[:Q_ROWS], cache, table[:1], lens[:1], Q_ROWS, scale, kv_scale, D_V)
        err = rel_norm_error(out[:Q_ROWS].float(), ref.float())
        mma_err = rel_norm_error(mma.outputs[0][:Q_ROWS].float(), ref.float())
        us = interleaved_graph_us({"plugin": call.enqueue, "op": op, "op_again": op, "mma": mma.enqueue})
    nbytes = batch * ctx * D_QK * cache.element_size()
    flops = 2 * Q_ROWS * heads * batch * ctx * (D_QK + D_V)
    roof = max(nbytes / ceil["copy_gbps"] / 1e3, flops / ceil["gemm_tflops"] / 1e6)
    return dict(heads=heads, batch=batch, ctx=ctx, kv=kv, plugin_us=round(us["plugin"], 2), op_us=round(us["op"], 2),
                op_again_us=round(us["op_again"], 2), mma_us=round(us["mma"], 2), roofline_us=round(roof, 2),
                bitwise_op=same, rel_err=float(f"{err:.3g}"), mma_rel_err=float(f"{mma_err:.3g}"))


COLUMNS = [("H", "heads", 4, "d"), ("B", "batch", 5, "d"), ("ctx", "ctx", 6, "d"), ("kv", "kv", 5, ""),
           ("plugin us", "plugin_us", 10, ".1f"), ("op us", "op_us", 8, ".1f"), ("op' us", "op_again_us", 8, ".1f"),
           ("plugin/op", "ratio:plugin_us/op_us", 10, ".3f"), ("op'/op", "ratio:op_again_us/op_us", 7, ".3f"),
           ("roof us", "roofline_us", 8, ".1f"), ("roof/plugin", "ratio:roofline_us/plugin_us", 12, ".2f"),
           ("bitwise", "bitwise_op", 8, ""), ("rel err", "rel_err", 8, ".2g"),
           ("mma us", "mma_us", 8, ".1f"), ("mma/op", "ratio:mma_us/op_us", 7, ".2f"),
           ("mma err", "mma_rel_err", 8, ".2g")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--heads", type=ints, default=[12, 96])
    ap.add_argument("--batch", type=ints, default=[1, 8, 32, 128])
    ap.add_argument("--ctx", type=ints, default=[1024, 8192])
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("trt_plugin_mla: needs an SM90 GPU (the plugin's SM90 path); none here")
    h = PluginHarness()
    ceil = measure()
    rows = []
    for kv in args.kv.split(","):
        for batch in args.batch:
            for ctx in args.ctx:
                for heads in args.heads:
                    rows.append(run_cell(h, heads, batch, ctx, kv, ceil))
                    torch.cuda.empty_cache()
    print_table("MlaVerify: TensorRT plugin (harness enqueue) vs the torch op's launch", ceil, COLUMNS, rows,
                note="op' = the op's graph captured again: the noise floor of plugin/op")
    ratios = [r["plugin_us"] / r["op_us"] for r in rows]
    noise = [abs(r["op_again_us"] / r["op_us"] - 1) for r in rows]
    print(f"plugin/op: {min(ratios):.3f}-{max(ratios):.3f}; op'/op within {max(noise):.3f} of 1; "
          f"bitwise equal to the op in {sum(r['bitwise_op'] for r in rows)}/{len(rows)} cells")
    write_json(args.json, record(__file__, argv, machine=machine(), ceilings=ceil, rows=rows))


if __name__ == "__main__":
    main()
