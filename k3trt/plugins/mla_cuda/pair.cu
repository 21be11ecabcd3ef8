// SM90 kernel for k3trt::mla_verify, "pair" schedule: the two consumer warpgroups take the
// 64-token blocks of a split two at a time, block A = 2j for warpgroup 0 and block B = 2j+1 for
// warpgroup 1. Each computes the whole 64x64 score tile of its block (wgmma m64n64, Q from shared
// memory), so one warpgroup's softmax runs while the other's MMAs keep the tensor pipe busy, and
// each owns 256 of the 512 output columns (64x256 fp32 accumulator):
//
//   WG0: softmax(S_A) -> m_A, P_A; O_0 *= scale_A;  O_0 += P_A V_A[:, 0:256]     (P from registers)
//   WG1: (m_A)  softmax(S_B) -> m_B, P_B; O_1 *= scale_A*scale_B;
//        O_1 += P_B V_B[:, 256:512] (registers);  O_1 += P_A' V_A[:, 256:512] (P_A' from smem)
//   WG0: (m_B)  P_A' = P_A * scale_B -> smem;  O_0 *= scale_B;  O_0 += P_B V_B[:, 0:256] (smem)
//   then each issues the next pair's Q·K^T (WG0 on A+2, WG1 on B+2) as its chunks land.
// The running max is lazy (kLazyMax), so the scale factors are almost always 1 and skipped.
// (fp8: WG1 runs B's softmax and P·V against its own max before it reads m_A, and rescales in the
// rare pair where A moved the max past it; see the WG1 loop.)
//
// The row maxima go through shared memory (WG0's after A, WG1's after B; each warpgroup derives its
// factors from the two), ordered by four named barriers (A ready, B ready, P_A written, WG1's P·V
// issued). Each warpgroup reloads (TMA) the chunks of a stage as soon as its last wgmma reading
// them has completed: WG0 value chunks 0..3 (+ the rope chunk of A), WG1 value chunks 4..7 (+ the
// rope chunk of B), and multiplies the chunks it reloaded first.
//
// Shared memory (226 KB): Q chunks 0..7 (64 KB; the rope chunk 8 of Q is held in registers as
// the A fragment of its four QK^T wgmmas, which frees 8 KB: TMA lands it in P_B's tile, which is
// free until the first P_B), two 72 KB stages, P_A and P_B (8 KB each), row statistics and 19
// mbarriers (9 per stage, 1 for the Q tile). fp8 cache: TMA lands the raw bytes in the upper
// half of each 8 KB chunk slot and the warpgroup that multiplies the block expands it in place to
// fp16 (Q, P and the MMAs then run in fp16, Q pre-scaled by 1/16).
//
// The contract both verify kernels keep. One CTA = (M tile or head group of one request, split of
// its KV sequence); the split rule (SplitRange, common.cuh) gives it blocks [blo, blo + nblk).
// Scores of tokens past a row's visible length are -inf (which also replaces NaN read from cache
// slots past the length), and the value rows of those slots are zeroed before P·V (0 * NaN would
// poison it). The epilogue writes O (bf16) and LSE, or with split-K a 16-bit partial (bf16; fp16 in
// the cache's units for an fp8 cache) + fp32 LSE per split ([rows, splits, 512]) that the merge
// (merge.cu) combines. A request the split rule keeps on one split gets its bf16 O and LSE from that
// CTA, and the merge skips its rows. The verify kernels call pdl_launch_dependents at entry so the
// merge's CTAs start while their last ones run. Every mbarrier wait is bounded
// (MLA_WAIT_TIMEOUT_NS): on a timeout the kernel records a code (kErr*, mla_constants.h) in `err`
// and carries on with garbage instead of hanging the GPU, so a broken pipeline shows up as a
// readable error, not a stuck process.

#include "kernels.h"

namespace k3mla {

// Timeline build (-DMLA_TIMELINE, built by benchmarks/mla_verify.py --timeline): per-CTA stamps,
// read back by timeline_copy. Slots: 0 globaltimer at entry, 1..7 clock64 at entry / barriers ready
// / Q loaded / first score tile / WG0 loop end / WG1 loop end / epilogue end, 8 globaltimer at exit,
// 9 SM id, 10..11 clock64 inside the epilogue (store_rows: row sums exchanged / tile staged, output
// or partial). In the production build MLA_STAMP is empty (its value is not even evaluated).
#ifdef MLA_TIMELINE
constexpr int kTimelineSlots = 12, kTimelineCtas = 8192;
static __device__ unsigned long long g_timeline[kTimelineCtas * kTimelineSlots];
__device__ __forceinline__ unsigned long long clock_now() {
  unsigned long long v;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(v));
  return v;
}
__device__ __forceinline__ unsigned long long sm_id() {
  unsigned v;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(v));
  return v;
}
__device__ __forceinline__ void stamp(int slot, unsigned long long v) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta < kTimelineCtas) g_timeline[cta * kTimelineSlots + slot] = v;
}
#define MLA_STAMP(cond, slot, value) \
  do {                               \
    if (cond) stamp(slot, value);    \
  } while (0)
