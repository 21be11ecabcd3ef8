// SM90 (Hopper, sm_90a) kernel for k3trt::mla_verify, "shared" schedule -- the first version; the
// default "pair" schedule is mla_verify_sm90_pair.cu. This file also holds the host launch of both
// and the split merge. K3 MLA verification: 576-wide latent rows (512 value columns + 64 rope),
// one shared latent KV head, paged cache with 64-token pages, the Q·H query rows of a request
// folded into 64-row M tiles.
//
// One CTA = (M tile of one request, split of its KV sequence); 256 threads = two consumer
// warpgroups, no producer warp (each warpgroup issues the TMA loads of the chunks it is the last
// reader of). Shared memory (230 KB): Q resident (64x576 bf16 = 72 KB, nine 64-column chunks in
// the 128-byte-swizzled K-major layout), a two-stage ring of 64-token KV blocks (2 x 72 KB, each
// block = nine [64 tokens x 64 columns] chunks with one mbarrier each, loaded by TMA with 128B
// swizzle straight into the wgmma layout), the 64x64 P tile (8 KB) and row statistics.
//
// Per 64-token block i (both warpgroups on the same block):
//   1. wait for the own P·V of block i-1 (wgmma.wait_group 0), then issue the TMA loads of block
//      i+1 into the stage block i-1 used: warpgroup 0 reloads value chunks 0..3 and the rope
//      chunk, warpgroup 1 value chunks 4..7, each right after its own last read of them, so no
//      empty-barrier round trip is needed and one block is always in flight behind the current.
//   2. S_w = Q · K[tokens 32w..32w+31]^T over all 576 columns: 36 wgmma m64n32k16 per warpgroup,
//      issued chunk by chunk as the chunks land.
//   3. masked row max over the own 32 tokens -> shared memory, named barrier, combine with the
//      other warpgroup's (the only cross-warpgroup exchange of the step), exp2, P (bf16) into the
//      shared P tile, rescale the own 64x256 fp32 accumulator (128 registers per thread).
//   4. named barrier, then O_w += P[64x64] · V[64 tokens, columns 256w..256w+255]: 4 wgmma
//      m64n256k16 (B N-major from the same swizzled chunks), left in flight until step 1.
// The epilogue writes O (bf16) and LSE, or with split-K a 16-bit partial (bf16; fp16 for an fp8
// cache) + fp32 LSE per split that a merge kernel combines (mla_triton's scratch layout, [rows,
// splits, d_v]). A request that the split rule keeps on one split (active_splits == 1: short
// ones) gets its bf16 O and LSE from that CTA, and the merge skips its rows. The merge is a
// programmatic dependent launch (pdl_launch_dependents / pdl_wait, sm90_common.cuh): it starts
// while the verify kernel's last CTAs run, and only its CTAs that read partials wait for them.
//
// fp8-e4m3 cache (per-tensor scale): TMA brings each 64x64 fp8 chunk into the upper half of its
// 8 KB slot; once a block has landed, both warpgroups expand it in place to fp16 (registers in
// between) and the same fp16 wgmma path runs (Q converted to fp16 once, pre-scaled by 1/16).
//
// Every mbarrier wait is bounded (MLA_WAIT_TIMEOUT_NS): on a timeout the kernel records a code in
// `err` and carries on with garbage instead of hanging the GPU, so a broken pipeline shows up as a
// readable error, not a stuck process.

#include <cuda.h>

#include "sm90_common.cuh"
#include "mla_verify_sm90.h"

#include <algorithm>

