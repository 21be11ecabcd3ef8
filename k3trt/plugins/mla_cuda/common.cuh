// Shared pieces of the SM90 MLA verification kernels (pair.cu, swap.cu, merge.cu): the derived
// constants (the problem's own come from mla_constants.h, generated from constants.py at build
// time), the kernel parameters, the split rule, and inline-PTX helpers (mbarriers, TMA, wgmma
// fences and descriptors, the 128-byte swizzle).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>
#include <cstdio>

#include "mla_constants.h"
#include "wgmma_ops.cuh"

#ifndef MLA_WAIT_TIMEOUT_NS
#define MLA_WAIT_TIMEOUT_NS 500000000ull  // 0.5 s
#endif


namespace k3mla {

constexpr int kChunks = kD / 64;          // 9 chunks of 64 columns
constexpr int kChunkBytes = 64 * 128;     // 64 rows x 128 B (bf16/fp16)
constexpr int kBlockBytes = kChunks * kChunkBytes;  // 73728
constexpr int kThreads = 256;
// How a request spreads over the grid's splits (active_splits): all num_splits when it has at least
// full_blocks pages per split (the extra waves of CTAs and their partials are then paid for);
// else min_blocks pages per split at least, over at most wave_splits splits (the most that keep the
// grid in one wave of CTAs).
struct SplitRule {
  int wave_splits;
  int min_blocks;
  int full_blocks;
};

struct Params {
  const void* q;          // [B*Q, H, 576] bf16
  const int* block_table; // [B, bt_stride] int32
  const int* seq_lens;    // [B] int32
  void* out;              // [B*Q, H, 512] bf16 (requests on one split)
  float* lse;             // [B*Q*H] fp32     (requests on one split)
  uint16_t* part_o;       // [B*Q*H, splits, 512] bf16, or fp16 in the cache's units (num_splits > 1)
  float* part_lse;        // [B*Q*H, splits] fp32      (num_splits > 1)
  int* err;               // [4] int32: timeout code, block, chunk, parity of the first timeout
  int bt_stride;
  int q_per_req;
  int heads;
  int rows_per_req;       // q_per_req * heads
  int head_group;         // heads a swap CTA takes (its tile: q_per_req x head_group rows); heads elsewhere
  int num_splits;
  SplitRule rule;
  float scale_log2;       // softmax_scale * kv_scale * log2(e) (/ q pre-scale on the fp8 path)
  float out_scale;        // kv_scale
};

// ----------------------------------------------------------------------------------------------
// PTX helpers
// ----------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}

// Bounded wait: on a timeout record (code, a, b, parity) in err once and return (never hang).
__device__ __forceinline__ void mbar_wait_slow(uint32_t bar, uint32_t parity, int* err, int code,
                                            int a, int b) {
  const uint64_t t0 = globaltimer();
  while (!mbar_try_wait(bar, parity)) {
    if (*reinterpret_cast<volatile int*>(err) != 0) return;  // another thread timed out: bail
    if (globaltimer() - t0 > MLA_WAIT_TIMEOUT_NS) {
      if (atomicCAS(err, 0, code) == 0) {
        err[1] = a;
        err[2] = b;
        err[3] = static_cast<int>(parity);
      }
      return;
    }
  }
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, int* err, int code, int a,
                                          int b) {
  if (!mbar_try_wait(bar, parity)) mbar_wait_slow(bar, parity, err, code, a, b);
}

// The KV stream is read once per call at 12 heads: evict-first keeps it from pushing the small,
// reused data (block table, lengths, Q, split partials) out of L2: 2-5% at batch 32 (8K, 2K, 1K),
// 1-3% at batch 128 / 1K. It costs 0.5-1.5% at 48 / 96 heads, batch 128, 1K, whose M tiles read
// the same pages in different waves; picking the policy at run time is slower everywhere (the
// branch at each issue), so all cells take evict-first.
// kEvictFirst = false: no cache hint (the pair kernel's Q tile, which every split of its M tile
// reads).
template <bool kEvictFirst = true>
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y,
                                            uint32_t bar) {
  if (kEvictFirst) {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "l"(policy)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
  }
}

