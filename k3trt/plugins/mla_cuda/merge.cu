// The split-K merge of the SM90 MLA verification kernels: each row's split partials (16-bit O
// normalised by its split's own sum, fp32 LSE; [rows, splits, 512]) combined by LSE into the bf16
// output and its LSE. Only the splits a request spread over are read (active_splits), and rows
// whose request sat on one split are skipped: the verify kernel wrote them. Both kernels are
// programmatic dependent launches: their CTAs start while the verify grid's last CTAs run, and only
// those that read partials wait for it (pdl_wait).
#include "common.cuh"
#include "kernels.h"

namespace k3mla {

// LSE merge of a row over at most kMax splits, kCols columns a thread from col (4: 128 threads a
// row; 16: a warp), from its splits' LSE (l; only the first `active` are read): every partial it
// needs is loaded at once, where the grouped merge's loop waits on memory three times in a row
// (length, LSE through shared memory, partials): 1.7-5% of the whole call at batch 32, 10% at
// batch 1, 1K, where a request spreads over 8 of the plan's 113 splits (docs/mla_verify.md).
constexpr int kFewSplits = 8;
// kCols 16-bit values (bf16, or fp16 for an fp8 cache) <-> floats
template <bool kF16>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  return kF16 ? __half22float2(*reinterpret_cast<const __half2*>(&v))
              : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <int kCols>
__device__ __forceinline__ void load_words(const uint16_t* p, uint32_t* w) {
  if constexpr (kCols % 8 == 0) {
#pragma unroll
    for (int k = 0; k < kCols / 8; ++k) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + 8 * k);
      w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kCols / 4; ++k) {
      const uint2 v = *reinterpret_cast<const uint2*>(p + 4 * k);
      w[2 * k] = v.x, w[2 * k + 1] = v.y;
    }
  }
}
template <int kCols>
__device__ __forceinline__ void store_words(__nv_bfloat16* p, const uint32_t* w) {
  if constexpr (kCols % 8 == 0) {
#pragma unroll
    for (int k = 0; k < kCols / 8; ++k)
      *reinterpret_cast<uint4*>(p + 8 * k) =
          make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < kCols / 4; ++k)
      *reinterpret_cast<uint2*>(p + 4 * k) = make_uint2(w[2 * k], w[2 * k + 1]);
  }
}
// four partial values (8 bytes) as floats (the grouped merge's loop)
template <bool kF16>
__device__ __forceinline__ float4 load_partial4(const uint16_t* p) {
  uint32_t w[2];
  load_words<4>(p, w);
  const float2 a = unpack2<kF16>(w[0]), b = unpack2<kF16>(w[1]);
  return make_float4(a.x, a.y, b.x, b.y);
}

// the first `count` (<= kMax) of a row's split LSEs into l, -inf past them
template <int kMax>
__device__ __forceinline__ void load_lse_few(const float* __restrict__ part_lse, long row,
                                             int splits, int count, float* l) {
#pragma unroll
  for (int s = 0; s < kMax; ++s) l[s] = s < count ? part_lse[row * splits + s] : -INFINITY;
}

// (scale: from the partials' units to the output's: kv_scale for an fp8 cache, else 1; kMax: the
// most splits, whose partials it holds in registers)
template <bool kF16, int kCols, int kMax>
__device__ __forceinline__ void merge_row_few(const uint16_t* __restrict__ part_o, const float* l,
                                              long row, int splits, int active, int col,
                                              float scale, __nv_bfloat16* __restrict__ out,
                                              float* __restrict__ lse) {
  uint32_t o[kMax][kCols / 2];
  float mx = -INFINITY;
#pragma unroll
  for (int s = 0; s < kMax; ++s) {
    // a split that saw none of this row's tokens (lse -inf) wrote no O: never load it
    if (s < active && l[s] != -INFINITY) {
      load_words<kCols>(part_o + (row * splits + s) * kDV + col, o[s]);
      mx = fmaxf(mx, l[s]);
    }
  }
  uint32_t w[kCols / 2];
  if (mx == -INFINITY) {
#pragma unroll
    for (int k = 0; k < kCols / 2; ++k) w[k] = 0u;
    store_words<kCols>(out + row * kDV + col, w);
    if (col == 0) lse[row] = -INFINITY;
    return;
  }
  float total = 0.f;
  float acc[kCols];
#pragma unroll
  for (int k = 0; k < kCols; ++k) acc[k] = 0.f;
#pragma unroll
  for (int s = 0; s < kMax; ++s) {
    if (s < active && l[s] != -INFINITY) {
      const float wt = __expf(l[s] - mx);
      total += wt;
#pragma unroll
      for (int k = 0; k < kCols / 2; ++k) {
        const float2 v = unpack2<kF16>(o[s][k]);
        acc[2 * k] += wt * v.x;
        acc[2 * k + 1] += wt * v.y;
      }
    }
  }
  const float inv = scale / total;
#pragma unroll
  for (int k = 0; k < kCols / 2; ++k) w[k] = pack2(acc[2 * k] * inv, acc[2 * k + 1] * inv, false);
  store_words<kCols>(out + row * kDV + col, w);
  if (col == 0) lse[row] = mx + __logf(total);
}