namespace k3mla {

// shared-memory map (offsets from a 1024-aligned base)
constexpr int kSmemQ = 0;
constexpr int kSmemKV = kBlockBytes;                  // 2 stages
constexpr int kSmemP = kSmemKV + 2 * kBlockBytes;     // 64x64 16-bit, swizzled
constexpr int kSmemMax = kSmemP + kChunkBytes;        // float [2][64]
constexpr int kSmemSum = kSmemMax + 2 * 64 * 4;       // float [2][64]
constexpr int kSmemBar = kSmemSum + 2 * 64 * 4;       // 2 x 9 mbarriers
constexpr int kSmemUsed = kSmemBar + 2 * kChunks * 8;
constexpr int kSmemAlloc = kSmemUsed + 1024;          // slack for aligning the base
static_assert(kSmemAlloc <= 232448, "shared memory over the sm_90 limit");

// ----------------------------------------------------------------------------------------------
// the kernel
// ----------------------------------------------------------------------------------------------
template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    mla_verify_sm90_kernel(const __grid_constant__ CUtensorMap kv_map, const Params p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t sbase = smem_u32(smem);

  const int tid = threadIdx.x;
  const int wg = tid >> 7;          // consumer warpgroup 0 / 1
  const int t = tid & 127;
  const int lane = t & 31;
  const int quad = lane & 3;
  const int r0 = ((t >> 5) << 4) + (lane >> 2);  // accumulator rows r0, r0 + 8 of this thread
  pdl_launch_dependents();

  const int b = blockIdx.z;
  const int split = blockIdx.y;
  const int m0 = blockIdx.x * 64;   // first folded row (j*H + h) of this M tile
  const SplitRange sr = split_range(p, p.seq_lens[b], split);
  const int n = sr.n, blo = sr.blo, nblk = sr.nblk;
  const long row_base = static_cast<long>(b) * p.rows_per_req + m0;  // global row of local row 0
  if (nblk == 0) {
    write_unseen(p, row_base, m0, split, sr.split_out(), tid);
    return;
  }

  const uint32_t bar0 = sbase + kSmemBar;  // full barrier of (stage s, chunk c): bar0 + 8*(9s+c)
  if (tid == 0) {
    for (int i = 0; i < 2 * kChunks; ++i) mbar_init(bar0 + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async();
  }
  __syncthreads();

  const int* bt = p.block_table + static_cast<long>(b) * p.bt_stride + blo;
  // TMA loads of block `i` into stage i&1: warpgroup 0 chunks 0..3 and 8, warpgroup 1 chunks 4..7
  auto issue_block = [&](int i, int page) {
    const int stage = i & 1;
    const int c_lo = wg * 4;
    const int cnt = wg == 0 ? 5 : 4;
    for (int k = 0; k < cnt; ++k) {
      const int c = k < 4 ? c_lo + k : 8;
      const uint32_t bar = bar0 + 8 * (stage * kChunks + c);
      const uint32_t dst =
          sbase + kSmemKV + stage * kBlockBytes + c * kChunkBytes + (kFp8 ? kChunkBytes / 2 : 0);
      mbar_expect_tx(bar, kFp8 ? kChunkBytes / 2 : kChunkBytes);
      tma_load_2d(dst, &kv_map, c * 64, page * kPage, bar);
    }
  };
  // page ids are read one block ahead (by the issuing threads only), so the table load's latency
  // never sits between a stage becoming free and its refill
  int next_page = 0;
  if (t == 0) {
    issue_block(0, __ldg(bt));
    if (nblk > 1) next_page = __ldg(bt + 1);
  }

  // ---- Q tile -> shared memory (fp8: as fp16 / 16) --------------------------------------------
  load_q_tile<kChunks, kFp8>(p, sbase + kSmemQ, row_base, m0, tid);
  fence_proxy_async();
  __syncthreads();

  int vis[2];
  visible_lengths(p, n, m0, r0, vis);

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // this thread's partial sums (reduced over the quad at the end)
  float* smax = reinterpret_cast<float*>(smem + kSmemMax);
  float* ssum = reinterpret_cast<float*>(smem + kSmemSum);

#pragma unroll 1
  for (int i = 0; i < nblk; ++i) {
    const int stage = i & 1;
    const uint32_t parity = (i >> 1) & 1;
    const uint32_t kv = sbase + kSmemKV + stage * kBlockBytes;

    // 1. own P·V of block i-1 done -> its stage is free for block i+1 (own chunks only)
    wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < 128; ++k) pin(acc[k]);
    if (t == 0 && i + 1 < nblk) {
      issue_block(i + 1, next_page);
      if (i + 2 < nblk) next_page = __ldg(bt + i + 2);
    }

    // (fp8) expand the landed block in place: fp8 in the upper 4 KB of each slot -> fp16 slot
    if (kFp8) {
      for (int c = 0; c < kChunks; ++c)
        mbar_wait(bar0 + 8 * (stage * kChunks + c), parity, p.err, 1, blo + i, c);
      uint4 raw[9];
#pragma unroll
      for (int k = 0; k < 9; ++k) {  // piece = tid + 256k of 2304: chunk, row, 16-byte column
        const int pc = tid + kThreads * k;
        const int c = pc >> 8, r = (pc >> 2) & 63, col = pc & 3;
        raw[k] = *reinterpret_cast<const uint4*>(smem + kSmemKV + stage * kBlockBytes +
                                                 c * kChunkBytes + kChunkBytes / 2 + r * 64 +
                                                 col * 16);
      }
      named_bar(3, kThreads);
#pragma unroll
      for (int k = 0; k < 9; ++k) {
        const int pc = tid + kThreads * k;
        const int c = pc >> 8, r = (pc >> 2) & 63, col = pc & 3;
        uint8_t* chunk = smem + kSmemKV + stage * kBlockBytes + c * kChunkBytes;
        *reinterpret_cast<uint4*>(chunk + sw128_off(r, 2 * col)) = e4m3x8_to_h8(raw[k].x, raw[k].y);
        *reinterpret_cast<uint4*>(chunk + sw128_off(r, 2 * col + 1)) =
            e4m3x8_to_h8(raw[k].z, raw[k].w);
      }
      fence_proxy_async();
      named_bar(3, kThreads);
    }

    // 2. S = Q · K^T for this warpgroup's 32 tokens of the block
    float s[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) s[k] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (!kFp8) mbar_wait(bar0 + 8 * (stage * kChunks + c), parity, p.err, 1, blo + i, c);
      const uint32_t qa = sbase + kSmemQ + c * kChunkBytes;
      const uint32_t kb = kv + c * kChunkBytes + wg * 32 * 128;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint64_t da = sw128_desc(qa + 32 * k, 16, 1024);
        const uint64_t db = sw128_desc(kb + 32 * k, 16, 1024);
        if (kFp8) wgmma_m64n32k16_f16_nn(s, da, db, (c | k) != 0);
        else wgmma_m64n32k16_bf16_nn(s, da, db, (c | k) != 0);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < 16; ++k) pin(s[k]);

    // 3. mask, scale, row max over own tokens; exchange with the other warpgroup
    const int tok0 = (blo + i) * kPage + wg * 32;
    float mx[2];
    mask_rowmax<4>(s, tok0, vis, p.scale_log2, quad, mx);
    if (quad == 0) {
      smax[wg * 64 + r0] = mx[0];
      smax[wg * 64 + r0 + 8] = mx[1];
    }
    named_bar(1, kThreads);
    float alpha[2], muse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float other = smax[(wg ^ 1) * 64 + r0 + 8 * h];
      const float mnew = fmaxf(row_max[h], fmaxf(mx[h], other));
      muse[h] = mnew == -INFINITY ? 0.f : mnew;
      alpha[h] = fast_exp2(row_max[h] - muse[h]);
      row_max[h] = mnew;
    }
    // P = exp2(s - m) -> shared P tile (K-major, 128B swizzle: row r, token = 32*wg + 8j + 2q)
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] *= alpha[h];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = fast_exp2(s[4 * j + 2 * h] - muse[h]);
        const float p1 = fast_exp2(s[4 * j + 2 * h + 1] - muse[h]);
        row_sum[h] += p0 + p1;
        const int r = r0 + 8 * h;
        *reinterpret_cast<uint32_t*>(smem + kSmemP + sw128_off(r, wg * 4 + j) + quad * 4) =
            pack2(p0, p1, kFp8);
      }
    }
