"""The swap kernel's tensor-core mix on one SM, without its data flow: two "value" warpgroups issuing
m64n48k16 fp16 wgmmas with A from registers (raw fp8 bytes loaded and converted per M tile, one
commit group per wgmma, three in flight: ot_block's pattern), beside two "scores" warpgroups issuing
m64n96k32 e4m3 wgmmas with both operands in shared memory (18 a block in commit groups of four, one
wait a block: st_block's pattern). One CTA per SM, each side alone and both together.

    PYTHONPATH=. python benchmarks/wgmma_mix.py [--json out.json]

Prints per case each side's SM clocks per wgmma and the tensor pipe's busy share over the run
(the wgmmas' clocks at the full rate: 24 a m64n48k16, 48 a m64n96k32, over the elapsed clocks).
The question it answers (mla_verify_notes.md v23): whether the value side's register-operand
wgmmas slow down beside the shared-memory ones by more than sharing the pipe explains.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from harness import measure  # noqa: E402
from harness import command  # noqa: E402

# (the kernels' own helpers: descriptors, the fp8 conversion, the wgmma wrappers and fences)
MLA_CUDA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "k3trt", "plugins",
                        "mla_cuda")
SOURCE = r"""
#include <torch/extension.h>
#include "sm90_common.cuh"
using namespace k3mla;
__global__ void __launch_bounds__(512, 1) k_mix(int64_t* clocks, float* sink, int value_blocks,
                                                int scores_blocks) {
  extern __shared__ __align__(1024) uint8_t smem[];
  // fp16 1/128 (0x2000) everywhere: as e4m3 bytes 0x20 and 0x00, finite
  for (int i = threadIdx.x; i < 98304 / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x20002000u;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int wg = threadIdx.x >> 7, t = threadIdx.x & 127;
  float out = 0.f;
  long long t0 = 0, t1 = 0;
  if (wg < 2) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 152;");
    float acc[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 96; ++i) asm volatile("" : "+f"(acc[i]));
    uint32_t f[16];
    const uint32_t src = base + 65536 + t * 8;  // 8 bytes a thread a token row
    const uint64_t pdesc = sw128_desc(base + 16384 * wg, 16, 1024);
    t0 = clock64();
    for (int blk = 0; blk < value_blocks; ++blk) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint2 x[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(x[u].x), "=r"(x[u].y)
                       : "r"(src + ((blk * 4 + k + u) & 7) * 1024) : "memory");
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          wgmma_wait<3>();
          const uint32_t a = i < 2 ? x[0].x ^ x[1].x : x[0].y ^ x[1].y;
          const uint32_t b = i < 2 ? x[2].x ^ x[3].x : x[2].y ^ x[3].y;
          f[4 * i] = e4m3x2_to_h2<false>(a); f[4 * i + 1] = e4m3x2_to_h2<true>(a);
          f[4 * i + 2] = e4m3x2_to_h2<false>(b); f[4 * i + 3] = e4m3x2_to_h2<true>(b);
          wgmma_fence();
          wgmma_m64n48k16_f16_rs_nn(acc + 24 * i, f + 4 * i, pdesc + 2 * k, 1);
          wgmma_commit();
        }
      }
    }
    wgmma_wait<0>();
    t1 = clock64();
#pragma unroll
    for (int i = 0; i < 96; ++i) out += acc[i];
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 104;");
    float d[48];
#pragma unroll
    for (int i = 0; i < 48; ++i) d[i] = 0.f;
    const uint32_t a0 = base + 32768 + 16384 * (wg - 2), b0 = base;  // A 64 x 128 B, B 96 x 128 B
    t0 = clock64();
    for (int blk = 0; blk < scores_blocks; ++blk) {
      uint32_t ab = a0;
      asm volatile("" : "+r"(ab));
#pragma unroll
      for (int c = 0; c < 5; ++c) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < (c < 4 ? 4 : 2); ++j)
          wgmma_m64n96k32_e4m3_ss(d, sw128_desc(ab + 32 * j, 16, 1024), sw128_desc(b0 + 32 * j, 16, 1024),
                                  1);
        wgmma_commit();
      }
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 48; ++i) asm volatile("" : "+f"(d[i]));
    }
    t1 = clock64();
#pragma unroll
    for (int i = 0; i < 48; ++i) out += d[i];
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = out;
  if (t == 0) clocks[blockIdx.x * 8 + wg * 2] = t0, clocks[blockIdx.x * 8 + wg * 2 + 1] = t1;
}

void mix(torch::Tensor clocks, torch::Tensor sink, int64_t value_blocks, int64_t scores_blocks) {
  cudaFuncSetAttribute(k_mix, cudaFuncAttributeMaxDynamicSharedMemorySize, 98304);
  k_mix<<<clocks.size(0) / 8, 512, 98304>>>(clocks.data_ptr<int64_t>(), sink.data_ptr<float>(),
                                            static_cast<int>(value_blocks),
                                            static_cast<int>(scores_blocks));
}
"""

# (label, value warpgroups' blocks, scores warpgroups' blocks): a block is 16 m64n48k16 a value
# warpgroup (384 clocks at the full rate) and 18 m64n96k32 a scores warpgroup (864), so 9 : 4
# keeps the two sides' full-rate work alike
CASES = [("value alone", 900, 0), ("scores alone", 0, 400), ("both", 900, 400),
         ("both, half scores", 900, 200)]


def build():
    from torch.utils.cpp_extension import load_inline
    return load_inline("k3trt_wgmma_mix", cpp_sources="void mix(torch::Tensor, torch::Tensor, "
                       "int64_t, int64_t);", cuda_sources=SOURCE, functions=["mix"],
                       extra_include_paths=[MLA_CUDA],
                       extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    mod = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceil = measure()
    print(json.dumps(ceil), f"({sms} CTAs, one per SM)", flush=True)
    print(f"{'case':>18} {'value clk/wgmma':>15} {'scores clk/wgmma':>16} {'elapsed clk':>11} "
          f"{'pipe busy':>9}")
    rows = []
    for label, vb, sb in CASES:
        clocks = torch.zeros(sms * 8, dtype=torch.int64, device="cuda")
        sink = torch.zeros(sms * 512, device="cuda")
        mod.mix(clocks, sink, 4, 4)  # warm-up
        mod.mix(clocks, sink, vb, sb)
        torch.cuda.synchronize()
        c = clocks.view(sms, 4, 2).double()
        span = c[:, :, 1] - c[:, :, 0]
        elapsed = (c[:, :, 1].max(1).values - c[:, :, 0].min(1).values).mean().item()
        v = span[:, :2].mean().item() / (16 * vb) if vb else float("nan")
        s = span[:, 2:].mean().item() / (18 * sb) if sb else float("nan")
        busy = (2 * vb * 16 * 24 + 2 * sb * 18 * 48) / elapsed
        rows.append(dict(case=label, value_blocks=vb, scores_blocks=sb, value_clk_per_wgmma=round(v, 1),
                         scores_clk_per_wgmma=round(s, 1), elapsed_clk=round(elapsed),
                         pipe_busy=round(busy, 3)))
        print(f"{label:>18} {v:>15.1f} {s:>16.1f} {elapsed:>11.0f} {busy:>9.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=command(__file__, argv), ceilings=ceil, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
