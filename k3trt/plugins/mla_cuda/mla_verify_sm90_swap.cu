// SM90 kernel for k3trt::mla_verify, "swap" schedule: an fp8-e4m3 cache and at most 48 folded rows
// a request (12 heads x 4 query rows at TP 8). The pair kernel multiplies Q (64 rows, 16 of them
// padding at 12 heads) by the cache as wgmma's B operand, which must sit in shared memory, so an fp8
// cache is expanded to fp16 there first: a shared-memory round trip on each warpgroup's path that
// costs ~20% (mla_verify_notes.md v13). Here the tokens are the M dimension instead ("swap AB"):
//
//   S^T[64 tokens x 48 rows] = K[64 x 576] · Q^T          (A = K from registers, B = Q^T in smem)
//   O^T[512 x 48] += V^T[512 x 64 tokens] · P^T[64 x 48]  (A = V^T from registers, B = P^T in smem)
//
// so the cache is always the A operand, which wgmma takes from registers: each thread loads the raw
// fp8 bytes of its fragment and converts them in registers (cvt.f16x2.e4m3x2), and no row is padding.
// The tensor work per token drops from 2·64·1088 to 2·48·1088 FLOP.
//
// Fragments from raw bytes, without shuffles:
// - K (A of S^T, M = tokens, K = latent columns): the m64k16 fragment gives a thread the columns
//   2q, 2q+1, 2q+8, 2q+9 of a k16 step (q = lane % 4). The MMA's column order is free as long as
//   Q^T uses the same one, so step S's positions are mapped to 4 consecutive bytes of the cache row
//   (kk_of_dim below): one 16-byte load of a token row feeds 4 steps.
// - V^T (A of O^T, M = value columns, K = tokens): a thread needs tokens 2q, 2q+1, 2q+8, 2q+9 and
//   value rows g, g+8 (g = lane / 4) of each of 4 64-row M tiles. The M order is free too (the
//   epilogue maps it back): thread (warp w, g) of value warpgroup h owns the 8 consecutive value
//   columns 256h + 64w + 8g .. +7, so one 8-byte load per token and a byte permute (prmt) per pair
//   of tokens feed all 4 M tiles; M tile i row 16w + g + 8e is value column 256h + 64w + 8g + 2i + e.
// The raw block in shared memory: four [64 tokens x 128 B] chunks (value columns, TMA with the
// 128-byte swizzle, which makes both load patterns conflict-free) and the rope chunk [64 x 64 B].
//
// Warp specialisation (512 threads), as in FlashAttention-3:
// - two scores warpgroups (2, 3) take alternate blocks ("ping-pong"): S^T, the lazy running max,
//   P^T (to one of four shared tiles, by stmatrix .trans) and their row sums, and publish, per
//   block, whether the max moved and the factors (rare);
// - value warpgroups 0 and 1 each own 256 of the 512 value columns of O^T (4 M tiles x 48 rows: 96
//   fp32 registers) and multiply every block's V^T · P^T into them in block order, rescaling first
//   when told.
// Per-block mbarriers (P^T ready: the block's scores warpgroup's 128 arrivals; P^T free: the value
// warpgroups' 256, once their wgmmas on the tile retired) let the scores warpgroups run up to three
// blocks ahead through a ring of four raw blocks (TMA, refilled four blocks ahead by the warpgroup
// that last reads each chunk: value chunks 0-1 by warpgroup 0, 2-3 by 1, the rope chunk by the
// block's scores warpgroup, whose parity block i + 4 shares).
//
// Why two scores warpgroups: with one, its S^T and softmax were the critical path (~100 clocks a
// m64n48k16 wgmma against 24 at the full rate: one warpgroup's chain of fragment loads, conversions
// and issues; a phase profile and the e4m3 experiment in mla_verify_notes.md v17). Two chains of
// S^T overlap, and each warpgroup has two blocks' time for its softmax. O^T has a single max, so
// the running max stays one chain in block order: block i waits for block i - 1's max (the
// max-ready mbarrier of i % 2, published in shared memory with the factors), votes against it and
// publishes its own; each warpgroup's row sums follow the other's moves through those factors.
// Registers (setmaxnreg, the SM's 64K over 512 threads): value warpgroups 144 with one O^T fragment
// in flight, scores warpgroups 112 (two fragments). The split 168 / 88 with two O^T fragments
// spilled the scores warpgroups' loop and was slower than one scores warpgroup (v18).
// Measured (mla_ab_h200.json run 50, an H100, fp8, 12 heads): 15% faster than one scores warpgroup
// at batch 128 / 8K (234.7 against 270.2 us, 0.85 of the roofline), 22% at 128 / 32K, 19% at 256 / 8K,
// 4-9% at batch 32 from 8K, equal at 128 / 1K and 9% slower at 32 / 1K (few blocks a CTA: the chain's
// fill and the second warpgroup's start are not amortised).
//
// The value warpgroups start O^T(i) only once S^T(i + 1) has retired (the S^T-done mbarrier), so
// that O^T runs beside the softmax rather than taking S^T's share of the tensor cores (kOrder).
// Built, measured and dropped (v17): S^T's k-range split over the value warpgroups ("share", no
// faster), and S^T in e4m3 x e4m3 against Q split exactly into two e4m3 parts (no faster: twice the
// MACs at twice the rate, and the fp8 conversion it saved was not on the critical path). The first
// version of this kernel had two warpgroups each doing everything for alternate blocks (the pair
// schedule transposed), no faster than the pair kernel (mla_ab_h200.json runs 37-38).
//
// Lazy rescaling: the running max moves only when a score passes it by more than kLazyMax, so the
// scores warpgroup votes (bar.red) on whether any did, and takes the columns' maxima only then: a
// vote per block instead of 36 shuffles and an exchange (at 8K-32K: 0.93-0.97 of the pair kernel's
// time before, 0.84-0.89 after; mla_ab_h200.json runs 39-40).
//
// Shared memory (226.5 KB): Q^T (48 rows x 576, fp16 / 16 as in the pair kernel's fp8 path, in the
// permuted column order, 128-byte swizzle), 4 raw blocks x 36 KB, 4 P^T tiles (48 x 64 fp16), the
// maxima exchange of each scores warpgroup, 4 blocks' factors and flags, the final row sums, visible
// lengths, the running max and the chain's factors, 34 mbarriers.
// Same split-K, masking, NaN-safety and output contract as mla_verify_sm90.cu.