#else
#define MLA_STAMP(cond, slot, value) \
  do {                               \
  } while (0)
#endif

namespace pair {

constexpr int kSmemQ = 0;                            // Q chunks 0..7
constexpr int kSmemKV = 8 * kChunkBytes;             // 2 stages of 9 chunks
constexpr int kSmemPA = kSmemKV + 2 * kBlockBytes;   // P_A' (64x64 bf16, swizzled, K-major)
constexpr int kSmemPB = kSmemPA + kChunkBytes;       // P_B
constexpr int kSmemMA = kSmemPB + kChunkBytes;       // float[64]: warpgroup 0's max after A
constexpr int kSmemMB = kSmemMA + 256;               // float[64]: warpgroup 1's max after B
constexpr int kSmemSum = kSmemMB + 256;              // float[2][64]
constexpr int kSmemBar = kSmemSum + 512;             // 2 x 9 mbarriers, then Q's
constexpr int kSmemUsed = kSmemBar + (2 * kChunks + 1) * 8;  // + the Q tile's
constexpr int kSmemAlloc = kSmemUsed + 1024;
static_assert(kSmemAlloc <= 232448, "shared memory over the sm_90 limit");

// named barriers (0 is __syncthreads)
constexpr int kBarAReady = 1, kBarBReady = 2, kBarPAWritten = 3, kBarWG1Issued = 4, kBarSum = 5,
              kBarExpand = 6,  // + warpgroup: its 128 threads only (fp8 expansion)
              kBarWG1Vote = 8;  // warpgroup 1's 128 threads: a rescale after its P·V of B

// the wgmma shapes of this kernel for 16-bit inputs: bf16 (bf16 cache) or fp16 (fp8 cache, expanded)
template <bool kF16>
__device__ __forceinline__ void mma_qk(float* s, uint64_t da, uint64_t db, bool first) {
  if (first) {
    if (kF16) wgmma_m64n64k16_f16_nn_zero(s, da, db);  // s is not an input
    else wgmma_m64n64k16_bf16_nn_zero(s, da, db);
  } else {
    if (kF16) wgmma_m64n64k16_f16_nn(s, da, db, 1);
    else wgmma_m64n64k16_bf16_nn(s, da, db, 1);
  }
}
template <bool kF16>
__device__ __forceinline__ void mma_qk_rs(float* s, const uint32_t* a, uint64_t db) {
  if (kF16) wgmma_m64n64k16_f16_rs_nn(s, a, db, 1);
  else wgmma_m64n64k16_bf16_rs_nn(s, a, db, 1);
}
template <bool kF16>
__device__ __forceinline__ void mma_pv_rs(float* acc, const uint32_t* a, uint64_t db) {
  if (kF16) wgmma_m64n256k16_f16_rs_tn(acc, a, db, 1);
  else wgmma_m64n256k16_bf16_rs_tn(acc, a, db, 1);
}
template <bool kF16>
__device__ __forceinline__ void mma_pv_ss(float* acc, uint64_t da, uint64_t db) {
  if (kF16) wgmma_m64n256k16_f16_tn(acc, da, db, 1);
  else wgmma_m64n256k16_bf16_tn(acc, da, db, 1);
}

// the idx-th chunk a warpgroup multiplies: the ones it reloaded itself first (kFirst = 0: chunks
// 0..3, rope, 4..7 for WG0; kFirst = 4: 4..7, rope, 0..3 for WG1), which were issued earliest
template <int kFirst>
__device__ __forceinline__ constexpr int chunk_at(int idx) {
  return idx < 4 ? kFirst + idx : (idx == 4 ? 8 : (kFirst ^ 4) + idx - 5);
}

// Q·K^T of one block into s (64x64 fp32), chunk by chunk as their mbarriers say they landed, one
// commit group per chunk; the fence after each wait keeps ptxas from inserting its own (which
// serialises the wgmmas). fp8: three chunks at a time, this warpgroup first expands the raw bytes
// (upper half of each 8 KB slot) in place to fp16 in the swizzled layout -- read all, barrier,
// write all, fence, barrier -- for its own Q·K^T and for the other warpgroup's P·V on the block.
template <int kFirst, bool kFp8>
__device__ __forceinline__ void qk_block(float* s, uint32_t sbase, uint32_t kv, uint32_t bars,
                                         uint32_t parity, const uint32_t* q8, int* err, int blk,
                                         int t, int wg) {
  const uint64_t qd = sw128_desc(sbase + kSmemQ, 16, 1024);
  const uint64_t kd = sw128_desc(kv, 16, 1024);
#pragma unroll
  for (int g = 0; g < 3; ++g) {
    if (kFp8) {
      uint4 raw[6];
#pragma unroll
      for (int u = 0; u < 3; ++u) {
        const int c = chunk_at<kFirst>(3 * g + u);
        mbar_wait(bars + 8 * c, parity, err, kErrKvChunk, blk, c);
#pragma unroll
        for (int k = 0; k < 2; ++k) {  // 16-byte piece x of 256: row x/4, fp8 columns 16(x%4)..
          const int x = t + 128 * k;
          raw[2 * u + k] = ld_shared_v4(kv + c * kChunkBytes + kChunkBytes / 2 + x * 16);
        }
      }
      named_bar(kBarExpand + wg, 128);
#pragma unroll
      for (int u = 0; u < 3; ++u) {
        const uint32_t chunk = kv + chunk_at<kFirst>(3 * g + u) * kChunkBytes;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int x = t + 128 * k, r = x >> 2, col = x & 3;
          const uint4 v = raw[2 * u + k];
          st_shared(chunk + sw128_off(r, 2 * col), e4m3x8_to_h8(v.x, v.y));
          st_shared(chunk + sw128_off(r, 2 * col + 1), e4m3x8_to_h8(v.z, v.w));
        }
      }
      fence_proxy_async();
      named_bar(kBarExpand + wg, 128);
      wgmma_fence();
    }
#pragma unroll
    for (int u = 0; u < 3; ++u) {
      const int c = chunk_at<kFirst>(3 * g + u);
      if (!kFp8) {
        mbar_wait(bars + 8 * c, parity, err, kErrKvChunk, blk, c);
        wgmma_fence();
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // descriptors count 16-byte units: +2 per 32 bytes
        const uint64_t db = kd + (c * kChunkBytes + 32 * k) / 16;
        if (c == 8) mma_qk_rs<kFp8>(s, q8 + 4 * k, db);  // the rope chunk: Q from registers
        else mma_qk<kFp8>(s, qd + (c * kChunkBytes + 32 * k) / 16, db, g == 0 && u == 0 && k == 0);
      }
      if (!kFp8) wgmma_commit();
    }
    if (kFp8) wgmma_commit();
  }
}

