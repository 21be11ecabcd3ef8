// SM90 kernel for k3trt::mla_verify, "swap" schedule: an fp8-e4m3 cache and at most 48 folded rows
// a CTA: a request's 12 heads x 4 query rows at TP 8, or at 48 / 96 heads (TP 2 / 1) one of its 4 / 8
// head groups of 12 (grid x; the groups read the same pages at about the same time, mostly from L2:
// 1.27-1.38x faster than the pair kernel there from 8K or at batch 32, 0.98-1.02x at batch 64-128 /
// 1K on an H100; notes v25). The pair kernel multiplies Q (64 rows, 16 of them
// padding at 12 heads) by the cache as wgmma's B operand, which must sit in shared memory, so an fp8
// cache is expanded to fp16 there first: a shared-memory round trip on each warpgroup's path that
// costs ~20% (mla_verify_notes.md v13). Here the tokens are the M dimension instead ("swap AB"):
//
//   S^T[64 tokens x 96] = K[64 x 576] · [Q_hi; Q_lo]^T    (e4m3 x e4m3, A and B in smem)
//   O^T[512 x 48] += V^T[512 x 64 tokens] · P^T[64 x 48]  (fp16: A = V^T from registers, B = P^T in smem)
//
// and no row is padding: the tensor work per token drops from 2·64·1088 to 2·48·1088 FLOP.
//
// S^T is an fp8 wgmma straight from the raw block as TMA lays it down (K-major, the value chunks with
// the 128-byte swizzle, the rope chunk with the 64-byte one): no loads, conversions or registers for
// its A operand. Q is split exactly into two e4m3 parts with a power-of-two scale (the prologue),
// Q_hi as B's rows 0-47 and 16 Q_lo as rows 48-95, and the scores are S_hi + S_lo / 16. Twice the
// MACs at twice the rate: the tensor time is bf16's, but the scores warpgroups only issue 18 wgmmas
// a block. The fp16 form before it (36 m64n48k16 a block, the K fragment loaded and converted in
// registers) was 7-12% slower L2-resident and 5-14% on the real cache (mla_ab_h200.json runs
// 68-69, an H100, notes v23); the e4m3 form with its A loaded into registers was no faster than
// that one (v17).
//
// V^T (A of O^T, M = value columns, K = tokens) from raw bytes, without shuffles: a thread needs
// tokens 2q, 2q+1, 2q+8, 2q+9 and value rows g, g+8 (g = lane / 4, q = lane % 4) of each of 4 64-row
// M tiles. The M order is free (the epilogue maps it back): thread (warp w, g) of value warpgroup h
// owns the 8 consecutive value columns 256h + 64w + 8g .. +7, so one 8-byte load per token and a
// byte permute (prmt) per pair of tokens feed all 4 M tiles; M tile i row 16w + g + 8e is value
// column 256h + 64w + 8g + 2i + e. The 128-byte swizzle keeps these loads conflict-free.
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
// that last reads each chunk: value chunks 0-1 by warpgroup 0's last warp through with them, 2-3 by
// warpgroup 1's, the rope chunk by the block's scores warpgroup, whose parity block i + 4 shares).
//
// Why two scores warpgroups: with one, its S^T and softmax were the critical path (~100 clocks a
// m64n48k16 wgmma against 24 at the full rate: one warpgroup's chain of fragment loads, conversions
// and issues; a phase profile and the e4m3 experiment in mla_verify_notes.md v17). Two chains of
// S^T overlap, and each warpgroup has two blocks' time for its softmax. O^T has a single max, so
// the running max stays one chain in block order: block i waits for block i - 1's max (the
// max-ready mbarrier of i % 2, published in shared memory with the factors), votes against it and
// publishes its own; each warpgroup's row sums follow the other's moves through those factors.
// Registers (setmaxnreg, the SM's 64K over 512 threads): value warpgroups 152 with one O^T fragment
// in flight, scores warpgroups 104 (session 24's build at 144 / 112, with the refill behind a
// barrier: 2.9-4.6% slower L2-resident from 8K at batch >= 128, 1.3-1.6% below, v24).
// (The split 168 / 88 with two O^T fragments spilled the scores warpgroups' loop and was slower than
// one scores warpgroup, v18; with the e4m3 S^T, 160 / 96 and two fragments was no faster, v23.)
// Measured (mla_ab_h200.json run 50, an H100, fp8, 12 heads): 15% faster than one scores warpgroup
// at batch 128 / 8K (234.7 against 270.2 us, 0.85 of the roofline), 22% at 128 / 32K, 19% at 256 / 8K,
// 4-9% at batch 32 from 8K, equal at 128 / 1K and 9% slower at 32 / 1K (few blocks a CTA: the chain's
// fill and the second warpgroup's start are not amortised).
//
// Built, measured and dropped: S^T's k-range split over the value warpgroups ("share", v17, no
// faster); O^T(i) held until S^T(i + 1) retired (0.7-4.7% faster with fp16 S^T, 2-5% slower with
// the e4m3 one, v23). The first version of this kernel had two warpgroups each doing everything for
// alternate blocks (the pair schedule transposed), no faster than the pair kernel (runs 37-38).
//
// Lazy rescaling: the running max moves only when a score passes it by more than kLazyMax, so the
// scores warpgroup votes (bar.red) on whether any did, and takes the columns' maxima only then: a
// vote per block instead of 36 shuffles and an exchange (at 8K-32K: 0.93-0.97 of the pair kernel's
// time before, 0.84-0.89 after; mla_ab_h200.json runs 39-40).
//
// Shared memory (226.5 KB): [Q_hi; Q_lo] (96 rows x 576 e4m3: four 128-column chunks with the
// 128-byte swizzle, the rope columns with the 64-byte one), 4 raw blocks x 36 KB, 4 P^T tiles
// (48 x 64 fp16), the maxima exchange of each scores warpgroup, 4 blocks' factors and flags, the
// final row sums, visible lengths, the running max and the chain's factors, 30 mbarriers.
// Same split-K, masking, NaN-safety and output contract as mla_verify_sm90.cu.

