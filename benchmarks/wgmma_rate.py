"""How fast one SM90 SM retires wgmma m64nNk16 (fp16 in, fp32 accumulate) at small N, the shapes the
swap kernel lives on (N = 48 query rows at 12 heads), against the dense GEMM rate measured in the
same run. Each CTA (one per SM) runs 1-3 warpgroups, each issuing groups of four wgmmas into its
own accumulator with two groups in flight (the swap kernel's pattern), A from registers (RS) or from
shared memory (SS), B from shared memory (128-byte swizzle, as the kernels use). The "cvt" rows
issue m64n48k16 as the swap kernel's scores warpgroup does: each group first loads its fragments'
raw fp8 bytes and converts them, with 1, 2 or 4 groups in flight (mla_verify_notes.md v15).

    PYTHONPATH=. python benchmarks/wgmma_rate.py [--json out.json]

Prints per shape: SM clocks per wgmma (all warpgroups together), the clocks the tensor cores need at
their full rate (N / 2: 64·N·16 MACs at 2048 a clock), TFLOP/s, and the ratio to the GEMM rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "k3trt", "plugins", "mla_cuda"))
from gen_wgmma import wrapper  # noqa: E402

from harness import measure  # noqa: E402
from harness import command  # noqa: E402

SHAPES = [(48, True), (64, True), (96, True), (128, True), (256, True), (48, False), (64, False)]
ITERS = 4096

HEADER = r"""
#include <torch/extension.h>
#include <cstdint>
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ uint32_t cvt_lo(uint32_t v) {
  uint32_t d; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(d) : "r"(v));
  return d;
}
__device__ __forceinline__ uint32_t cvt_hi(uint32_t v) {
  uint32_t d; asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(d) : "r"(v));
  return d;
}
"""

# One kernel: NAME, REGS (N / 2 accumulators), PRE (set-up before the clock starts) and LOOP
# filled in; shared memory holds fp16 1/128 (or, read as e4m3, finite bytes) everywhere.
KERNEL = r"""
__global__ void k_NAME(int64_t* clocks, float* sink, int iters) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < 65536 / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x20002000u;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint64_t db = sw128_desc(base);
  float acc[REGS];
  for (int i = 0; i < REGS; ++i) acc[i] = 0.f;
PRE
  const long long t0 = clock64();
LOOP
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  __syncthreads();
  const long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < REGS; ++i) s += acc[i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) clocks[blockIdx.x] = t1 - t0;
}

void NAME(torch::Tensor clocks, torch::Tensor sink, int64_t threads, int64_t iters) {
  cudaFuncSetAttribute(k_NAME, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
  k_NAME<<<clocks.size(0), threads, 65536>>>(clocks.data_ptr<int64_t>(), sink.data_ptr<float>(),
                                             static_cast<int>(iters));
}
"""

# groups of four wgmmas of one shape, A from registers (a constant fragment) or shared memory
RATE_PRE = r"""
  const uint64_t da = sw128_desc(base + 32768);
  uint32_t a[2][4];
  for (int i = 0; i < 8; ++i) a[i / 4][i % 4] = 0x3c003c00u + threadIdx.x;
"""
RATE_LOOP = r"""
  for (int it = 0; it < iters; ++it) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k) MMA;
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
  }
"""

# m64n48k16 RS as the swap kernel's scores warpgroup issues it: each group of four first loads its
# fragments' raw fp8 bytes from shared memory (two 16-byte loads) and converts them (16 cvt), into
# a ring of DEPTH fragment sets, waiting for the group DEPTH back to retire
CVT_PRE = r"""
  const uint32_t src = base + 32768 + (threadIdx.x & 127) * 16;
  // (pinned: else ptxas carries the zeros into the loop and serialises the wgmmas, C7514)
  for (int i = 0; i < 24; ++i) asm volatile("" : "+f"(acc[i]));
  uint32_t fr[DEPTH][16];
"""
CVT_LOOP = r"""
  for (int it = 0; it < iters; it += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      uint4 x[2];
      const uint32_t a = src + ((it + d) & 7) * 2048;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(x[0].x), "=r"(x[0].y), "=r"(x[0].z), "=r"(x[0].w) : "r"(a) : "memory");
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(x[1].x), "=r"(x[1].y), "=r"(x[1].z), "=r"(x[1].w) : "r"(a + 1024) : "memory");
      asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(DEPTH - 1) : "memory");
      const uint32_t w0[4] = {x[0].x, x[0].y, x[0].z, x[0].w}, w1[4] = {x[1].x, x[1].y, x[1].z, x[1].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        fr[d][4 * k] = cvt_lo(w0[k]); fr[d][4 * k + 1] = cvt_lo(w1[k]);
        fr[d][4 * k + 2] = cvt_hi(w0[k]); fr[d][4 * k + 3] = cvt_hi(w1[k]);
      }
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_m64n48k16_f16_rs_nn(acc, fr[d] + 4 * k, db + 2 * k, 1);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    }
  }