// O_half += P · V[:, 256*half ...]: P from registers (a[16]) or from a shared-memory tile
template <bool kF16>
__device__ __forceinline__ void pv_regs(float* acc, const uint32_t* a, uint32_t kv, int half) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 128; ++k) pin(acc[k]);
#pragma unroll
  for (int k = 0; k < 4; ++k)
    mma_pv_rs<kF16>(acc, a + 4 * k,
                    sw128_desc(kv + half * 4 * kChunkBytes + k * 16 * 128, kChunkBytes, 1024));
  wgmma_commit();
}
template <bool kF16>
__device__ __forceinline__ void pv_smem(float* acc, uint32_t sp, uint32_t kv, int half) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 128; ++k) pin(acc[k]);
#pragma unroll
  for (int k = 0; k < 4; ++k)
    mma_pv_ss<kF16>(acc, sw128_desc(sp + 32 * k, 16, 1024),
                    sw128_desc(kv + half * 4 * kChunkBytes + k * 16 * 128, kChunkBytes, 1024));
  wgmma_commit();
}

// s <- exp2(s - m) in place; returns this thread's partial row sums
__device__ __forceinline__ void exp_rows(float* s, const float* m, float* sum) {
  sum[0] = sum[1] = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = fast_exp2(s[4 * j + 2 * h + e] - m[h]);
        s[4 * j + 2 * h + e] = v;
        sum[h] += v;
      }
}

// the score accumulator's layout is the A fragment of the P·V wgmma (k-slice k = tokens 16k..)
template <bool kF16>
__device__ __forceinline__ void pack_a(const float* s, uint32_t* a) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[4 * k + i] = pack2(s[8 * k + 2 * i], s[8 * k + 2 * i + 1], kF16);
}