#pragma unroll
    for (int k = 0; k < 128; ++k) acc[k] *= alpha[(k >> 1) & 1];

    // tokens past the length in the last block: zero their value rows (the cache may hold NaN
    // there, and 0 * NaN would poison the P·V product); each warpgroup zeroes its own columns
    const int valid = n - (blo + i) * kPage;
    if (valid < kPage) {
      uint8_t* vbase = smem + kSmemKV + stage * kBlockBytes + wg * 4 * kChunkBytes;
      const int rows = kPage - valid;
      for (int x = t; x < rows * 32; x += 128) {  // 4 chunks x 8 pieces per row
        const int r = valid + (x >> 5);
        const int c = (x >> 3) & 3;
        *reinterpret_cast<uint4*>(vbase + c * kChunkBytes + r * 128 + (x & 7) * 16) =
            make_uint4(0, 0, 0, 0);
      }
    }
    fence_proxy_async();
    named_bar(2, kThreads);

    // 4. O_w += P · V[:, 256w .. 256w+255]  (left in flight until the next step's wait)
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 128; ++k) pin(acc[k]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint64_t da = sw128_desc(sbase + kSmemP + 32 * k, 16, 1024);
      const uint64_t db = sw128_desc(kv + wg * 4 * kChunkBytes + k * 16 * 128, kChunkBytes, 1024);
      if (kFp8) wgmma_m64n256k16_f16_tn(acc, da, db, 1);
      else wgmma_m64n256k16_bf16_tn(acc, da, db, 1);
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int k = 0; k < 128; ++k) pin(acc[k]);

  store_rows<kFp8>(p, acc, row_sum, row_max, ssum, sbase + kSmemQ, 1, row_base, m0, split,
             sr.split_out(), wg, r0, quad, [](int) {});
}