#include <cuda.h>

#include "sm90_common.cuh"

namespace k3mla {
namespace swap {

constexpr int kN = kSwapMaxRows;                      // folded rows = wgmma N
constexpr int kQChunk = kN * 128;                     // 64 columns of Q^T (fp16, swizzled)
constexpr int kRawChunk = kChunkBytes;               // [64 tokens x 128 B] fp8
constexpr int kRawBlock = 4 * kRawChunk + 64 * 64;    // + the rope chunk [64 x 64 B]
constexpr int kPTile = kN * 128;                      // P^T [48 rows x 64 tokens] fp16
struct Smem {
  static constexpr int kQ = 0;
  static constexpr int kKV = kQ + kChunks * kQChunk;  // raw block i: slot i % 4, + slot kRawBlock
  static constexpr int kP = kKV + 4 * kRawBlock;      // P^T of block i: tile i % 4
  static constexpr int kRed = kP + 4 * kPTile;        // float [2 scores WGs][4 warps][48]
  static constexpr int kFac = kRed + 2 * 4 * kN * 4;  // float [4][48]: block i's rescale factors
  static constexpr int kFlag = kFac + 4 * kN * 4;     // int [4]: whether block i rescales
  static constexpr int kL = kFlag + 16;               // float [48]: the final row sums
  static constexpr int kVis = kL + kN * 4;            // int [48]: visible lengths
  static constexpr int kM = kVis + kN * 4;            // float [48]: the running max
  static constexpr int kChain = kM + kN * 4;          // float [2][48]: block i's factors, by i % 2
  static constexpr int kCFlag = kChain + 2 * kN * 4;  // int [2]: whether block i moved the max
  static constexpr int kBar = kCFlag + 16;  // 4 slots x 5 chunks, P ready, P free, S^T done, max ready
  static constexpr int kBars = 20 + 4 + 4 + 4 + 2;
  static constexpr int kAlloc = kBar + kBars * 8 + 1024;
  static_assert(kKV % 1024 == 0 && kRawBlock % 1024 == 0 && kP % 1024 == 0,
                "TMA's 128-byte swizzle and wgmma's need 1024-byte aligned tiles");
  static_assert(kAlloc <= 232448, "shared memory over the sm_90 limit");
};
constexpr int kThreadsSwap = 512;  // value warpgroups 0, 1 (O^T), scores warpgroups 2, 3 (S^T, softmax)

// named barriers (0 is __syncthreads), + warpgroup: its 128 threads; kBarValues: the two value
// warpgroups, kBarScores: the two scores warpgroups
constexpr int kBarLocal = 1, kBarVote = 5, kBarValues = 9, kBarScores = 10;

// Registers by warpgroup (setmaxnreg): 2 x 128 x (kRegsValue + kRegsScores) <= the 64K of the SM.
// The value warpgroups hold O^T (96) and one V^T fragment (16); the scores warpgroups two K fragments.
constexpr int kRegsValue = 144, kRegsScores = 112;
static_assert(2 * kRegsValue + 2 * kRegsScores <= 4 * 128, "over the CTA's register pool");
// O^T(i) waits for S^T(i + 1) to retire
constexpr bool kOrder = true;
template <int N>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// The MMA's position of latent column d (even; d+1 goes to the next position): a thread q reads the
// 16 bytes 16q'.. of a row (value chunk c, half v: bytes 128c + 32q + 16v; rope: 512 + 16q), whose
// 4-byte word s' holds the step's positions 2q, 2q+1 (bytes 0, 1) and 2q+8, 2q+9 (bytes 2, 3).
__device__ __forceinline__ int kk_of_dim(int d) {
  int step, q;
  if (d < kDV) {
    const int r = d & 127;
    q = r >> 5;
    step = 8 * (d >> 7) + 4 * ((r >> 4) & 1) + ((r >> 2) & 3);
  } else {
    const int r = d - kDV;
    q = r >> 4;
    step = 32 + ((r >> 2) & 3);
  }
  return 16 * step + 2 * q + 8 * ((d >> 1) & 1);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint2 ld_shared_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                                  uint32_t d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}

__device__ __forceinline__ void mma(float* d, const uint32_t* a, uint64_t db, int scale_d) {
  wgmma_m64n48k16_f16_rs_nn(d, a, db, scale_d);
}

// the 12 query rows (columns of S^T and O^T) of thread q: 8jn + 2q + e, index 2jn + e
__device__ __forceinline__ int col_of(int c12, int q) { return 8 * (c12 >> 1) + 2 * q + (c12 & 1); }

// The K (S^T A operand) fragment of `steps` k16 steps from the 16-byte pieces of the thread's two
// token rows: step k's 4 registers from word k of each (kk_of_dim's column order).
__device__ __forceinline__ void k_fragment(uint32_t* f, const uint4 (&x)[2], int steps) {
#pragma unroll
  for (int k = 0; k < steps; ++k) {
    const uint32_t w0 = k == 0 ? x[0].x : k == 1 ? x[0].y : k == 2 ? x[0].z : x[0].w;
    const uint32_t w1 = k == 0 ? x[1].x : k == 1 ? x[1].y : k == 2 ? x[1].z : x[1].w;
    f[4 * k + 0] = e4m3x2_to_h2<false>(w0);
    f[4 * k + 1] = e4m3x2_to_h2<false>(w1);
    f[4 * k + 2] = e4m3x2_to_h2<true>(w0);
    f[4 * k + 3] = e4m3x2_to_h2<true>(w1);
  }
}

// S^T of one block into s (64 tokens x 48 rows, fp32): nine 16-byte pieces of each of the thread's
// two token rows (g, g+8), four k16 steps each, converted into a ring of kDepth fragments while the
// previous pieces' wgmmas run; the chunk's mbarrier is waited for at its first piece. (A ring of 4,
// with the registers moved from the value warpgroups by setmaxnreg, was no faster: run 40; a ring
// of 3 spills. Commit groups of 2 or 1 steps in the same 32 registers, 6 or 7 wgmmas in flight
// instead of 4, were 2-5% slower from 8K: run 59.)
constexpr int kDepth = 2;
__device__ __forceinline__ void st_block(float* s, uint32_t (&fr)[kDepth][16], uint32_t slot,
                                         uint32_t qbase, uint32_t bars, uint32_t parity, int* err,
                                         int blk, int w, int g, int q) {
  const int r0 = 16 * w + g;
  const uint64_t qdesc = sw128_desc(qbase, 16, 1024);
  wgmma_wait<0>();  // the fragment ring's last users (the previous block's) are done
#pragma unroll
  for (int hc = 0; hc < 9; ++hc) {
    if ((hc & 1) == 0) mbar_wait(bars + 8 * (hc >> 1), parity, err, 1, blk, hc >> 1);
    uint4 x[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      const uint32_t a = hc < 8 ? slot + (hc >> 1) * kRawChunk + r * 128 +
                                      (((2 * q + (hc & 1)) ^ (r & 7)) << 4)
                                : slot + 4 * kRawChunk + r * 64 + q * 16;
      x[h] = ld_shared_v4(a);
    }
    if (hc >= kDepth) wgmma_wait<kDepth - 1>();
    uint32_t* f = fr[hc % kDepth];
    k_fragment(f, x, 4);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
      mma(s, f + 4 * k, qdesc + (hc * kQChunk + 32 * k) / 16,
          hc == 0 && k == 0 ? 0 : 1);
    wgmma_commit();
  }
}

// O^T[256h..] += V^T(block) · P^T: four k16 steps of 16 tokens, each four wgmmas (one per M tile)
// from a fragment built from 8-byte loads of the thread's 8 value columns in 4 token rows. Each
// wgmma is a commit group of its own, and an M tile's 4 registers are rebuilt once its previous
// wgmma has retired, so three wgmmas run while one tile converts (a group of four a step, with the
// 16 registers the whole ring, ran none: 2-4% slower from 8K, mla_ab_h200.json run 59).
// free_prev (nonzero): the previous block's P-free mbarrier, arrived at once this thread's wgmmas
// of that block have retired.
__device__ __forceinline__ void ot_block(float* acc, uint32_t (&f)[16], uint32_t slot,
                                         uint32_t ptile, int h, int w, int g, int q,
                                         uint32_t free_prev) {
  const uint32_t chunk = slot + (2 * h + (w >> 1)) * kRawChunk;
  const int unit = 4 * (w & 1) + (g >> 1);
  const uint32_t off = 8 * (g & 1);
  const uint64_t pdesc = sw128_desc(ptile, 16, 1024);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint2 x[4];  // tokens 16k + 2q, +1, +8, +9
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int tok = 16 * k + 2 * q + (u & 1) + 8 * (u >> 1);
      x[u] = ld_shared_v2(chunk + tok * 128 + ((unit ^ (tok & 7)) << 4) + off);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // M tile i: bytes 2i, 2i+1 of the 8 (value columns 2i + e)
      wgmma_wait<3>();  // tile i's wgmma of step k - 1 (or of the previous block's step 3)
      if (k == 0 && i == 3 && free_prev != 0) mbar_arrive(free_prev);
      const uint32_t sel = (i & 1) ? 0x7362 : 0x5140;  // [t.b, t'.b, t.b+1, t'.b+1]
      const uint32_t p01 = prmt(i < 2 ? x[0].x : x[0].y, i < 2 ? x[1].x : x[1].y, sel);
      const uint32_t p89 = prmt(i < 2 ? x[2].x : x[2].y, i < 2 ? x[3].x : x[3].y, sel);
      f[4 * i + 0] = e4m3x2_to_h2<false>(p01);  // row g (e = 0), tokens 2q, 2q+1
      f[4 * i + 1] = e4m3x2_to_h2<true>(p01);   // row g + 8 (e = 1)
      f[4 * i + 2] = e4m3x2_to_h2<false>(p89);  // row g, tokens 2q+8, 2q+9
      f[4 * i + 3] = e4m3x2_to_h2<true>(p89);
      wgmma_fence();
      mma(acc + 24 * i, f + 4 * i, pdesc + 2 * k, 1);
      wgmma_commit();
    }
  }
}