"""
CVT_DEPTHS = (1, 2, 4)


def tag(n: int, rs: bool) -> str:
    return f"n{n}_{'rs' if rs else 'ss'}"


def kernel(name: str, regs: int, pre: str, loop: str) -> str:
    return (KERNEL.replace("NAME", name).replace("REGS", str(regs)).replace("PRE", pre.strip("\n"))
            .replace("LOOP", loop.strip("\n")))


def source() -> tuple[str, list[str]]:
    """The CUDA source (one kernel and launcher per case) and the launchers' names."""
    parts, names = [HEADER], []
    for n, rs in SHAPES:
        parts.append(wrapper(n, "f16", rs, False))
        mma = (f"wgmma_m64n{n}k16_f16_rs_nn(acc, a[it & 1], db + 2 * k, 1)" if rs else
               f"wgmma_m64n{n}k16_f16_nn(acc, da + 2 * k, db + 2 * k, 1)")
        parts.append(kernel(tag(n, rs), n // 2, RATE_PRE, RATE_LOOP.replace("MMA", mma)))
        names.append(tag(n, rs))
    if (48, True) not in SHAPES:  # (the cvt loops call its wrapper)
        parts.append(wrapper(48, "f16", True, False))
    for d in CVT_DEPTHS:
        parts.append(kernel(f"cvt_d{d}", 24, CVT_PRE.replace("DEPTH", str(d)),
                            CVT_LOOP.replace("DEPTH", str(d))))
        names.append(f"cvt_d{d}")
    return "\n".join(parts), names


def build():
    from torch.utils.cpp_extension import load_inline
    cuda, names = source()
    decls = [f"void {name}(torch::Tensor, torch::Tensor, int64_t, int64_t);" for name in names]
    return load_inline("k3trt_wgmma_rate", cpp_sources="\n".join(decls), cuda_sources=cuda,
                       functions=names, extra_cuda_cflags=["-O3", "-std=c++17",
                                                           "-gencode=arch=compute_90a,code=sm_90a"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    mod = build()
    ceil = measure()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(json.dumps(ceil), flush=True)
    print(f"{'shape':>14} {'WGs':>3} {'clk/wgmma':>9} {'full-rate':>9} {'of full':>7} {'TFLOP/s':>8} "
          f"{'of GEMM':>7}")
    rows = []
    cases = [(f"m64n{n}k16 {'RS' if rs else 'SS'}", getattr(mod, tag(n, rs)), n, rs)
             for n, rs in SHAPES]
    cases += [(f"n48 RS cvt d{d}", getattr(mod, f"cvt_d{d}"), 48, True) for d in CVT_DEPTHS]
    for label, fn, n, rs in cases:
        for wgs in (1, 2, 3) if n < 256 else (1, 2):  # (218 registers at N = 256)
            clocks = torch.zeros(sms, dtype=torch.int64, device="cuda")
            sink = torch.zeros(sms * 128 * wgs, device="cuda")
            fn(clocks, sink, 128 * wgs, 64)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(clocks, sink, 128 * wgs, ITERS)
            end.record()
            torch.cuda.synchronize()
            wgmmas = ITERS * 4 * wgs
            clk = clocks.double().mean().item() / wgmmas
            tflops = 2 * 64 * n * 16 * wgmmas * sms / (start.elapsed_time(end) * 1e-3) / 1e12
            row = dict(shape=label, n=n, a="registers" if rs else "shared", warpgroups=wgs,
                       clk_per_wgmma=round(clk, 2), full_rate_clk=n / 2,
                       of_full_rate=round(n / 2 / clk, 3), tflops=round(tflops, 1),
                       of_gemm=round(tflops / ceil["gemm_tflops"], 3))
            rows.append(row)
            print(f"{label:>14} {wgs:>3} {clk:>9.1f} {n / 2:>9.1f} "
                  f"{row['of_full_rate']:>7.3f} {tflops:>8.1f} {row['of_gemm']:>7.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=command(__file__, argv), ceilings=ceil, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