// LSE merge of a row over at most kMax splits, kCols columns a thread from col (4: 128 threads a
// row; 16: a warp), from its splits' LSE (l; only the first `active` are read): every partial it
// needs is loaded at once, where the grouped merge's loop waits on memory three times in a row
// (length, LSE through shared memory, partials): 1.7-5% of the whole call at batch 32
// (mla_ab_h200.json run 4), 10% at batch 1, 1K, where a request spreads over 8 of the plan's 113
// splits (run 11).
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
// lane (two 16-byte loads per partial), 8 rows a CTA. One 128-thread CTA per row, as before, fit
// 8 rows per SM at a time (57 registers), so 6144 rows (48 heads, batch 32) took six waves of
// latency-bound CTAs; warps holding 4 partials fit 24-32 (kMax 4: 64-80 registers). A programmatic
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

// ----------------------------------------------------------------------------------------------
// host side
// ----------------------------------------------------------------------------------------------
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiledFn get_encode_fn(char* msg, size_t msg_len) {
  static EncodeTiledFn fn = nullptr;
  if (fn) return fn;
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                   cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || ptr == nullptr) {
    snprintf(msg, msg_len, "cuTensorMapEncodeTiled not found (cuda error %d, query %d)",
             static_cast<int>(e), static_cast<int>(q));
    return nullptr;
  }
  fn = reinterpret_cast<EncodeTiledFn>(ptr);
  return fn;
}