__device__ __forceinline__ void pin_acc(float* acc) {
#pragma unroll
  for (int k = 0; k < 96; ++k) pin(acc[k]);
}

// Mask the block's scores (tokens past a row's visible length -> -inf, which also
// replaces NaN read from slots past the length). The mask is a call: inline, ptxas predicates it,
// and its ~75 instructions then issue in every block, not just the tail ones (notes v19).
struct Scores {
  float v[24];
};
__device__ __noinline__ Scores mask_scores(Scores x, int pos0, const int* vis, int w, int g, int q) {
#pragma unroll
  for (int c = 0; c < 12; ++c) {
    const int jn = c >> 1, e = c & 1;
    const int lim = vis[col_of(c, q)], pos = pos0 + 16 * w + g;
    x.v[4 * jn + e] = pos < lim ? x.v[4 * jn + e] : -INFINITY;
    x.v[4 * jn + 2 + e] = pos + 8 < lim ? x.v[4 * jn + 2 + e] : -INFINITY;
  }
  return x;
}
__device__ __forceinline__ void mask(float* s, bool masked, int pos0, const int* vis, int w, int g,
                                     int q) {
  if (masked) {
    Scores x;
#pragma unroll
    for (int k = 0; k < 24; ++k) x.v[k] = s[k];
    x = mask_scores(x, pos0, vis, w, g, q);
#pragma unroll
    for (int k = 0; k < 24; ++k) s[k] = x.v[k];
  }
}