// Programmatic dependent launch (sm_90): the verify kernels let the merge kernel, launched with the
// programmatic-serialization attribute, start while their last CTAs still run (launch_dependents at
// entry); the merge waits for the verify grid to complete and its writes to be visible (pdl_wait)
// only where it needs them. Without the attribute both are no-ops.
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void named_bar(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// keeps the compiler from moving accumulator reads/writes across the async wgmma region
__device__ __forceinline__ void pin(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// shared-memory accesses by 32-bit address (the aligned dynamic-smem pointer is a generic one,
// which costs 64-bit address registers and generic ST/LD)
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t addr, uint2 v) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// wgmma shared-memory descriptor as two 32-bit words: the low one holds the start address and the
// leading byte offset (each / 16), the high one the stride byte offset / 16 and the swizzle mode.
// A kernel stepping through a tile adds offset / 16 to the low word (one add a wgmma).
constexpr uint32_t kDescSw128 = 1, kDescSw64 = 2;
__host__ __device__ constexpr uint32_t desc_hi(uint32_t sbo, uint32_t swizzle) {
  return ((sbo & 0x3FFFF) >> 4) | (swizzle << 30);
}
__device__ __forceinline__ uint32_t desc_lo(uint32_t saddr, uint32_t lbo) {
  return ((saddr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16);
}
__device__ __forceinline__ uint64_t make_desc(uint32_t lo, uint32_t hi) {
  return static_cast<uint64_t>(hi) << 32 | lo;
}
// the 128-byte swizzle's (start, leading and stride byte offsets)
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return make_desc(desc_lo(saddr, lbo), desc_hi(sbo, kDescSw128));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(kThreads) : "memory");
}

// whether v holds for any of one warpgroup's 128 threads (barrier id: that warpgroup's own)
__device__ __forceinline__ bool warpgroup_any(bool v, int id) {
  uint32_t r;
  asm volatile(
      "{.reg .pred p, q; setp.ne.u32 p, %1, 0; bar.red.or.pred q, %2, 128, p; selp.u32 %0, 1, 0, q;}"
      : "=r"(r) : "r"(static_cast<uint32_t>(v)), "r"(id) : "memory");
  return r != 0;
}

// Lazy rescaling (FlashAttention-4's): a row's running max moves only when a block's max passes it
// by more than kLazyMax (log2 units), so P stays at most 2^kLazyMax (fp32 accumulators, bf16 / fp16
// P: no range concern) and the rescale factors are exactly 1 on almost every block, which lets a
// warp skip the 128-register rescale of its accumulator (lsum and O share the stale max, so the
// result is the same; LSE = m + log2 l whatever m is). +3 to +10% at 24-96 heads in bf16, +1 to
// +3% in fp8.
constexpr float kLazyMax = 8.f;
__device__ __forceinline__ float lazy_max(float m_run, float mx) {
  return mx > m_run + kLazyMax ? mx : m_run;  // (m_run = -inf: any finite mx)
}
// the factor taking a row's sums from max m_old to m_new >= m_old: exactly 1 when the max did not
// move, and when it is -inf (nothing seen yet: the sums are 0, so any factor is right, and 1 lets
// the padding rows of a 12-head tile skip their rescale, which exp2(-inf - 0) = 0 would not)
__device__ __forceinline__ float rescale_factor(float m_old, float m_new) {
  return m_old == m_new || m_old == -INFINITY ? 1.f : fast_exp2(m_old - m_new);
}

__device__ __forceinline__ uint32_t pack2(float a, float b, bool f16) {
  if (f16) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

// byte offset of the 16-byte piece `piece` (0..7) of row `row` in a 64-row x 128-byte chunk laid
// out with the 128-byte swizzle (what TMA SWIZZLE_128B writes and wgmma's 128B mode reads)
__device__ __forceinline__ int sw128_off(int row, int piece) {
  return row * 128 + ((piece ^ (row & 7)) << 4);
}

// 2 fp8-e4m3 (the low or, kHigh, the high 16 bits of v) -> 2 fp16 (one u32). Through PTX's
// half-register operand ptxas picks the half with F2FP's .H1 selector; the intrinsic on v >> 16 cost
// one more integer instruction per pair, and the fp8 expansion is bound by its issue slots
template <bool kHigh>
__device__ __forceinline__ uint32_t e4m3x2_to_h2(uint32_t v) {
  uint32_t d;
  if (kHigh) asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h;}" : "=r"(d) : "r"(v));
  else asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l;}" : "=r"(d) : "r"(v));
  return d;
}

// The dynamic shared memory, its base rounded up to 1024 bytes (the 128-byte swizzle's atom): the
// kernels allocate 1 KB of slack for this.
// (an offset from raw, not a rounded integer: a pointer rebuilt from an integer is generic, and
// every access through it would be a generic LD / ST instead of LDS / STS)
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
}

// Two bf16 (one u32) -> two fp16 scaled by 1/16: the fp8 path's Q, which the kernels keep in fp16
// and whose factor 16 they fold back into the softmax scale.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2_div16(uint32_t v) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return pack2(f.x * 0.0625f, f.y * 0.0625f, true);
}
__device__ __forceinline__ uint4 bf16x8_to_f16x8_div16(uint4 w) {
  return make_uint4(bf16x2_to_f16x2_div16(w.x), bf16x2_to_f16x2_div16(w.y),
                    bf16x2_to_f16x2_div16(w.z), bf16x2_to_f16x2_div16(w.w));
}