// The merge of plans of at most kMax (4 or 8) splits (batch >= ~32): a warp per row, 16 columns a
// lane (two 16-byte loads per partial), 8 rows a CTA. A 128-thread CTA per row fits 8 rows per SM
// at a time (57 registers), so 6144 rows (48 heads, batch 32) take six waves of latency-bound
// CTAs; warps holding 4 partials fit 24-32 (kMax 4: 64-80 registers). A programmatic
// dependent launch: a CTA whose rows all sit on one split (the verify kernel wrote them) exits
// without waiting for the verify grid, i.e. while its last CTAs run; CTA 0 always waits, so that
// this grid never completes before the verify grid does.
constexpr int kMergeRowsPerCta = 8;
template <bool kF16, int kMax>
__global__ void __launch_bounds__(32 * kMergeRowsPerCta)
    mla_merge_few_splits_kernel(const uint16_t* __restrict__ part_o,
                                const float* __restrict__ part_lse,
                                const int* __restrict__ seq_lens, long rows, int rows_per_req,
                                int splits, SplitRule rule, float scale,
                                __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  const long row = blockIdx.x * static_cast<long>(kMergeRowsPerCta) + (threadIdx.x >> 5);
  const int active = row < rows ? active_splits(seq_lens[row / rows_per_req], splits, rule) : 1;
  if (!__syncthreads_or(active > 1) && blockIdx.x != 0) return;
  pdl_wait();
  if (active == 1) return;
  float l[kMax];
  load_lse_few<kMax>(part_lse, row, splits, active, l);
  merge_row_few<kF16, 16, kMax>(part_o, l, row, splits, active, (threadIdx.x & 31) * 16, scale,
                                out, lse);
}

// LSE merge of the split partials: one CTA per row, blockDim = 128 G threads. Group g of 128
// threads sums splits g, g + G, ... over 4 columns per thread, then the groups add up through shared
// memory: a row of a long batch-1 request has ~100 partials, and one thread walking them all would
// leave the merge latency-bound. It reads only the splits the request spread over (active_splits).
__device__ __forceinline__ float block_max(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) v = fmaxf(v, red[w]);
  return v;
}