#include <cuda.h>

#include "kernels.h"

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
// accumulators and the softmax (they fit 104, notes v23).
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

// kGrouped: a request over several CTAs (head groups); without, the code of one CTA a request is
// the one-group kernel as it was (its row mapping compiled apart: sharing the grouped one's, a
// runtime choice, cost 1-7% at 12 heads, most at batch 32 / 1K; notes v25)
template <bool kGrouped>
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

  // request b, head group blockIdx.x: tile row r is query row j = r / head_group of head
  // blockIdx.x * head_group + r % head_group, row row_of(r) of the [B*Q, H] outputs
  const int b = blockIdx.z, hg = kGrouped ? p.head_group : p.heads;
  const int rows = kGrouped ? p.q_per_req * hg : p.rows_per_req;
  const long row_base = static_cast<long>(b) * p.rows_per_req;
  auto row_of = [&](int r) -> long {
    if (!kGrouped) return row_base + r;
    const int j = r / hg;
    return row_base + j * p.heads + blockIdx.x * hg + (r - j * hg);
  };
  // Q's global loads first: their latency overlaps the length read, the split range and the
  // first TMA issues (a CTA left without blocks drops them)
  constexpr int kPieces = kN * (kD / 8), kPer = (kPieces + kThreadsSwap - 1) / kThreadsSwap;
  uint4 qv[kPer];
  {
    const uint16_t* qg = reinterpret_cast<const uint16_t*>(p.q);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int i = tid + kThreadsSwap * k, r = i / (kD / 8), pc = i % (kD / 8);
      qv[k] = i < kPieces && r < rows
                  ? __ldg(reinterpret_cast<const uint4*>(qg + row_of(r) * kD + pc * 8))
                  : make_uint4(0, 0, 0, 0);
    }
  }
  {  // the request's largest |q|, per warp into the (not yet used) exchange
    float mx = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const uint32_t words[4] = {qv[k].x, qv[k].y, qv[k].z, qv[k].w};
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[u]));
        mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, o));
    if (lane == 0) reinterpret_cast<float*>(smem + L::kRed)[tid >> 5] = mx;
  }
  const uint32_t bar0 = sbase + L::kBar;  // slot sl, chunk c: bar0 + 8 (5 sl + c)
  const uint32_t rdy0 = bar0 + 8 * 20;     // P^T of a tile written (128 arrivals: the scores WG)
  const uint32_t fre0 = rdy0 + 8 * 4;      // P^T of a tile read (256 arrivals: the value WGs)
  const uint32_t mrd0 = fre0 + 8 * 4;      // block i % 2's max and factors published (128)
  if (tid == 0) {
    for (int i = 0; i < 20; ++i) mbar_init(bar0 + 8 * i, 1);
    for (int i = 0; i < 4; ++i)
      mbar_init(rdy0 + 8 * i, 128), mbar_init(fre0 + 8 * i, 256);
    for (int i = 0; i < 2; ++i) mbar_init(mrd0 + 8 * i, 128);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async();
  }
  const SplitRange sr = split_range(p, p.seq_lens[b], blockIdx.y);
  if (sr.nblk == 0) {
    if (tid < kThreads) write_unseen_rows(p, rows, row_of, blockIdx.y, sr.split_out(), tid);
    return;
  }
  const int nblk = sr.nblk, blo = sr.blo, n = sr.n;
  const int* bt = p.block_table + static_cast<long>(b) * p.bt_stride + blo;
  __syncthreads();  // the mbarriers are initialised, the warps' maxima of |q| written

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

  // Q as e4m3 for S^T: the power of two qs takes the request's largest |q| to [128, 256), and each
  // element splits into hi = e4m3(q qs) and lo = e4m3(16 (q qs - hi)), bf16's 8 significant bits
  // as two halves of 4 (exact but for elements below ~2^-14 of the max, where lo leaves e4m3's
  // range). Rows 0-47 of the B tile hold Q_hi, rows 48-95 Q_lo; 4 chunks of 128 columns with the
  // 128-byte swizzle and the 64 rope columns with the 64-byte one, as the cache's block.
  float qs;
  {
    float mx = 0.f;
    const float* wmax = reinterpret_cast<const float*>(smem + L::kRed);
#pragma unroll
    for (int k = 0; k < kThreadsSwap / 32; ++k) mx = fmaxf(mx, wmax[k]);
    const int ef = __float_as_int(mx) >> 23;  // mx in [2^(ef-127), 2^(ef-126))
    qs = __int_as_float(min(max(261 - ef, 1), 254) << 23);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int i = tid + kThreadsSwap * k, r = i / (kD / 8), pc = i % (kD / 8);
      if (i >= kPieces) break;
      const uint32_t words[4] = {qv[k].x, qv[k].y, qv[k].z, qv[k].w};
      uint32_t hi[2], lo[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float2 f0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[2 * u]));
        const float2 f1 =
            __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[2 * u + 1]));
        const float x[4] = {f0.x * qs, f0.y * qs, f1.x * qs, f1.y * qs};
        const uint32_t h = f32x4_to_e4m3x4(x[0], x[1], x[2], x[3]);
        float y[4];
        e4m3x4_to_f32x4(h, y);
        hi[u] = h;
        lo[u] = f32x4_to_e4m3x4(16.f * (x[0] - y[0]), 16.f * (x[1] - y[1]), 16.f * (x[2] - y[2]),
                                16.f * (x[3] - y[3]));
      }
      const int b = 8 * pc;  // the piece's first latent column
      const uint32_t a = b < kDV ? sbase + L::kQ + (b >> 7) * kQChunk + sw128_off(r, (b & 127) >> 4) +
                                       (b & 8)
                                 : sbase + L::kQ + kQRope + r * 64 +
                                       ((((b - kDV) >> 4) ^ ((r >> 1) & 3)) << 4) + (b & 8);
      const uint32_t lo_off = b < kDV ? kN * 128 : kN * 64;  // row r + 48 (same swizzle phase)
      st_shared(a, make_uint2(hi[0], hi[1]));
      st_shared(a + lo_off, make_uint2(lo[0], lo[1]));
    }
    if (tid < kN) {  // tile row r = j*hg + h sees n - (Q-1-j) tokens; padding rows none
      reinterpret_cast<int*>(smem + L::kVis)[tid] =
          tid < rows ? max(n - (p.q_per_req - 1 - tid / hg), 0) : 0;
      reinterpret_cast<float*>(smem + L::kM)[tid] = -INFINITY;
    }
    if (tid < 2) reinterpret_cast<int*>(smem + L::kCnt)[tid] = 0;
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
    // (p.scale_log2 carries 16 for the fp16 Q of the other fp8 paths; here Q is times qs)
    const float scale = p.scale_log2 * 0.0625f / qs;
    const float inv_scale = 1.f / scale, lazy_inv = kLazyMax * inv_scale;
    // the block's S^T (hi and lo columns), then in s[0..23] its scores, unscaled: the scale rides
    // on exp2's FFMA (and the max's 12)
    float s[48];
    float lsum[12];