// byte offset, in a 64x64 16-bit tile (K-major, 128-byte swizzle), of A-fragment register 4k+i:
// row r0 + 8(i&1), columns 16k + 8(i>>1) + 2quad, +1
__device__ __forceinline__ int frag_off(int k, int i, int r0, int quad) {
  return sw128_off(r0 + 8 * (i & 1), 2 * k + (i >> 1)) + quad * 4;
}

// P -> shared 64x64 tile from its A fragment (16-bit pairs) times a per-row factor
template <bool kF16>
__device__ __forceinline__ void store_p(uint32_t tile, const uint32_t* a, const float* f, int r0,
                                        int quad) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = i & 1;
      uint32_t v = a[4 * k + i];
      if (f != nullptr) {
        const float2 x = kF16 ? __half22float2(*reinterpret_cast<const __half2*>(&v))
                              : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
        v = pack2(x.x * f[h], x.y * f[h], kF16);
      }
      st_shared(tile + frag_off(k, i, r0, quad), v);
    }
}

// P -> its shared tile for the other warpgroup, times f where `scaled` (two calls: a factor pointer
// chosen at run time would put f in local memory)
template <bool kF16>
__device__ __forceinline__ void store_p_scaled(uint32_t tile, const uint32_t* a, const float* f,
                                               bool scaled, int r0, int quad) {
  if (scaled) store_p<kF16>(tile, a, f, r0, quad);
  else store_p<kF16>(tile, a, nullptr, r0, quad);
}

// the pair's max from this warpgroup's (mine) and the other's (in shared memory at s_other), and
// the factor f taking this warpgroup's sums from its own max to it
__device__ __forceinline__ void pair_max(const float* mine, uint32_t s_other, float* m_run, float* f) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m_run[h] = fmaxf(mine[h], ld_shared_f32(s_other + 32 * h));
    f[h] = rescale_factor(mine[h], m_run[h]);
  }
}
__device__ __forceinline__ bool warp_not_one(const float* f) {
  return __any_sync(~0u, f[0] != 1.f || f[1] != 1.f);
}

__device__ __forceinline__ void scale_acc(float* acc, const float* f) {
#pragma unroll
  for (int k = 0; k < 128; ++k) acc[k] *= f[(k >> 1) & 1];
}

// value rows past the length in the sequence's last block: zero this warpgroup's four value
// chunks of the stage (the cache may hold NaN there, and 0 * NaN would poison P·V)
__device__ __forceinline__ void zero_tail(uint32_t stage, int half, int valid, int t) {
  if (valid >= kPage) return;
  zero_tail_rows(stage + half * 4 * kChunkBytes, valid, t);
  fence_proxy_async();
}

// TMA of block blk's value chunks c_lo..c_hi (and the rope chunk, with `rope`) into its stage
template <bool kFp8>
struct KvIssue {
  const CUtensorMap* map;
  uint32_t sbase, bar0;
  __device__ __forceinline__ void operator()(int blk, int page, int c_lo, int c_hi, bool rope) const {
    const int stage = blk & 1;
    for (int c = c_lo; c <= (rope ? c_hi + 1 : c_hi); ++c) {
      const int cc = c > c_hi ? 8 : c;
      const uint32_t bar = bar0 + 8 * (stage * kChunks + cc);
      mbar_expect_tx(bar, kFp8 ? kChunkBytes / 2 : kChunkBytes);  // fp8: upper half of the slot
      tma_load_2d(sbase + kSmemKV + stage * kBlockBytes + cc * kChunkBytes + (kFp8 ? kChunkBytes / 2 : 0),
                  map, cc * 64, page * kPage, bar);
    }
  }
};

// What both warpgroups' loops read: the CTA's blocks [blo, blo + nblk) of a request of n tokens,
// its pages, shared memory and this thread's place in the accumulator layout.
struct Loop {
  const int* bt;
  int nblk, blo, n, npairs, tail_blk;  // tail_blk: local index of the sequence's last block
  uint32_t sbase, bar0, kv0, kv1;
  uint32_t sMA, sMB;           // this thread's rows of the two warpgroups' maxima
  int t, quad, r0, wg;
};

// The Q tile's rope chunk as the A fragment of its four Q·K^T wgmmas (q8, from P_B's tile where TMA
// landed it); fp8: Q / 16 in fp16, the fragment and the tile in place (elementwise: the swizzle
// holds).
template <bool kFp8>
__device__ __forceinline__ void q_prologue(uint32_t sbase, uint32_t* q8, int tid, int r0, int quad) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t v = ld_shared_u32(sbase + kSmemPB + frag_off(k, i, r0, quad));
      q8[4 * k + i] = kFp8 ? bf16x2_to_f16x2_div16(v) : v;
    }
  if (kFp8) {
#pragma unroll 4
    for (int i = tid; i < 8 * kChunkBytes / 16; i += kThreads) {
      const uint32_t a = sbase + kSmemQ + 16 * i;
      st_shared(a, bf16x8_to_f16x8_div16(ld_shared_v4(a)));
    }
    fence_proxy_async();
  }
}