// Returns 0 on success, else writes a message into msg.
int launch(const LaunchArgs& a, cudaStream_t stream, char* msg, size_t msg_len) {
  // the merge's shared memory: the splits' lse (16-byte aligned for what follows) and the sums of
  // its thread groups but the first
  const int groups = merge_groups(a.num_splits);
  const size_t merge_smem = sizeof(float) * ((a.num_splits + 3) / 4 * 4 + (groups - 1) * (kDV + 4));
  if (a.num_splits > 1 && merge_smem > 48 * 1024) {
    snprintf(msg, msg_len, "num_splits %d: the merge kernel's shared memory would pass 48 KB",
             a.num_splits);
    return 1;
  }
  EncodeTiledFn encode = get_encode_fn(msg, msg_len);
  if (!encode) return 1;
  // 576-wide rows in boxes of box_x elements x 64 rows: the KV cache's pages (bf16 with the 128-byte
  // swizzle, or raw fp8 bytes in 64-byte boxes), the pair kernel's Q tile (bf16, swizzled: the wgmma
  // A layout), and the swap kernel's raw fp8 rows (value chunks in 128-byte boxes with the 128-byte
  // swizzle, the rope chunk in a 64-byte box with the 64-byte swizzle: both are wgmma operands as
  // they lie)
  auto encode_rows = [&](CUtensorMap* map, const void* base, long rows, bool bytes, int box_x,
                         CUtensorMapSwizzle swizzle) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kD) * (bytes ? 1 : 2)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_x), 64};
    const cuuint32_t estr[2] = {1, 1};
    return encode(map, bytes ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                  const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  const bool swap = a.schedule == 2;
  const int head_group = swap ? swap_head_group(a.q_per_req, a.heads) : a.heads;
  if (swap && (!a.kv_fp8 || head_group < 1)) {
    snprintf(msg, msg_len, "schedule swap takes an fp8 cache and at most %d query rows a request "
             "(q_per_req %d)", kSwapMaxRows, a.q_per_req);
    return 1;
  }
  CUtensorMap map, q_map;
  const long q_rows = static_cast<long>(a.batch) * a.q_per_req * a.heads;
  const long kv_rows = a.num_pages * kPage;
  // (swap: map = the value chunks, q_map = the rope chunk; it reads Q with plain loads)
  constexpr CUtensorMapSwizzle kSw128 = CU_TENSOR_MAP_SWIZZLE_128B;
  CUresult r = swap ? encode_rows(&map, a.kv, kv_rows, true, 128, kSw128)
                    : encode_rows(&map, a.kv, kv_rows, a.kv_fp8, 64,
                                  a.kv_fp8 ? CU_TENSOR_MAP_SWIZZLE_NONE : kSw128);
  if (r == CUDA_SUCCESS)
    r = swap ? encode_rows(&q_map, a.kv, kv_rows, true, 64, CU_TENSOR_MAP_SWIZZLE_64B)
             : encode_rows(&q_map, a.q, q_rows, false, 64, kSw128);
  if (r != CUDA_SUCCESS) {
    snprintf(msg, msg_len, "cuTensorMapEncodeTiled failed with CUresult %d", static_cast<int>(r));
    return 1;
  }
  Params p;
  p.q = a.q;
  p.block_table = a.block_table;
  p.seq_lens = a.seq_lens;
  p.out = a.out;
  p.lse = a.lse;
  p.part_o = static_cast<uint16_t*>(a.part_o);
  p.part_lse = a.part_lse;
  p.err = a.err;
  p.bt_stride = a.bt_stride;
  p.q_per_req = a.q_per_req;
  p.heads = a.heads;
  p.rows_per_req = a.q_per_req * a.heads;
  p.head_group = head_group;
  p.num_splits = a.num_splits;
  p.rule = {std::max(1, std::min(a.wave_splits, a.num_splits)), std::max(1, a.min_split_blocks),
            std::max(1, a.full_split_blocks)};
  const float log2e = 1.4426950408889634f;
  p.scale_log2 = a.softmax_scale * a.kv_scale * log2e * (a.kv_fp8 ? 16.f : 1.f);
  p.out_scale = a.kv_scale;

  // x: the pair kernels' 64-row M tiles of a request, or the swap kernel's head groups
  const int m_tiles = swap ? a.heads / head_group : (p.rows_per_req + 63) / 64;
  dim3 grid(m_tiles, a.num_splits, a.batch);
  // which kernel: the pair schedule or the shared-block one
  cudaError_t e;
  if (a.schedule == 1) {
    e = launch_pair(map, q_map, p, grid, a.kv_fp8, stream);
  } else if (swap) {
    e = launch_swap(map, q_map, p, grid, stream);
  } else {
    static const cudaError_t allowed[2] = {allow_smem(mla_verify_sm90_kernel<false>, kSmemAlloc),
                                           allow_smem(mla_verify_sm90_kernel<true>, kSmemAlloc)};
    e = allowed[a.kv_fp8];
    const auto fn = a.kv_fp8 ? mla_verify_sm90_kernel<true> : mla_verify_sm90_kernel<false>;
    if (e == cudaSuccess) fn<<<grid, kThreads, kSmemAlloc, stream>>>(map, p);
  }
  if (e != cudaSuccess) {
    snprintf(msg, msg_len, "verify kernel setup: %s", cudaGetErrorString(e));
    return 1;
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(msg, msg_len, "verify kernel launch: %s", cudaGetErrorString(e));
    return 1;
  }
  if (a.num_splits > 1) {
    const unsigned rows = static_cast<unsigned>(static_cast<long>(a.batch) * p.rows_per_req);
    const uint16_t* po = p.part_o;
    const float* pl = a.part_lse;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(a.out);
    // an fp8 cache's partials are fp16 in the cache's units: the merge applies kv_scale
    const float scale = a.kv_fp8 ? a.kv_scale : 1.f;
    using FewKernel = void (*)(const uint16_t*, const float*, const int*, long, int, int, SplitRule,
                               float, __nv_bfloat16*, float*);
    static const FewKernel few_kernels[2][2] = {
        {mla_merge_few_splits_kernel<false, 4>, mla_merge_few_splits_kernel<false, kFewSplits>},
        {mla_merge_few_splits_kernel<true, 4>, mla_merge_few_splits_kernel<true, kFewSplits>}};
    const FewKernel few = few_kernels[a.kv_fp8][a.num_splits > 4];
    const auto grouped = a.kv_fp8 ? mla_merge_splits_kernel<true> : mla_merge_splits_kernel<false>;
    // a programmatic dependent launch: its CTAs start while the verify kernel's last ones run
    cudaLaunchAttribute pdl[1];
    pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    pdl[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.stream = stream;
    cfg.attrs = pdl;
    cfg.numAttrs = 1;
    if (a.num_splits <= kFewSplits) {
      cfg.gridDim = dim3((rows + kMergeRowsPerCta - 1) / kMergeRowsPerCta);
      cfg.blockDim = dim3(32 * kMergeRowsPerCta);
      e = cudaLaunchKernelEx(&cfg, few, po, pl, a.seq_lens, static_cast<long>(rows),
                             p.rows_per_req, a.num_splits, p.rule, scale, o, a.lse);
    } else {
      cfg.gridDim = dim3(rows);
      cfg.blockDim = dim3(128 * groups);
      cfg.dynamicSmemBytes = merge_smem;
      e = cudaLaunchKernelEx(&cfg, grouped, po, pl, a.seq_lens, p.rows_per_req, a.num_splits,
                             p.rule, scale, o, a.lse);
    }
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess) {
      snprintf(msg, msg_len, "merge kernel launch: %s", cudaGetErrorString(e));
      return 1;
    }
  }
  return 0;
}

}  // namespace k3mla