// Visible length of this thread's two accumulator rows r0, r0 + 8 of the M tile at m0: folded row
// m = j*H + h sees n - (Q-1-j) tokens; rows past the request's see none.
__device__ __forceinline__ void visible_lengths(const Params& p, int n, int m0, int r0, int* vis) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = m0 + r0 + 8 * h;
    vis[h] = m < p.rows_per_req ? max(n - (p.q_per_req - 1 - m / p.heads), 0) : 0;
  }
}

// 16 fp8-e4m3 (two u32 pairs) -> 8 fp16 (one uint4)
__device__ __forceinline__ uint4 e4m3x8_to_h8(uint32_t lo, uint32_t hi) {
  return make_uint4(e4m3x2_to_h2<false>(lo), e4m3x2_to_h2<true>(lo), e4m3x2_to_h2<false>(hi),
                    e4m3x2_to_h2<true>(hi));
}

// How many splits a request of n tokens spreads over (SplitRule); the merge reads only these, and
// the grid's other splits of the request write lse = -inf.
__device__ __forceinline__ int active_splits(int n, int num_splits, const SplitRule& r) {
  const int nblk = (n + kPage - 1) / kPage;
  const int spread = max(min((nblk + r.min_blocks - 1) / r.min_blocks, r.wave_splits), 1);
  return nblk >= num_splits * r.full_blocks ? num_splits : spread;
}

// The blocks [blo, blo + nblk) that split `split` of a request of n tokens reads (nblk = 0 past its
// active splits). A request on one split (active == 1) needs no merge: that CTA writes the bf16
// output itself and the merge kernel skips the request's rows (at 48 heads, batch 32, 1K context
// every request is on one of the plan's four splits, and fp32 partials and the merge would take
// 10 of 53 us).
struct SplitRange {
  int n, blo, nblk, active;
  __device__ __forceinline__ bool split_out() const { return active > 1; }
};
__device__ __forceinline__ SplitRange split_range(const Params& p, int n, int split) {
  const int nblk_all = (n + kPage - 1) / kPage;
  const int active = active_splits(n, p.num_splits, p.rule);
  const int per = (nblk_all + active - 1) / active;
  const int blo = split * per;
  return {n, blo, max(min(blo + per, nblk_all) - blo, 0), active};
}

// Scale a score tile by `scale` and mask it (token >= visible length -> -inf, which also replaces
// NaN read from slots past the length); mx = the rows' maxima over the quad. kGroups 8-token column
// groups of the wgmma accumulator (8: the pair kernel's 64-token tile).
template <int kGroups>
__device__ __forceinline__ void mask_rowmax(float* s, int tok0, const int* vis, float scale,
                                            int quad, float* mx) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int pos = tok0 + 8 * j + 2 * quad + e;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = s[4 * j + 2 * h + e] * scale;
        v = pos < vis[h] ? v : -INFINITY;
        s[4 * j + 2 * h + e] = v;
        mx[h] = fmaxf(mx[h], v);
      }
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
  }
}

// A CTA with nothing to read: lse = -inf (and out = 0 where its request needs no merge) for its
// `rows` rows (<= 64), tile row r being row_of(r) of the outputs.
template <typename RowOf>
__device__ __forceinline__ void write_unseen_rows(const Params& p, int rows, RowOf row_of,
                                                  int split, bool split_out, int tid) {
  if (!split_out && split != 0) return;  // split 0 writes the request's rows
  for (int r = tid; r < 64; r += kThreads) {
    if (r < rows) {
      if (split_out) p.part_lse[row_of(r) * p.num_splits + split] = -INFINITY;
      else p.lse[row_of(r)] = -INFINITY;
    }
  }
  if (!split_out) {
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(p.out);
    for (int i = tid; i < 64 * (kDV / 8); i += kThreads) {
      const int r = i / (kDV / 8);
      if (r < rows)
        *reinterpret_cast<uint4*>(out + row_of(r) * kDV + (i % (kDV / 8)) * 8) =
            make_uint4(0, 0, 0, 0);
    }
  }
}
// (the pair kernels' tiles: 64 consecutive folded rows from m0)
__device__ __forceinline__ void write_unseen(const Params& p, long row_base, int m0, int split,
                                             bool split_out, int tid) {
  write_unseen_rows(p, p.rows_per_req - m0, [&](int r) { return row_base + r; }, split, split_out,
                    tid);
}