// whether any of the thread's scores passes its column's running max by more than kLazyMax (the
// scores unscaled: against (m + kLazyMax) / scale, 12 FFMA instead of scaling 24 scores)
__device__ __forceinline__ bool passes(const float* s, const float* m_run, float inv_scale,
                                       float lazy_inv) {
  bool pass = false;
#pragma unroll
  for (int c = 0; c < 12; ++c) {
    const int jn = c >> 1, e = c & 1;
    const float thr = fmaf(m_run[c], inv_scale, lazy_inv);  // (-inf: any finite)
    pass |= fmaxf(s[4 * jn + e], s[4 * jn + 2 + e]) > thr;
  }
  return pass;
}

// The block's new lazy max per column. With lazy rescaling the running max almost never moves, so
// the warpgroup only votes on whether a score passed it; only then are the columns' maxima taken
// (over the warp's 16 tokens by shuffles, over the 4 warps through `red`, [4][48]). Returns whether
// the max moved.
__device__ __forceinline__ bool block_max(const float* s, bool pass, const float* m_run, float scale,
                                          float* m_new, float* red, int wg, int w, int g, int q) {
#pragma unroll
  for (int c = 0; c < 12; ++c) m_new[c] = m_run[c];
  if (!warpgroup_any(pass, kBarVote + wg)) return false;
#pragma unroll
  for (int c = 0; c < 12; ++c) {
    const int jn = c >> 1, e = c & 1;
    float m = fmaxf(s[4 * jn + e], s[4 * jn + 2 + e]);
    m = fmaxf(m, __shfl_xor_sync(~0u, m, 4));
    m = fmaxf(m, __shfl_xor_sync(~0u, m, 8));
    m = fmaxf(m, __shfl_xor_sync(~0u, m, 16));
    if (g == 0) red[w * kN + col_of(c, q)] = m;
  }
  named_bar(kBarLocal + wg, 128);
#pragma unroll
  for (int c = 0; c < 12; ++c) {
    const int col = col_of(c, q);
    const float mx = fmaxf(fmaxf(red[col], red[kN + col]), fmaxf(red[2 * kN + col], red[3 * kN + col]));
    m_new[c] = lazy_max(m_run[c], mx * scale);
  }
  named_bar(kBarLocal + wg, 128);  // red is read before its next write
  return true;
}