// (__launch_bounds__ without the 1: ptxas gave the fp8 instance 32 registers, and it spilled)
template <bool kF16>
__global__ void __launch_bounds__(1024, 1)
    mla_merge_splits_kernel(const uint16_t* __restrict__ part_o,
                            const float* __restrict__ part_lse,
                            const int* __restrict__ seq_lens, int rows_per_req, int splits,
                            SplitRule rule, float scale, __nv_bfloat16* __restrict__ out,
                            float* __restrict__ lse) {
  extern __shared__ float merge_smem[];  // [splits] lse, then [G - 1] x (512 sums, total, pad)
  __shared__ float red[32];
  const long row = blockIdx.x;
  const int tid = threadIdx.x, groups = blockDim.x >> 7, g = tid >> 7, col = (tid & 127) * 4;
  const int active = active_splits(seq_lens[row / rows_per_req], splits, rule);
  // the verify kernel wrote this request's rows (SplitRange); as in the few-splits kernel, only
  // rows that read partials (and CTA 0) wait for it
  if (active == 1 && row != 0) return;
  pdl_wait();
  if (active == 1) return;
  if (active <= kFewSplits) {  // a short request of a large plan: one group does it all at once
    if (g > 0) return;
    float lf[kFewSplits];
    load_lse_few<kFewSplits>(part_lse, row, splits, active, lf);
    merge_row_few<kF16, 4, kFewSplits>(part_o, lf, row, splits, active, col, scale, out, lse);
    return;
  }
  const float* l = part_lse + row * splits;
  float mx = -INFINITY;
  for (int s = tid; s < active; s += blockDim.x) {
    merge_smem[s] = l[s];
    mx = fmaxf(mx, merge_smem[s]);
  }
  mx = block_max(mx, red);
  if (mx == -INFINITY) {
    if (g == 0) *reinterpret_cast<uint2*>(out + row * kDV + col) = make_uint2(0, 0);
    if (tid == 0) lse[row] = -INFINITY;
    return;
  }
  float total = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = g; s < active; s += groups) {
    const float ls = merge_smem[s];
    if (ls == -INFINITY) continue;  // a split that saw none of this row's tokens wrote no O
    const float w = __expf(ls - mx);
    total += w;
    const float4 o = load_partial4<kF16>(part_o + (row * splits + s) * kDV + col);
    acc.x += w * o.x;
    acc.y += w * o.y;
    acc.z += w * o.z;
    acc.w += w * o.w;
  }
  if (groups > 1) {
    float* sums = merge_smem + (splits + 3) / 4 * 4;  // group g > 0 at (g - 1) * (kDV + 4)
    if (g > 0) {
      *reinterpret_cast<float4*>(sums + (g - 1) * (kDV + 4) + col) = acc;
      if ((tid & 127) == 0) sums[(g - 1) * (kDV + 4) + kDV] = total;
    }
    __syncthreads();
    if (g > 0) return;
    for (int k = 0; k < groups - 1; ++k) {
      const float4 o = *reinterpret_cast<const float4*>(sums + k * (kDV + 4) + col);
      acc.x += o.x;
      acc.y += o.y;
      acc.z += o.z;
      acc.w += o.w;
      total += sums[k * (kDV + 4) + kDV];
    }
  }
  const float inv = scale / total;
  __nv_bfloat162 a = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  __nv_bfloat162 c = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(out + row * kDV + col) =
      make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&c));
  if (tid == 0) lse[row] = mx + __logf(total);
}

// Threads per merge row: a group of 128 per 8 splits, up to 8 groups.
static int merge_groups(int splits) {
  int g = 1;
  while (g < 8 && 16 * g <= splits) g *= 2;
  return g;
}

// The shared memory the grouped merge needs for a plan of `splits`: the splits' lse (16-byte
// aligned for what follows) and the sums of its thread groups but the first.
size_t merge_smem_bytes(int splits) {
  const int groups = merge_groups(splits);
  return sizeof(float) * ((splits + 3) / 4 * 4 + (groups - 1) * (kDV + 4));
}

cudaError_t launch_merge(const Params& p, long rows, bool kv_fp8, float kv_scale,
                         cudaStream_t stream) {
  const uint16_t* po = p.part_o;
  const float* pl = p.part_lse;
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(p.out);
  // an fp8 cache's partials are fp16 in the cache's units: the merge applies kv_scale
  const float scale = kv_fp8 ? kv_scale : 1.f;
  using FewKernel = void (*)(const uint16_t*, const float*, const int*, long, int, int, SplitRule,
                             float, __nv_bfloat16*, float*);
  static const FewKernel few_kernels[2][2] = {
      {mla_merge_few_splits_kernel<false, 4>, mla_merge_few_splits_kernel<false, kFewSplits>},
      {mla_merge_few_splits_kernel<true, 4>, mla_merge_few_splits_kernel<true, kFewSplits>}};
  const FewKernel few = few_kernels[kv_fp8][p.num_splits > 4];
  const auto grouped = kv_fp8 ? mla_merge_splits_kernel<true> : mla_merge_splits_kernel<false>;
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.stream = stream;
  cfg.attrs = pdl;
  cfg.numAttrs = 1;
  cudaError_t e;
  if (p.num_splits <= kFewSplits) {
    cfg.gridDim = dim3(static_cast<unsigned>((rows + kMergeRowsPerCta - 1) / kMergeRowsPerCta));
    cfg.blockDim = dim3(32 * kMergeRowsPerCta);
    e = cudaLaunchKernelEx(&cfg, few, po, pl, p.seq_lens, rows, p.rows_per_req, p.num_splits,
                           p.rule, scale, o, p.lse);
  } else {
    cfg.gridDim = dim3(static_cast<unsigned>(rows));
    cfg.blockDim = dim3(128 * merge_groups(p.num_splits));
    cfg.dynamicSmemBytes = merge_smem_bytes(p.num_splits);
    e = cudaLaunchKernelEx(&cfg, grouped, po, pl, p.seq_lens, p.rows_per_req, p.num_splits,
                           p.rule, scale, o, p.lse);
  }
  return e == cudaSuccess ? cudaGetLastError() : e;
}

}  // namespace k3mla
