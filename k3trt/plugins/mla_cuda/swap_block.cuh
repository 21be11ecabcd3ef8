// The swap kernel's (swap.cu) per-block steps and their PTX helpers: S^T of a block (st_block),
// O^T += V^T · P^T (ot_block), the mask, the lazy max's vote and maxima (passes, block_max) and
// P^T's store (store_pt), with the kernel's constants: tile shapes, the shared-memory map, named
// barriers and the register split.
#pragma once

#include "common.cuh"

namespace k3mla {
namespace swap {

constexpr int kN = kSwapMaxRows;                      // folded rows = wgmma N
constexpr int kQChunk = 2 * kN * 128;  // 128 latent columns of [Q_hi; Q_lo] (96 rows, e4m3, swizzled)
constexpr int kQRope = 4 * kQChunk;     // the 64 rope columns: 96 rows x 64 B, 64-byte swizzle
constexpr int kRawChunk = kChunkBytes;               // [64 tokens x 128 B] fp8
constexpr int kRawBlock = 4 * kRawChunk + 64 * 64;    // + the rope chunk [64 x 64 B]
constexpr int kPTile = kN * 128;                      // P^T [48 rows x 64 tokens] fp16
struct Smem {
  static constexpr int kQ = 0;
  static constexpr int kKV = kQ + kQRope + 2 * kN * 64;  // raw block i: slot i % 4, + slot kRawBlock
  static constexpr int kP = kKV + 4 * kRawBlock;      // P^T of block i: tile i % 4
  static constexpr int kRed = kP + 4 * kPTile;        // float [2 scores WGs][4 warps][48]
  static constexpr int kFac = kRed + 2 * 4 * kN * 4;  // float [4][48]: block i's rescale factors
  static constexpr int kFlag = kFac + 4 * kN * 4;     // int [4]: whether block i rescales
  static constexpr int kL = kFlag + 16;               // float [48]: the final row sums
  static constexpr int kVis = kL + kN * 4;            // int [48]: visible lengths
  static constexpr int kM = kVis + kN * 4;            // float [48]: the running max
  static constexpr int kChain = kM + kN * 4;          // float [2][48]: block i's factors, by i % 2
  static constexpr int kCFlag = kChain + 2 * kN * 4;  // int [2]: whether block i moved the max
  static constexpr int kCnt = kCFlag + 16;  // int [2]: value warpgroup h's warps done with a block
  static constexpr int kBar = kCnt + 16;    // 4 slots x 5 chunks, P ready, P free, max ready
  static constexpr int kBars = 20 + 4 + 4 + 2;
  static constexpr int kAlloc = kBar + kBars * 8 + 1024;
  static_assert(kKV % 1024 == 0 && kRawBlock % 1024 == 0 && kP % 1024 == 0,
                "TMA's 128-byte swizzle and wgmma's need 1024-byte aligned tiles");
  static_assert(kAlloc <= 232448, "shared memory over the sm_90 limit");
};
constexpr int kThreadsSwap = 512;  // value warpgroups 0, 1 (O^T), scores warpgroups 2, 3 (S^T, softmax)

// named barriers (0 is __syncthreads), + warpgroup: its 128 threads (the scores warpgroups' maxima
// exchange), kBarValues: the two value warpgroups, kBarScores: the two scores warpgroups
constexpr int kBarLocal = 1, kBarVote = 5, kBarValues = 9, kBarScores = 10;

// Registers by warpgroup (setmaxnreg): 2 x 128 x (kRegsValue + kRegsScores) <= the 64K of the SM.
// The value warpgroups hold O^T (96) and one V^T fragment (16); the scores warpgroups S^T's 48
// accumulators and the softmax (they fit 104).
constexpr int kRegsValue = 152, kRegsScores = 104;
static_assert(2 * kRegsValue + 2 * kRegsScores <= 4 * 128, "over the CTA's register pool");
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

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// 4 floats -> 4 e4m3 (round to nearest, saturating), a first in the lowest byte
__device__ __forceinline__ uint32_t f32x4_to_e4m3x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}
__device__ __forceinline__ void e4m3x4_to_f32x4(uint32_t v, float* y) {
  const uint32_t l = e4m3x2_to_h2<false>(v), h = e4m3x2_to_h2<true>(v);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&l));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&h));
  y[0] = a.x, y[1] = a.y, y[2] = b.x, y[3] = b.y;
}
// (acq_rel: the other warps' V reads of the slot happen before the refill this count may start)
__device__ __forceinline__ uint32_t atom_add_acq_rel(uint32_t addr, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(addr), "r"(v)
               : "memory");
  return old;
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

// S^T of one block into d (64 tokens x 96 columns: the 48 rows' Q_hi, then their Q_lo): 18 e4m3
// wgmmas with the raw block's bytes as A and [Q_hi; Q_lo] as B, both straight from shared memory,
// each chunk's once its mbarrier has completed; one commit group.
__device__ __forceinline__ void st_block(float* d, uint32_t slot, uint32_t qbase, uint32_t bars,
                                         uint32_t parity, int* err, int blk) {
  // descriptors as one 32-bit add a wgmma: the low words of the block's and Q's first chunks plus
  // each piece's offset / 16; the high words are constants (8-row atoms of 128-byte rows with the
  // 128-byte swizzle, of 64-byte rows with the 64-byte one)
  const uint32_t alo = desc_lo(slot, 16), blo = desc_lo(qbase, 16);
#pragma unroll
  for (int c = 0; c < 5; ++c) {
    mbar_wait(bars + 8 * c, parity, err, kErrKvChunk, blk, c);
    wgmma_fence();  // (at each chunk: a wgmma after the wait's branch, without one, is serialised)
#pragma unroll
    for (int j = 0; j < (c < 4 ? 4 : 2); ++j) {
      const uint32_t hi = c < 4 ? desc_hi(1024, kDescSw128) : desc_hi(512, kDescSw64);
      const uint64_t da = make_desc(alo + (c * kRawChunk + 32 * j) / 16, hi);
      const uint64_t db = make_desc(blo + (c * kQChunk + 32 * j) / 16, hi);
      wgmma_m64n96k32_e4m3_ss(d, da, db, c + j > 0);
    }
    wgmma_commit();
  }
}

// O^T[256h..] += V^T(block) · P^T: four k16 steps of 16 tokens, each four wgmmas (one per M tile)
// from a fragment built from 8-byte loads of the thread's 8 value columns in 4 token rows. Each
// wgmma is a commit group of its own, and an M tile's 4 registers are rebuilt once its previous
// wgmma has retired, so three wgmmas run while one tile converts (a group of four a step, with the
// 16 registers the whole ring, ran none: 2-4% slower from 8K).
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
// and its ~75 instructions then issue in every block, not just the tail ones.
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
}  // namespace k3mla