// Warpgroup 0: block A = 2j of each pair. Q·K^T(A), softmax against the running max (published for
// warpgroup 1), P_A · V_A[:, 0:256] from registers; then, with warpgroup 1's max after B, P_A
// rescaled to the pair's max into shared memory for warpgroup 1, and P_B · V_B[:, 0:256] from
// shared memory. It refills chunks 0..3 (+ A's rope chunk) of each stage once its wgmmas on them
// retired.
template <bool kFp8>
__device__ __forceinline__ void wg0_pairs(const Params& p, const Loop& L, const KvIssue<kFp8>& issue,
                                          const uint32_t* q8, const int* vis, float* acc, float* s,
                                          float* m_run, float* lsum) {
  const int t = L.t, quad = L.quad, r0 = L.r0;
  uint32_t pa[16];
#pragma unroll 1
  for (int j = 0; j < L.npairs; ++j) {
    const int ia = 2 * j, ib = ia + 1;
    const bool has_b = ib < L.nblk;
    qk_block<0, kFp8>(s, L.sbase, L.kv0, L.bar0, j & 1, q8, p.err, L.blo + ia, t, L.wg);
    wgmma_wait<0>();
    MLA_STAMP(t == 0 && j == 0, 4, clock_now());
#pragma unroll
    for (int k = 0; k < 32; ++k) pin(s[k]);
    int pg_a = 0, pg_b = 0;  // pages of the next pair (read early, used after the frees)
    if (t == 0) {
      if (ia + 2 < L.nblk) pg_a = __ldg(L.bt + ia + 2);
      if (ib + 2 < L.nblk) pg_b = __ldg(L.bt + ib + 2);
    }
    // softmax of A against the running max
    float mx[2], mu[2], sa[2], ps[2], ma[2];
    mask_rowmax<8>(s, (L.blo + ia) * kPage, vis, p.scale_log2, quad, mx);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ma[h] = lazy_max(m_run[h], mx[h]);
      mu[h] = ma[h] == -INFINITY ? 0.f : ma[h];
      sa[h] = rescale_factor(m_run[h], ma[h]);
    }
    if (quad == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) st_shared(L.sMA + 32 * h, ma[h]);
    }
    named_arrive(kBarAReady);
    exp_rows(s, mu, ps);
#pragma unroll
    for (int h = 0; h < 2; ++h) lsum[h] = lsum[h] * sa[h] + ps[h];
    if (warp_not_one(sa)) scale_acc(acc, sa);
    pack_a<kFp8>(s, pa);
    if (ia == L.tail_blk) zero_tail(L.kv0, 0, L.n - (L.blo + ia) * kPage, t);
    pv_regs<kFp8>(acc, pa, L.kv0, 0);

    // the pair's max (ours after A, WG1's after B) -> P_A rescaled to it for WG1, and our
    // accumulator too
    named_bar(kBarBReady, kThreads);
    float sb[2];
    pair_max(ma, L.sMB, m_run, sb);
    // (fp8: always; the branch there costs warpgroup 0 registers that it spills)
    const bool rescale_b = kFp8 || warp_not_one(sb);
    store_p_scaled<kFp8>(L.sbase + kSmemPA, pa, sb, rescale_b, r0, quad);
    fence_proxy_async();
    named_arrive(kBarPAWritten);
    wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < 128; ++k) pin(acc[k]);
    if (t == 0 && ia + 2 < L.nblk) issue(ia + 2, pg_a, 0, 3, true);  // chunks 0..3 and rope
    if (rescale_b) scale_acc(acc, sb);
#pragma unroll
    for (int h = 0; h < 2; ++h) lsum[h] *= sb[h];

    named_bar(kBarWG1Issued, kThreads);
    if (has_b) {
      if (ib == L.tail_blk) zero_tail(L.kv1, 0, L.n - (L.blo + ib) * kPage, t);
      pv_smem<kFp8>(acc, L.sbase + kSmemPB, L.kv1, 0);
      wgmma_wait<0>();
#pragma unroll
      for (int k = 0; k < 128; ++k) pin(acc[k]);
      if (t == 0 && ib + 2 < L.nblk) issue(ib + 2, pg_b, 0, 3, false);
    }
  }
  MLA_STAMP(t == 0, 5, clock_now());
}