// P = exp2(s scale - m) (m = -inf: 0), the thread's column sums into lsum, P^T -> its shared tile
// (stmatrix .trans: the accumulator's 8x8 pieces, token rows g and columns 2q, 2q+1, land as rows
// of the query-row-major tile, tokens 16w + 8hh.. = 16-byte piece 2w + hh, swizzled)
__device__ __forceinline__ void store_pt(float* s, const float* m, float scale, float* lsum,
                                         uint32_t tile, int w, int lane) {
  uint32_t pk[12];
  wgmma_wait<0>();  // (nothing is in flight; without it ptxas serialises every wgmma: C7515)
#pragma unroll
  for (int c = 0; c < 12; ++c) {
    const int jn = c >> 1, e = c & 1;
    const float mu = m[c] == -INFINITY ? 0.f : m[c];
    s[4 * jn + e] = fast_exp2(fmaf(s[4 * jn + e], scale, -mu));
    s[4 * jn + 2 + e] = fast_exp2(fmaf(s[4 * jn + 2 + e], scale, -mu));
    lsum[c] += s[4 * jn + e] + s[4 * jn + 2 + e];
  }
#pragma unroll
  for (int mi = 0; mi < 12; ++mi) {  // 8x8 piece (jn, hh): tokens 8hh + g, rows 8jn + 2q, +1
    const int jn = mi >> 1, hh = mi & 1;
    pk[mi] = pack2(s[4 * jn + 2 * hh], s[4 * jn + 2 * hh + 1], true);
  }
  const int r = lane & 7;
#pragma unroll
  for (int u = 0; u < 3; ++u) {
    const int mi = 4 * u + (lane >> 3), jn = mi >> 1, hh = mi & 1;
    stmatrix_x4_trans(tile + (8 * jn + r) * 128 + (((2 * w + hh) ^ r) << 4), pk[4 * u], pk[4 * u + 1],
                      pk[4 * u + 2], pk[4 * u + 3]);
  }
}

}  // namespace swap