// The pair kernel's epilogue: warpgroup wg holds columns 256wg.. of its rows r0, r0+8 in acc
// (the wgmma m64n256 accumulator layout) and per-thread partial row sums, all relative to the
// row max `row_max`; total the sums over the quad and both warpgroups (through `ssum`, 128
// floats, and named barrier bar_id), normalise, and write 16-bit rows + LSE: the bf16 output, or
// with split-K the split's partial (O normalised by its own sum; fp32 LSE): bf16 for a bf16 cache,
// fp16 for an fp8 one (kFp8), kept in the cache's units (a convex combination of fp8 values,
// |O| <= 448, so fp16 cannot overflow; the merge applies kv_scale), which keeps fp8's error at its
// fp16 level. The tile goes through shared memory at `stage` (64 KB, free once both warpgroups are
// past their last Q·K^T: the Q tile) so that it leaves in whole 16-byte rows' pieces: written
// straight from the accumulator layout, a warp's store covers 16 bytes of each of 8 rows, half a
// sector, and the epilogue takes 6-9 us at 48-96 heads (the timeline build). 16-bit
// partials halve the bytes written and read back by the merge (up to 113 partials a row at batch
// 1: 3-11% there) and add one rounding to the result, which is bf16 anyway. `mark(i)` runs at its
// steps (i = 0: the row sums exchanged, 1: the tile staged); the timeline build stamps them, the
// production build passes a no-op.
template <bool kFp8, typename Mark>
__device__ __forceinline__ void store_rows(const Params& p, const float* acc, float* row_sum,
                                           const float* row_max, float* ssum, uint32_t stage,
                                           int bar_id, long row_base, int m0, int split,
                                           bool split_out, int wg, int r0, int quad, Mark mark) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 2);
  }
  if (quad == 0) {
    ssum[wg * 64 + r0] = row_sum[0];
    ssum[wg * 64 + r0 + 8] = row_sum[1];
  }
  named_bar(bar_id, kThreads);
  mark(0);
  const bool f16 = kFp8 && split_out;  // an fp8 cache's partial: fp16, in the cache's units
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (m0 + r >= p.rows_per_req) continue;
    const float l = ssum[r] + ssum[64 + r];
    // a row that saw no token: lse -inf and zeros (a merge never reads such a partial)
    const float inv = l > 0.f ? (f16 ? 1.f : p.out_scale) / l : 0.f;
    if (wg == 0 && quad == 0) {
      const float lse = l > 0.f ? (row_max[h] + __log2f(l)) * 0.69314718055994531f : -INFINITY;
      const long g = row_base + r;
      if (split_out) p.part_lse[g * p.num_splits + split] = lse;
      else p.lse[g] = lse;
    }
    // row r of the tile = 64 pieces of 16 bytes, piece c at (c ^ (r & 7)): conflict-free for the
    // warp's 8 rows x 4 quads
#pragma unroll
    for (int j = 0; j < 32; ++j)
      st_shared(stage + r * 1024 + (((wg * 32 + j) ^ (r & 7)) << 4) + quad * 4,
                pack2(acc[4 * j + 2 * h] * inv, acc[4 * j + 2 * h + 1] * inv, f16));
  }
  mark(1);
  named_bar(bar_id, kThreads);
  // row g of the output, or its split's slot of the partials
  uint16_t* dst = split_out ? p.part_o + static_cast<long>(split) * kDV
                            : reinterpret_cast<uint16_t*>(p.out);
  const long stride = split_out ? static_cast<long>(p.num_splits) * kDV : kDV;
  for (int i = threadIdx.x; i < 64 * 64; i += kThreads) {
    const int r = i >> 6, c = i & 63;
    if (m0 + r < p.rows_per_req)
      *reinterpret_cast<uint4*>(dst + (row_base + r) * stride + c * 8) =
          ld_shared_v4(stage + r * 1024 + ((c ^ (r & 7)) << 4));
  }
}

// Rows valid..63 of a block's four 8 KB value chunks (64 rows x 128 B from base) set to zero by
// one warpgroup's 128 threads: the sequence's last block, whose slots past the length may hold NaN
// (and 0 * NaN would poison P·V). Callers that multiply the chunks by wgmma add the proxy fence.
__device__ __forceinline__ void zero_tail_rows(uint32_t base, int valid, int t) {
  if (valid >= kPage) return;
  for (int x = t; x < (kPage - valid) * 32; x += 128) {  // 32 pieces of 16 B a row
    const int r = valid + (x >> 5);
    st_shared_zero16(base + ((x >> 3) & 3) * kChunkBytes + r * 128 + (x & 7) * 16);
  }
}

// Raises a kernel's dynamic shared-memory limit. Callers keep the result in a function-local static,
// so the driver call runs once per kernel, not on every launch.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                              cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

}  // namespace k3mla