// Warpgroup 1, bf16 cache: softmax of B against warpgroup 0's max after A (the pair's max is ours
// after B), P_B to shared memory for warpgroup 0, P_B · V_B[:, 256:512] from registers.
__device__ __forceinline__ void wg1_softmax_b(const Params& p, const Loop& L, int ib, bool has_b,
                                              const float* mx, float* acc, float* s, float* m_run,
                                              float* lsum, uint32_t* pb) {
  float mb[2], mu[2];
  named_bar(kBarAReady, kThreads);
  float f[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float ma = ld_shared_f32(L.sMA + 32 * h);
    mb[h] = has_b ? lazy_max(ma, mx[h]) : ma;
    mu[h] = mb[h] == -INFINITY ? 0.f : mb[h];
    f[h] = rescale_factor(m_run[h], mb[h]);
    m_run[h] = mb[h];
  }
  if (L.quad == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) st_shared(L.sMB + 32 * h, mb[h]);
  }
  named_arrive(kBarBReady);
  if (warp_not_one(f)) scale_acc(acc, f);
  if (has_b) {
    float ps[2];
    exp_rows(s, mu, ps);
#pragma unroll
    for (int h = 0; h < 2; ++h) lsum[h] = lsum[h] * f[h] + ps[h];
    pack_a<false>(s, pb);
    store_p<false>(L.sbase + kSmemPB, pb, nullptr, L.r0, L.quad);
    if (ib == L.tail_blk) zero_tail(L.kv1, 1, L.n - (L.blo + ib) * kPage, L.t);
    fence_proxy_async();
    pv_regs<false>(acc, pb, L.kv1, 1);
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) lsum[h] *= f[h];
  }
}

// Warpgroup 1, fp8 cache: softmax of B against our own running max, without waiting for WG0's
// max of A. B's P·V is issued first, and only when A moved the max past ours (rare, with lazy
// rescaling) is our accumulator rescaled after it (which needs the wgmma's completion, so the
// whole warpgroup votes). P_B is stored for WG0 after kBarAReady, which WG0 reaches only once its
// P·V has read the previous P_B. This order leaves the fp8 build without spills (the bf16 order
// spills 28 / 52 bytes there) and is 1-3% faster in fp8; in bf16 it is 1-2.5% slower.
__device__ __forceinline__ void wg1_softmax_b_fp8(const Params& p, const Loop& L, int ib,
                                                  bool has_b, const float* mx, float* acc,
                                                  float* s, float* m_run, float* lsum,
                                                  uint32_t* pb) {
  float mb[2], mu[2];
  float sb[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mb[h] = has_b ? lazy_max(m_run[h], mx[h]) : m_run[h];
    mu[h] = mb[h] == -INFINITY ? 0.f : mb[h];
    sb[h] = rescale_factor(m_run[h], mb[h]);
  }
  if (L.quad == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) st_shared(L.sMB + 32 * h, mb[h]);
  }
  named_arrive(kBarBReady);
  // (nothing is in flight here; without this wait ptxas cannot tell, and serialises every
  // wgmma of the kernel: C7515)
  wgmma_wait<0>();
  if (warp_not_one(sb)) scale_acc(acc, sb);
  if (has_b) {
    float ps[2];
    exp_rows(s, mu, ps);
#pragma unroll
    for (int h = 0; h < 2; ++h) lsum[h] = lsum[h] * sb[h] + ps[h];
    pack_a<true>(s, pb);
    if (ib == L.tail_blk) zero_tail(L.kv1, 1, L.n - (L.blo + ib) * kPage, L.t);
    pv_regs<true>(acc, pb, L.kv1, 1);
  }
  // the pair's max: WG0's after A and ours after B
  named_bar(kBarAReady, kThreads);
  float fb[2];
  pair_max(mb, L.sMA, m_run, fb);
#pragma unroll
  for (int h = 0; h < 2; ++h) lsum[h] *= fb[h];
  const bool rescale = warp_not_one(fb);
  if (has_b) {
    store_p_scaled<true>(L.sbase + kSmemPB, pb, fb, rescale, L.r0, L.quad);
    fence_proxy_async();
  }
  if (warpgroup_any(rescale, kBarWG1Vote)) {
    wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < 128; ++k) pin(acc[k]);
    if (rescale) scale_acc(acc, fb);
  }
}