__global__ void __launch_bounds__(swap::kThreadsSwap, 1)
    mla_verify_sm90_swap_kernel(const __grid_constant__ CUtensorMap kv128,
                                const __grid_constant__ CUtensorMap kv64, const Params p) {
  using namespace swap;
  using L = Smem;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  const uint32_t sbase = smem_u32(smem);

  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  const int t = tid & 127;
  const int w = t >> 5;
  const int lane = t & 31;
  const int g = lane >> 2, q = lane & 3;
  pdl_launch_dependents();

  const int b = blockIdx.z;
  const long row_base = static_cast<long>(b) * p.rows_per_req;
  // Q^T's global loads first: their latency overlaps the length read, the split range and the
  // first TMA issues (a CTA left without blocks drops them)
  constexpr int kPieces = kN * (kD / 8), kPer = (kPieces + kThreadsSwap - 1) / kThreadsSwap;
  uint4 qv[kPer];
  {
    const uint16_t* qg = reinterpret_cast<const uint16_t*>(p.q);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int i = tid + kThreadsSwap * k, r = i / (kD / 8), pc = i % (kD / 8);
      qv[k] = i < kPieces && r < p.rows_per_req
                  ? __ldg(reinterpret_cast<const uint4*>(qg + (row_base + r) * kD + pc * 8))
                  : make_uint4(0, 0, 0, 0);
    }
  }
  const uint32_t bar0 = sbase + L::kBar;  // slot sl, chunk c: bar0 + 8 (5 sl + c)
  const uint32_t rdy0 = bar0 + 8 * 20;     // P^T of a tile written (128 arrivals: the scores WG)
  const uint32_t fre0 = rdy0 + 8 * 4;      // P^T of a tile read (256 arrivals: the value WGs)
  const uint32_t std0 = fre0 + 8 * 4;      // S^T of a slot's block retired (128: its scores WG)
  const uint32_t mrd0 = std0 + 8 * 4;      // block i % 2's max and factors published (128)
  if (tid == 0) {
    for (int i = 0; i < 20; ++i) mbar_init(bar0 + 8 * i, 1);
    for (int i = 0; i < 4; ++i)
      mbar_init(rdy0 + 8 * i, 128), mbar_init(fre0 + 8 * i, 256), mbar_init(std0 + 8 * i, 128);
    for (int i = 0; i < 2; ++i) mbar_init(mrd0 + 8 * i, 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async();
  }
  const SplitRange sr = split_range(p, p.seq_lens[b], blockIdx.y);
  if (sr.nblk == 0) {
    if (tid < kThreads) write_unseen(p, row_base, 0, blockIdx.y, sr.split_out(), tid);
    return;
  }
  const int nblk = sr.nblk, blo = sr.blo, n = sr.n;
  const int* bt = p.block_table + static_cast<long>(b) * p.bt_stride + blo;
  __syncthreads();  // the mbarriers are initialised

  // TMA of block blk (slot blk % 4): value chunks c_lo .. c_lo + cnt - 1, and the rope chunk if `rope`
  auto issue = [&](int blk, int page, int c_lo, int cnt, bool rope) {
    const int sl = blk & 3;
    const uint32_t slot = sbase + L::kKV + sl * kRawBlock;
    for (int c = c_lo; c < c_lo + cnt; ++c) {
      mbar_expect_tx(bar0 + 8 * (5 * sl + c), kRawChunk);
      tma_load_2d(slot + c * kRawChunk, &kv128, 128 * c, page * kPage, bar0 + 8 * (5 * sl + c));
    }
    if (rope) {
      mbar_expect_tx(bar0 + 8 * (5 * sl + 4), 64 * 64);
      tma_load_2d(slot + 4 * kRawChunk, &kv64, kDV, page * kPage, bar0 + 8 * (5 * sl + 4));
    }
  };
  if (tid == 0) {  // (the first pages' ids read together: one latency, not one per block)
    int pages[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pages[i] = i < nblk ? __ldg(bt + i) : 0;
    for (int i = 0; i < 4 && i < nblk; ++i) issue(i, pages[i], 0, 4, true);
  }

  // Q^T: 48 rows x 72 pieces of 8 columns, fp16 / 16, each column pair at its MMA position
  {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int i = tid + kThreadsSwap * k, r = i / (kD / 8), pc = i % (kD / 8);
      if (i >= kPieces) break;
      const uint32_t words[4] = {qv[k].x, qv[k].y, qv[k].z, qv[k].w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int kk = kk_of_dim(8 * pc + 2 * u);
        st_shared(sbase + L::kQ + (kk >> 6) * kQChunk + sw128_off(r, (kk & 63) >> 3) + (kk & 7) * 2,
                  bf16x2_to_f16x2_div16(words[u]));
      }
    }
    if (tid < kN) {  // row m = j*H + h sees n - (Q-1-j) tokens; padding rows none
      reinterpret_cast<int*>(smem + L::kVis)[tid] =
          tid < p.rows_per_req ? max(n - (p.q_per_req - 1 - tid / p.heads), 0) : 0;
      reinterpret_cast<float*>(smem + L::kM)[tid] = -INFINITY;
    }
    fence_proxy_async();
  }
  __syncthreads();
  float* fac = reinterpret_cast<float*>(smem + L::kFac);
  volatile int* flag = reinterpret_cast<volatile int*>(smem + L::kFlag);
  float* lfin = reinterpret_cast<float*>(smem + L::kL);
  const int tail_blk = (n - 1) / kPage - blo;

  if (wg >= 2) {
    // ---- scores warpgroups: S^T, the running max, P^T, the row sums of alternate blocks -------
    // Scores warpgroup sw takes blocks sw, sw + 2, ...; the running max is one chain through the
    // blocks in order (the value warpgroups' O^T has a single max): block i waits for block i - 1's
    // max (the max-ready mbarrier of i % 2), votes against it, and publishes its own. Each
    // warpgroup's row sums stay at the max of its last block; the other's moves reach them by the
    // chain's factors.
    regs_dec<kRegsScores>();
    const int sw = wg - 2;
    const int* vis = reinterpret_cast<const int*>(smem + L::kVis);
    const int all_vis = max(n - (p.q_per_req - 1), 0);  // blocks ending here are seen by every row
    float* red = reinterpret_cast<float*>(smem + L::kRed) + sw * 4 * kN;
    float* mrun = reinterpret_cast<float*>(smem + L::kM);
    float* cfac = reinterpret_cast<float*>(smem + L::kChain);
    volatile int* cflag = reinterpret_cast<volatile int*>(smem + L::kCFlag);
    const float inv_scale = 1.f / p.scale_log2, lazy_inv = kLazyMax * inv_scale;
    float s[24];  // the block's scores, unscaled: the scale rides on exp2's FFMA (and the max's 12)
    float lsum[12];
#pragma unroll
    for (int c = 0; c < 12; ++c) lsum[c] = 0.f;
    // block j (the other warpgroup's): its max published; the row sums taken to it
    auto chain_in = [&](int j) {
      mbar_wait(mrd0 + 8 * (j & 1), (j >> 1) & 1, p.err, 6, blo + j, j & 1);
      if (cflag[j & 1]) {
#pragma unroll
        for (int c = 0; c < 12; ++c) lsum[c] *= cfac[(j & 1) * kN + col_of(c, q)];
      }
    };
#pragma unroll 1
    for (int i = sw; i < nblk; i += 2) {
      const int sl = i & 3, pt = sl;  // raw slot, P^T tile
      const uint32_t slot = sbase + L::kKV + sl * kRawBlock;
      int pg = 0;
      if (t == 0 && i + 4 < nblk) pg = __ldg(bt + i + 4);
      uint32_t fr[kDepth][16];
      st_block(s, fr, slot, sbase + L::kQ, bar0 + 8 * 5 * sl, (i >> 2) & 1, p.err, blo + i, w, g, q);
      wgmma_wait<0>();
#pragma unroll
      for (int k = 0; k < 24; ++k) pin(s[k]);
      mbar_arrive(std0 + 8 * sl);
      const int pos0 = (blo + i) * kPage;
      mask(s, pos0 + kPage > all_vis, pos0, vis, w, g, q);
      if (i > 0) chain_in(i - 1);
      float m_prev[12], m_new[12];
#pragma unroll
      for (int c = 0; c < 12; ++c) m_prev[c] = mrun[col_of(c, q)];
      // (the vote in block_max: every thread's loads of the slot and of mrun are done)
      const bool pass = passes(s, m_prev, inv_scale, lazy_inv);
      const bool moved = block_max(s, pass, m_prev, p.scale_log2, m_new, red, wg, w, g, q);
      if (moved) {
#pragma unroll
        for (int c = 0; c < 12; ++c) {
          const float f = rescale_factor(m_prev[c], m_new[c]);
          lsum[c] *= f;
          if (w == 0 && g == 0) {
            const int col = col_of(c, q);
            mrun[col] = m_new[c];
            cfac[(i & 1) * kN + col] = f;
          }
        }
      }
      if (t == 0) cflag[i & 1] = moved;
      mbar_arrive(mrd0 + 8 * (i & 1));
      if (t == 0 && i + 4 < nblk) issue(i + 4, pg, 0, 0, true);  // the rope chunk is ours alone
      // the tile and its factors were last read by the value warpgroups' O^T of block i - 4
      if (i >= 4) mbar_wait(fre0 + 8 * sl, ((i >> 2) - 1) & 1, p.err, 4, blo + i, sl);
      if (moved && w == 0 && g == 0) {  // (cfac[i % 2] is next written by this warpgroup's i + 2)
#pragma unroll
        for (int c = 0; c < 12; ++c) fac[pt * kN + col_of(c, q)] = cfac[(i & 1) * kN + col_of(c, q)];
      }
      if (t == 0) flag[pt] = moved;
      store_pt(s, m_new, p.scale_log2, lsum, sbase + L::kP + pt * kPTile, w, lane);
      if (i == tail_blk) {  // raw fp8 rows past the length, zeroed before O^T reads them
        zero_tail_rows(slot, n - (blo + i) * kPage, t);
      }
      fence_proxy_async();
      mbar_arrive(rdy0 + 8 * pt);
    }
    if (((nblk - 1) & 1) != sw) chain_in(nblk - 1);  // the row sums at the final max
    // row sums over the 8 lanes of a column, the 4 warps and the 2 warpgroups; LSE
#pragma unroll
    for (int c = 0; c < 12; ++c) {
      lsum[c] += __shfl_xor_sync(~0u, lsum[c], 4);
      lsum[c] += __shfl_xor_sync(~0u, lsum[c], 8);
      lsum[c] += __shfl_xor_sync(~0u, lsum[c], 16);
    }
    if (g == 0) {
#pragma unroll
      for (int c = 0; c < 12; ++c) red[w * kN + col_of(c, q)] = lsum[c];
    }
    named_bar(kBarScores, 256);
    if (sw == 0 && w == 0 && g == 0) {  // lanes 0..3: 12 columns each
      const float* red2 = reinterpret_cast<const float*>(smem + L::kRed);
#pragma unroll
      for (int c = 0; c < 12; ++c) {
        const int col = col_of(c, q);
        float l = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) l += red2[k * kN + col];
        lfin[col] = l;
        if (col >= p.rows_per_req) continue;
        const float lse = l > 0.f ? (mrun[col] + __log2f(l)) * 0.69314718055994531f : -INFINITY;
        const long gr = row_base + col;
        if (sr.split_out()) p.part_lse[gr * p.num_splits + blockIdx.y] = lse;
        else p.lse[gr] = lse;
      }
    }
    __syncthreads();  // lfin is complete
  } else {
    // ---- value warpgroups: O^T[256 wg ..] over every block ------------------------------------
    regs_inc<kRegsValue>();
    float acc[96];
#pragma unroll
    for (int i = 0; i < 96; ++i) acc[i] = 0.f;
    pin_acc(acc);  // (else ptxas carries the zeros into the loop and serialises its wgmmas: C7515)
    // (rare) the running max moved at block i (P^T tile pt): O to the new max first
    auto rescale = [&](int pt) {
      wgmma_wait<0>();
      pin_acc(acc);
#pragma unroll
      for (int c = 0; c < 12; ++c) {
        const float f = fac[pt * kN + col_of(c, q)];
#pragma unroll
        for (int m = 0; m < 4; ++m)
#pragma unroll
          for (int e = 0; e < 2; ++e) acc[24 * m + 4 * (c >> 1) + 2 * e + (c & 1)] *= f;
      }
    };
    uint32_t fr[16];
#pragma unroll 1
    for (int i = 0; i < nblk; ++i) {
      const int sl = i & 3;
      int pg = 0;
      if (t == 0 && i + 4 < nblk) pg = __ldg(bt + i + 4);
      mbar_wait(rdy0 + 8 * sl, (i >> 2) & 1, p.err, 3, blo + i, sl);
      if (flag[sl]) rescale(sl);
      // O^T(i) once S^T(i + 1) has retired: beside the scores warpgroup's softmax(i + 1), not
      // competing with S^T(i + 1) for the tensor cores (2-5% at 8K-32K, mla_ab_h200.json run 48)
      if (kOrder && i + 1 < nblk)
        mbar_wait(std0 + 8 * ((i + 1) & 3), ((i + 1) >> 2) & 1, p.err, 5, blo + i + 1, (i + 1) & 3);
      ot_block(acc, fr, sbase + L::kKV + sl * kRawBlock, sbase + L::kP + sl * kPTile, wg, w,
                     g, q, i > 0 ? fre0 + 8 * ((i - 1) & 3) : 0u);
      named_bar(kBarLocal + wg, 128);  // this warpgroup's loads of the slot are done
      if (t == 0 && i + 4 < nblk) issue(i + 4, pg, 2 * wg, 2, false);
    }
    wgmma_wait<0>();
    pin_acc(acc);
    // O^T -> shared memory as fp32 rows [48][512] over the KV stages, once both value warpgroups
    // have read every block (the other one can still be a block or more behind: without this
    // barrier its last V reads could see the staged floats), then normalised and stored in whole
    // 16-byte pieces of rows.
    named_bar(kBarValues, 256);
    float* ost = reinterpret_cast<float*>(smem + L::kKV);
#pragma unroll
    for (int c = 0; c < 12; ++c)
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int jn = c >> 1, e = c & 1;
        *reinterpret_cast<float2*>(ost + col_of(c, q) * kDV + 256 * wg + 64 * w + 8 * g + 2 * m) =
            make_float2(acc[24 * m + 4 * jn + e], acc[24 * m + 4 * jn + 2 + e]);
      }
    __syncthreads();  // lfin and the staged rows are complete
    const bool split_out = sr.split_out();
    const bool f16 = split_out;  // an fp8 cache's partial: fp16, in the cache's units
    uint16_t* dst = split_out ? p.part_o + static_cast<long>(blockIdx.y) * kDV
                              : reinterpret_cast<uint16_t*>(p.out);
    const long stride = split_out ? static_cast<long>(p.num_splits) * kDV : kDV;
    for (int i = tid; i < p.rows_per_req * (kDV / 8); i += 256) {  // 8 columns a thread
      const int col = i / (kDV / 8), d = (i % (kDV / 8)) * 8;
      const float l = lfin[col];
      const float inv = l > 0.f ? (f16 ? 1.f : p.out_scale) / l : 0.f;
      const float4 x0 = *reinterpret_cast<const float4*>(ost + col * kDV + d);
      const float4 x1 = *reinterpret_cast<const float4*>(ost + col * kDV + d + 4);
      *reinterpret_cast<uint4*>(dst + (row_base + col) * stride + d) =
          make_uint4(pack2(x0.x * inv, x0.y * inv, f16), pack2(x0.z * inv, x0.w * inv, f16),
                     pack2(x1.x * inv, x1.y * inv, f16), pack2(x1.z * inv, x1.w * inv, f16));
    }
  }
}

cudaError_t launch_swap(const CUtensorMap& kv128, const CUtensorMap& kv64, const Params& p,
                        dim3 grid, cudaStream_t stream) {
  static const cudaError_t allowed = allow_smem(mla_verify_sm90_swap_kernel, swap::Smem::kAlloc);
  if (allowed != cudaSuccess) return allowed;
  mla_verify_sm90_swap_kernel<<<grid, swap::kThreadsSwap, swap::Smem::kAlloc, stream>>>(kv128, kv64,
                                                                                      p);
  return cudaGetLastError();
}

}  // namespace k3mla