#pragma unroll
    for (int c = 0; c < 12; ++c) lsum[c] = 0.f;
    // block j (the other warpgroup's): its max published; the row sums taken to it
    auto chain_in = [&](int j) {
      mbar_wait(mrd0 + 8 * (j & 1), (j >> 1) & 1, p.err, kErrMaxReady, blo + j, j & 1);
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
      st_block(s, slot, sbase + L::kQ, bar0 + 8 * 5 * sl, (i >> 2) & 1, p.err, blo + i);
      wgmma_wait<0>();
#pragma unroll
      for (int k = 0; k < 48; ++k) pin(s[k]);
#pragma unroll
      for (int k = 0; k < 24; ++k) s[k] = fmaf(s[24 + k], 0.0625f, s[k]);
      const int pos0 = (blo + i) * kPage;
      mask(s, pos0 + kPage > all_vis, pos0, vis, w, g, q);
      if (i > 0) chain_in(i - 1);
      float m_prev[12], m_new[12];
#pragma unroll
      for (int c = 0; c < 12; ++c) m_prev[c] = mrun[col_of(c, q)];
      // (the vote in block_max: every thread's loads of the slot and of mrun are done)
      const bool pass = passes(s, m_prev, inv_scale, lazy_inv);
      const bool moved = block_max(s, pass, m_prev, scale, m_new, red, wg, w, g, q);
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
      if (i >= 4) mbar_wait(fre0 + 8 * sl, ((i >> 2) - 1) & 1, p.err, kErrPtFree, blo + i, sl);
      if (moved && w == 0 && g == 0) {  // (cfac[i % 2] is next written by this warpgroup's i + 2)
#pragma unroll
        for (int c = 0; c < 12; ++c) fac[pt * kN + col_of(c, q)] = cfac[(i & 1) * kN + col_of(c, q)];
      }
      if (t == 0) flag[pt] = moved;
      store_pt(s, m_new, scale, lsum, sbase + L::kP + pt * kPTile, w, lane);
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
        if (col >= rows) continue;
        const float lse = l > 0.f ? (mrun[col] + __log2f(l)) * 0.69314718055994531f : -INFINITY;
        const long gr = row_of(col);
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
      // (every warp's lane 0 reads the page id: which warp issues the refill is known only at the
      // count below, and the load's latency must be spent before it)
      if (lane == 0 && i + 4 < nblk) pg = __ldg(bt + i + 4);
      mbar_wait(rdy0 + 8 * sl, (i >> 2) & 1, p.err, kErrPtReady, blo + i, sl);
      if (flag[sl]) rescale(sl);
      ot_block(acc, fr, sbase + L::kKV + sl * kRawBlock, sbase + L::kP + sl * kPTile, wg, w,
                     g, q, i > 0 ? fre0 + 8 * ((i - 1) & 3) : 0u);
      // The slot's value chunks are refilled by the warpgroup's last warp through with them: a
      // count, not a barrier, so no warp waits for the others (the barrier and one thread's issue,
      // at the same registers: -0.4 to +1.9% L2-resident, the most at 128 / 32K; run 77, v24). A
      // warp counts block i + 1 only after wgmmas of i + 1 that every warp issued after counting i,
      // so a block's four counts never mix with the next's.
      __syncwarp();
      if (lane == 0 && i + 4 < nblk && (atom_add_acq_rel(sbase + L::kCnt + 4 * wg, 1) & 3) == 3)
        issue(i + 4, pg, 2 * wg, 2, false);
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
    for (int i = tid; i < rows * (kDV / 8); i += 256) {  // 8 columns a thread
      const int col = i / (kDV / 8), d = (i % (kDV / 8)) * 8;
      const float l = lfin[col];
      const float inv = l > 0.f ? (f16 ? 1.f : p.out_scale) / l : 0.f;
      const float4 x0 = *reinterpret_cast<const float4*>(ost + col * kDV + d);
      const float4 x1 = *reinterpret_cast<const float4*>(ost + col * kDV + d + 4);
      *reinterpret_cast<uint4*>(dst + row_of(col) * stride + d) =
          make_uint4(pack2(x0.x * inv, x0.y * inv, f16), pack2(x0.z * inv, x0.w * inv, f16),
                     pack2(x1.x * inv, x1.y * inv, f16), pack2(x1.z * inv, x1.w * inv, f16));
    }
  }
}

cudaError_t launch_swap(const CUtensorMap& kv128, const CUtensorMap& kv64, const Params& p,
                        dim3 grid, cudaStream_t stream) {
  static const cudaError_t allowed[2] = {
      allow_smem(mla_verify_sm90_swap_kernel<false>, swap::Smem::kAlloc),
      allow_smem(mla_verify_sm90_swap_kernel<true>, swap::Smem::kAlloc)};
  const bool grouped = p.head_group != p.heads;
  if (allowed[grouped] != cudaSuccess) return allowed[grouped];
  const auto fn = grouped ? mla_verify_sm90_swap_kernel<true> : mla_verify_sm90_swap_kernel<false>;
  fn<<<grid, swap::kThreadsSwap, swap::Smem::kAlloc, stream>>>(kv128, kv64, p);
  return cudaGetLastError();
}

}  // namespace k3mla