// Warpgroup 1: block B = 2j + 1 of each pair. Q·K^T(B), B's softmax and P_B · V_B[:, 256:512]
// (wg1_softmax_b / _fp8), then P_A' · V_A[:, 256:512] from the tile warpgroup 0 wrote. It refills
// chunks 4..7 (+ B's rope chunk) of each stage once its wgmmas on them retired.
template <bool kFp8>
__device__ __forceinline__ void wg1_pairs(const Params& p, const Loop& L, const KvIssue<kFp8>& issue,
                                          const uint32_t* q8, const int* vis, float* acc, float* s,
                                          float* m_run, float* lsum) {
  const int t = L.t, quad = L.quad;
  uint32_t pb[16];
#pragma unroll 1
  for (int j = 0; j < L.npairs; ++j) {
    const int ia = 2 * j, ib = ia + 1;
    const bool has_b = ib < L.nblk;
    if (has_b) {
      qk_block<4, kFp8>(s, L.sbase, L.kv1, L.bar0 + 8 * kChunks, j & 1, q8, p.err, L.blo + ib,
                        t, L.wg);
      wgmma_wait<0>();
#pragma unroll
      for (int k = 0; k < 32; ++k) pin(s[k]);
    }
    int pg_a = 0, pg_b = 0;
    if (t == 0) {
      if (ia + 2 < L.nblk) pg_a = __ldg(L.bt + ia + 2);
      if (ib + 2 < L.nblk) pg_b = __ldg(L.bt + ib + 2);
    }
    float mx[2];
    if (has_b) mask_rowmax<8>(s, (L.blo + ib) * kPage, vis, p.scale_log2, quad, mx);
    if (!kFp8) wg1_softmax_b(p, L, ib, has_b, mx, acc, s, m_run, lsum, pb);
    else wg1_softmax_b_fp8(p, L, ib, has_b, mx, acc, s, m_run, lsum, pb);
    named_bar(kBarPAWritten, kThreads);
    if (ia == L.tail_blk) zero_tail(L.kv0, 1, L.n - (L.blo + ia) * kPage, t);
    pv_smem<kFp8>(acc, L.sbase + kSmemPA, L.kv0, 1);
    named_arrive(kBarWG1Issued);
    wgmma_wait<1>();  // the local P·V of B (without B only one group is pending)
    if (t == 0 && has_b && ib + 2 < L.nblk) issue(ib + 2, pg_b, 4, 7, true);  // 4..7 and rope
    wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < 128; ++k) pin(acc[k]);
    if (t == 0 && ia + 2 < L.nblk) issue(ia + 2, pg_a, 4, 7, false);
  }
  MLA_STAMP(t == 0, 6, clock_now());
}

}  // namespace pair

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    mla_verify_sm90_pair_kernel(const __grid_constant__ CUtensorMap kv_map,
                                const __grid_constant__ CUtensorMap q_map, const Params p) {
  using namespace pair;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t sbase = smem_u32(smem);

  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  const int t = tid & 127;
  const int lane = t & 31;
  const int quad = lane & 3;
  const int r0 = ((t >> 5) << 4) + (lane >> 2);

  MLA_STAMP(tid == 0, 0, globaltimer());
  MLA_STAMP(tid == 0, 1, clock_now());
  pdl_launch_dependents();
  const int b = blockIdx.z;
  const int m0 = blockIdx.x * 64;
  const long row_base = static_cast<long>(b) * p.rows_per_req + m0;
  const uint32_t bar0 = sbase + kSmemBar;  // chunk c of stage s: bar0 + 8 * (9 s + c)
  const uint32_t qbar = bar0 + 8 * 2 * kChunks;
  // The Q tile comes by TMA, issued with the KV stream once the CTA knows it has blocks (a CTA
  // must not exit while a TMA still writes its shared memory, and at 48 heads, batch 32, 1K context
  // 288 of 384 CTAs have none): chunks 0..7 to shared memory, the rope chunk 8 to P_B's tile (free
  // until warpgroup 1's first P_B), from where each thread reads its A fragment of the chunk's four
  // Q·K^T wgmmas into registers (q8). Through registers, Q's 32 loads a thread queued ahead of the
  // length and the first page, and the KV stream started 2.3 us after entry at 48 heads, batch 32,
  // 1K context; by TMA, 0.85 us (the timeline build). Issuing Q at entry, before the length, is no
  // faster and makes the fp8 instance spill more. The last M tile's rows past the request hold
  // the next request's Q (zeros past the tensor): their visible length is 0, so their scores are
  // masked, and they are never stored.
  auto issue_q = [&] {
    mbar_expect_tx(qbar, kChunks * kChunkBytes);
    for (int c = 0; c < kChunks; ++c)
      tma_load_2d<false>(sbase + (c < 8 ? kSmemQ + c * kChunkBytes : kSmemPB), &q_map, c * 64,
                       static_cast<int>(row_base), qbar);
  };
  if (tid == 0) {
    for (int i = 0; i < 2 * kChunks + 1; ++i) mbar_init(bar0 + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async();
  }
  const int seq_len = p.seq_lens[b];
  const SplitRange sr = split_range(p, seq_len, blockIdx.y);
  if (sr.nblk == 0) {
    write_unseen(p, row_base, m0, blockIdx.y, sr.split_out(), tid);
    return;
  }
  const int nblk = sr.nblk, blo = sr.blo, n = sr.n;
  const int* bt = p.block_table + static_cast<long>(b) * p.bt_stride + blo;
  if (tid == 0) issue_q();
  __syncthreads();  // the mbarriers are initialised
  MLA_STAMP(tid == 0, 2, clock_now());

  const KvIssue<kFp8> issue{&kv_map, sbase, bar0};
  if (tid == 0) {
    issue(0, __ldg(bt), 0, 7, true);
    if (nblk > 1) issue(1, __ldg(bt + 1), 0, 7, true);
  }

  mbar_wait(qbar, 0, p.err, kErrQTile, 0, 0);
  uint32_t q8[16];
  q_prologue<kFp8>(sbase, q8, tid, r0, quad);
  __syncthreads();  // q8 read before P_B is written; fp8: Q converted
  MLA_STAMP(tid == 0, 3, clock_now());

  int vis[2];
  visible_lengths(p, n, m0, r0, vis);

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float s[32];
  float m_run[2] = {-INFINITY, -INFINITY};
  float lsum[2] = {0.f, 0.f};
  const uint32_t kv0 = sbase + kSmemKV;
  const uint32_t sMA = sbase + kSmemMA + 4 * r0, sMB = sbase + kSmemMB + 4 * r0;
  const uint32_t kv1 = kv0 + kBlockBytes;
  const int npairs = (nblk + 1) / 2;
  const int tail_blk = (n - 1) / kPage - blo;
  const Loop loop{bt, nblk, blo, n, npairs, tail_blk, sbase, bar0, kv0, kv1, sMA, sMB, t, quad, r0, wg};

  // (each warpgroup's Q·K^T of its next block opens its loop body: one call site, so that the
  // compiler does not cache the descriptors of two copies in local memory)
  if (wg == 0) wg0_pairs<kFp8>(p, loop, issue, q8, vis, acc, s, m_run, lsum);
  else wg1_pairs<kFp8>(p, loop, issue, q8, vis, acc, s, m_run, lsum);

  // both warpgroups hold O and l relative to the same final row max
  store_rows<kFp8>(p, acc, lsum, m_run, reinterpret_cast<float*>(smem + kSmemSum), sbase + kSmemQ,
             kBarSum, row_base, m0, blockIdx.y, sr.split_out(), wg, r0, quad,
             [&](int step) { MLA_STAMP(tid == 0, 10 + step, clock_now()); });
  MLA_STAMP(tid == 0, 7, clock_now());
  MLA_STAMP(tid == 0, 8, globaltimer());
  MLA_STAMP(tid == 0, 9, sm_id());
}

#ifdef MLA_TIMELINE
// copies the stamps out and zeroes them, so the next read holds only the launches since this one
cudaError_t timeline_copy(void* dst, size_t bytes) {
  cudaError_t e = cudaMemcpyFromSymbol(dst, g_timeline, bytes < sizeof(g_timeline) ? bytes : sizeof(g_timeline));
  void* buf = nullptr;
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&buf, g_timeline);
  if (e == cudaSuccess) e = cudaMemset(buf, 0, sizeof(g_timeline));
  return e;
}
#endif

cudaError_t launch_pair(const CUtensorMap& kv_map, const CUtensorMap& q_map, const Params& p,
                        dim3 grid, bool fp8, cudaStream_t stream) {
  static const cudaError_t allowed[2] = {
      allow_smem(mla_verify_sm90_pair_kernel<false>, pair::kSmemAlloc),
      allow_smem(mla_verify_sm90_pair_kernel<true>, pair::kSmemAlloc)};
  if (allowed[fp8] != cudaSuccess) return allowed[fp8];
  const auto fn = fp8 ? mla_verify_sm90_pair_kernel<true> : mla_verify_sm90_pair_kernel<false>;
  fn<<<grid, kThreads, pair::kSmemAlloc, stream>>>(kv_map, q_map, p);
  return cudaGetLastError();
}

}  // namespace k3mla
