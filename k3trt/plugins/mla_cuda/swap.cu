// SM90 kernel for k3trt::mla_verify, "swap" schedule: an fp8-e4m3 cache and at most kSwapMaxRows
// (48) folded rows a CTA: a request's 12 heads x 4 query rows at TP 8, or at 48 / 96 heads (TP 2 /
// 1) one of its 4 / 8 head groups of 12 (grid x; the groups read the same pages at about the same
// time, mostly from L2). The pair kernel multiplies Q (64 rows, 16 of them padding at 12 heads) by
// the cache as wgmma's B operand, which must sit in shared memory, so an fp8 cache is expanded to
// fp16 there first: a shared-memory round trip on each warpgroup's path that costs ~20%. Here the
// tokens are the M dimension instead ("swap AB"):
//
//   S^T[64 tokens x 96] = K[64 x 576] · [Q_hi; Q_lo]^T    (e4m3 x e4m3, A and B in smem)
//   O^T[512 x 48] += V^T[512 x 64 tokens] · P^T[64 x 48]  (fp16: A = V^T from registers, B = P^T in smem)
//
// and no row is padding: the tensor work per token drops from 2·64·1088 to 2·48·1088 FLOP.
//
// S^T is an fp8 wgmma straight from the raw block as TMA lays it down (K-major, the value chunks
// with the 128-byte swizzle, the rope chunk with the 64-byte one): no loads, conversions or
// registers for its A operand. Q is split exactly into two e4m3 parts with a power-of-two scale
// (q_split), Q_hi as B's rows 0-47 and 16 Q_lo as rows 48-95, and the scores are S_hi + S_lo / 16.
// Twice the MACs at twice the rate: the tensor time is bf16's, but the scores warpgroups only issue
// 18 wgmmas a block (an fp16 S^T, its K fragment converted in registers, is 7-12% slower).
//
// V^T (A of O^T, M = value columns, K = tokens) from raw bytes, without shuffles: a thread needs
// tokens 2q, 2q+1, 2q+8, 2q+9 and value rows g, g+8 (g = lane / 4, q = lane % 4) of each of 4 64-row
// M tiles. The M order is free (the epilogue maps it back): thread (warp w, g) of value warpgroup h
// owns the 8 consecutive value columns 256h + 64w + 8g .. +7, so one 8-byte load per token and a
// byte permute (prmt) per pair of tokens feed all 4 M tiles; M tile i row 16w + g + 8e is value
// column 256h + 64w + 8g + 2i + e. The 128-byte swizzle keeps these loads conflict-free.
//
// Warp specialisation (512 threads), as in FlashAttention-3:
// - two scores warpgroups (2, 3) take alternate blocks ("ping-pong", scores_loop): S^T, the lazy
//   running max, P^T (to one of four shared tiles, by stmatrix .trans) and their row sums, and
//   publish, per block, whether the max moved and the factors (rare);
// - value warpgroups 0 and 1 (values_loop) each own 256 of the 512 value columns of O^T (4 M tiles
//   x 48 rows: 96 fp32 registers) and multiply every block's V^T · P^T into them in block order,
//   rescaling first when told.
// Per-block mbarriers (P^T ready: the block's scores warpgroup's 128 arrivals; P^T free: the value
// warpgroups' 256, once their wgmmas on the tile retired) let the scores warpgroups run up to three
// blocks ahead through a ring of four raw blocks (TMA, refilled four blocks ahead by the warpgroup
// that last reads each chunk: value chunks 0-1 by warpgroup 0's last warp through with them, 2-3 by
// warpgroup 1's, the rope chunk by the block's scores warpgroup, whose parity block i + 4 shares).
//
// Two scores warpgroups because one makes S^T and the softmax the critical path (~100 clocks a
// wgmma against 24 at the full rate: one warpgroup's chain of issues); two chains of S^T overlap,
// and each warpgroup has two blocks' time for its softmax (15-22% faster at batch 128 from 8K,
// slower only at batch 32 / 1K, where few blocks a CTA do not amortise the chain's fill). O^T has
// a single max, so the running max stays one chain in block order: block i waits for block i - 1's
// max (the max-ready mbarrier of i % 2, published in shared memory with the factors), votes against
// it and publishes its own; each warpgroup's row sums follow the other's moves through those
// factors. Registers (setmaxnreg, the SM's 64K over 512 threads): value warpgroups 152 with one
// O^T fragment in flight, scores warpgroups 104 (docs/mla_verify.md lists the splits that spill or
// run slower).
//
// Lazy rescaling: the running max moves only when a score passes it by more than kLazyMax, so the
// scores warpgroup votes (bar.red) on whether any did, and takes the columns' maxima only then: a
// vote per block instead of 36 shuffles and an exchange.
//
// Shared memory (226.5 KB): [Q_hi; Q_lo] (96 rows x 576 e4m3: four 128-column chunks with the
// 128-byte swizzle, the rope columns with the 64-byte one), 4 raw blocks x 36 KB, 4 P^T tiles
// (48 x 64 fp16), the maxima exchange of each scores warpgroup, 4 blocks' factors and flags, the
// final row sums, visible lengths, the running max and the chain's factors, 30 mbarriers.
// Same split-K, masking, NaN-safety and output contract as the pair kernel (pair.cu, common.cuh).

#include <cuda.h>

#include "kernels.h"
#include "swap_block.cuh"

namespace k3mla {
namespace swap {

// Q's pieces: 16 bytes of a row's 576 bf16, kPer a thread
constexpr int kPieces = kN * (kD / 8), kPer = (kPieces + kThreadsSwap - 1) / kThreadsSwap;

// What the phases of a swap CTA share: its shared memory and mbarriers, its blocks [blo, blo + nblk)
// of a request of n tokens and their pages, its tile rows, and this thread's place.
struct Cta {
  uint8_t* smem;
  uint32_t sbase;
  uint32_t bar0;  // slot sl, chunk c: bar0 + 8 (5 sl + c)
  uint32_t rdy0;  // P^T of a tile written (128 arrivals: the scores WG)
  uint32_t fre0;  // P^T of a tile read (256 arrivals: the value WGs)
  uint32_t mrd0;  // block i % 2's max and factors published (128)
  const int* bt;
  int nblk, blo, n, tail_blk;  // tail_blk: local index of the sequence's last block
  int rows, hg;                // tile rows: q_per_req x hg heads
  int tid, wg, t, w, lane, g, q;
  SplitRange sr;               // (split_out: with split-K partials)
};

// Q's global loads (issued first: their latency overlaps the length read, the split range and the
// first TMA issues; a CTA left without blocks drops them), and the request's largest |q|, per warp
// into the (not yet used) maxima exchange.
template <typename RowOf>
__device__ __forceinline__ void q_load(const Params& p, RowOf row_of, int rows, uint8_t* smem,
                                       int tid, int lane, uint4* qv) {
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
    if (lane == 0) reinterpret_cast<float*>(smem + Smem::kRed)[tid >> 5] = mx;
  }
}

// Q as e4m3 for S^T: the power of two qs takes the request's largest |q| to [128, 256), and each
// element splits into hi = e4m3(q qs) and lo = e4m3(16 (q qs - hi)), bf16's 8 significant bits
// as two halves of 4 (exact but for elements below ~2^-14 of the max, where lo leaves e4m3's
// range). Rows 0-47 of the B tile hold Q_hi, rows 48-95 Q_lo; 4 chunks of 128 columns with the
// 128-byte swizzle and the 64 rope columns with the 64-byte one, as the cache's block. Also the
// rows' visible lengths and the running max's start. Returns qs.
__device__ __forceinline__ float q_split(const Params& p, uint8_t* smem, uint32_t sbase, int n,
                                         int rows, int hg, int tid, const uint4* qv) {
  float mx = 0.f;
  const float* wmax = reinterpret_cast<const float*>(smem + Smem::kRed);
#pragma unroll
  for (int k = 0; k < kThreadsSwap / 32; ++k) mx = fmaxf(mx, wmax[k]);
  const int ef = __float_as_int(mx) >> 23;  // mx in [2^(ef-127), 2^(ef-126))
  const float qs = __int_as_float(min(max(261 - ef, 1), 254) << 23);
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
    const uint32_t a = b < kDV ? sbase + Smem::kQ + (b >> 7) * kQChunk + sw128_off(r, (b & 127) >> 4) +
                                     (b & 8)
                               : sbase + Smem::kQ + kQRope + r * 64 +
                                     ((((b - kDV) >> 4) ^ ((r >> 1) & 3)) << 4) + (b & 8);
    const uint32_t lo_off = b < kDV ? kN * 128 : kN * 64;  // row r + 48 (same swizzle phase)
    st_shared(a, make_uint2(hi[0], hi[1]));
    st_shared(a + lo_off, make_uint2(lo[0], lo[1]));
  }
  if (tid < kN) {  // tile row r = j*hg + h sees n - (Q-1-j) tokens; padding rows none
    reinterpret_cast<int*>(smem + Smem::kVis)[tid] =
        tid < rows ? max(n - (p.q_per_req - 1 - tid / hg), 0) : 0;
    reinterpret_cast<float*>(smem + Smem::kM)[tid] = -INFINITY;
  }
  if (tid < 2) reinterpret_cast<int*>(smem + Smem::kCnt)[tid] = 0;
  fence_proxy_async();
  return qs;
}

// Scores warpgroup sw = wg - 2 takes blocks sw, sw + 2, ...: S^T, the lazy running max (one chain
// through the blocks in order: the value warpgroups' O^T has a single max; block i waits for block
// i - 1's max (the max-ready mbarrier of i % 2), votes against it, and publishes its own), P^T and
// this thread's row sums (lsum), which follow the other warpgroup's moves by the chain's factors
// and end at the final max.
template <typename Issue>
__device__ __forceinline__ void scores_loop(const Params& p, const Cta& cta, float qs, Issue issue,
                                            float* lsum) {
  uint8_t* const smem = cta.smem;
  const uint32_t sbase = cta.sbase;
  const uint32_t bar0 = cta.bar0;
  const uint32_t rdy0 = cta.rdy0;
  const uint32_t fre0 = cta.fre0;
  const uint32_t mrd0 = cta.mrd0;
  const int* const bt = cta.bt;
  const int nblk = cta.nblk;
  const int blo = cta.blo;
  const int n = cta.n;
  const int tail_blk = cta.tail_blk;
  const int wg = cta.wg;
  const int t = cta.t;
  const int w = cta.w;
  const int lane = cta.lane;
  const int g = cta.g;
  const int q = cta.q;
  float* fac = reinterpret_cast<float*>(smem + Smem::kFac);
  volatile int* flag = reinterpret_cast<volatile int*>(smem + Smem::kFlag);
  const int sw = wg - 2;
  const int* vis = reinterpret_cast<const int*>(smem + Smem::kVis);
  const int all_vis = max(n - (p.q_per_req - 1), 0);  // blocks ending here are seen by every row
  float* red = reinterpret_cast<float*>(smem + Smem::kRed) + sw * 4 * kN;
  float* mrun = reinterpret_cast<float*>(smem + Smem::kM);
  float* cfac = reinterpret_cast<float*>(smem + Smem::kChain);
  volatile int* cflag = reinterpret_cast<volatile int*>(smem + Smem::kCFlag);
  // (p.scale_log2 carries 16 for the fp16 Q of the other fp8 paths; here Q is times qs)
  const float scale = p.scale_log2 * 0.0625f / qs;
  const float inv_scale = 1.f / scale, lazy_inv = kLazyMax * inv_scale;
  // the block's S^T (hi and lo columns), then in s[0..23] its scores, unscaled: the scale rides
  // on exp2's FFMA (and the max's 12)
  float s[48];
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
    const uint32_t slot = sbase + Smem::kKV + sl * kRawBlock;
    int pg = 0;
    if (t == 0 && i + 4 < nblk) pg = __ldg(bt + i + 4);
    st_block(s, slot, sbase + Smem::kQ, bar0 + 8 * 5 * sl, (i >> 2) & 1, p.err, blo + i);
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
    store_pt(s, m_new, scale, lsum, sbase + Smem::kP + pt * kPTile, w, lane);
    if (i == tail_blk) {  // raw fp8 rows past the length, zeroed before O^T reads them
      zero_tail_rows(slot, n - (blo + i) * kPage, t);
    }
    fence_proxy_async();
    mbar_arrive(rdy0 + 8 * pt);
  }
  if (((nblk - 1) & 1) != sw) chain_in(nblk - 1);  // the row sums at the final max
}

// The row sums over the 8 lanes of a column, the 4 warps and the 2 scores warpgroups into lfin, and
// each row's LSE (the split's partial LSE with split-K).
template <typename RowOf>
__device__ __forceinline__ void scores_epilogue(const Params& p, const Cta& cta, RowOf row_of,
                                                float* lsum) {
  uint8_t* const smem = cta.smem;
  const int rows = cta.rows;
  const int w = cta.w;
  const int g = cta.g;
  const int q = cta.q;
  const int sw = cta.wg - 2;
  float* red = reinterpret_cast<float*>(smem + Smem::kRed) + sw * 4 * kN;
  const float* mrun = reinterpret_cast<const float*>(smem + Smem::kM);
  float* lfin = reinterpret_cast<float*>(smem + Smem::kL);
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
    const float* red2 = reinterpret_cast<const float*>(smem + Smem::kRed);
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
      if (cta.sr.split_out()) p.part_lse[gr * p.num_splits + blockIdx.y] = lse;
      else p.lse[gr] = lse;
    }
  }
  __syncthreads();  // lfin is complete
}

// Value warpgroup wg: O^T[256 wg ..] += V^T · P^T over every block in order, rescaled first where
// a block moved the running max (rare), each slot's value chunks refilled by the warpgroup's last
// warp through with them.
template <typename Issue>
__device__ __forceinline__ void values_loop(const Params& p, const Cta& cta, Issue issue, float* acc) {
  const uint32_t sbase = cta.sbase;
  const uint32_t rdy0 = cta.rdy0;
  const uint32_t fre0 = cta.fre0;
  const int* const bt = cta.bt;
  const int nblk = cta.nblk;
  const int blo = cta.blo;
  const int wg = cta.wg;
  const int w = cta.w;
  const int lane = cta.lane;
  const int g = cta.g;
  const int q = cta.q;
  uint8_t* const smem = cta.smem;
  float* fac = reinterpret_cast<float*>(smem + Smem::kFac);
  volatile int* flag = reinterpret_cast<volatile int*>(smem + Smem::kFlag);
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
    ot_block(acc, fr, sbase + Smem::kKV + sl * kRawBlock, sbase + Smem::kP + sl * kPTile, wg, w,
                   g, q, i > 0 ? fre0 + 8 * ((i - 1) & 3) : 0u);
    // The slot's value chunks are refilled by the warpgroup's last warp through with them: a
    // count, not a barrier, so no warp waits for the others (the barrier and one thread's issue,
    // at the same registers: -0.4 to +1.9% L2-resident, the most at 128 / 32K). A
    // warp counts block i + 1 only after wgmmas of i + 1 that every warp issued after counting i,
    // so a block's four counts never mix with the next's.
    __syncwarp();
    if (lane == 0 && i + 4 < nblk && (atom_add_acq_rel(sbase + Smem::kCnt + 4 * wg, 1) & 3) == 3)
      issue(i + 4, pg, 2 * wg, 2, false);
  }
  wgmma_wait<0>();
  pin_acc(acc);
}

// O^T staged in shared memory, normalised by the final row sums (lfin) and stored as bf16 output
// rows, or with split-K as the split's fp16 partial in the cache's units.
template <typename RowOf>
__device__ __forceinline__ void values_epilogue(const Params& p, const Cta& cta, RowOf row_of,
                                                float* acc) {
  uint8_t* const smem = cta.smem;
  const int rows = cta.rows;
  const int tid = cta.tid;
  const int wg = cta.wg;
  const int w = cta.w;
  const int g = cta.g;
  const int q = cta.q;
  float* lfin = reinterpret_cast<float*>(smem + Smem::kL);
  // O^T -> shared memory as fp32 rows [48][512] over the KV stages, once both value warpgroups
  // have read every block (the other one can still be a block or more behind: without this
  // barrier its last V reads could see the staged floats), then normalised and stored in whole
  // 16-byte pieces of rows.
  named_bar(kBarValues, 256);
  float* ost = reinterpret_cast<float*>(smem + Smem::kKV);
#pragma unroll
  for (int c = 0; c < 12; ++c)
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int jn = c >> 1, e = c & 1;
      *reinterpret_cast<float2*>(ost + col_of(c, q) * kDV + 256 * wg + 64 * w + 8 * g + 2 * m) =
          make_float2(acc[24 * m + 4 * jn + e], acc[24 * m + 4 * jn + 2 + e]);
    }
  __syncthreads();  // lfin and the staged rows are complete
  const bool split_out = cta.sr.split_out();
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

}  // namespace swap

// kGrouped: a request over several CTAs (head groups); without, one CTA a request, whose row
// mapping is compiled apart (sharing the grouped one's, a runtime choice, costs 1-7% at 12 heads,
// most at batch 32 / 1K)
template <bool kGrouped>
__global__ void __launch_bounds__(swap::kThreadsSwap, 1)
    mla_verify_sm90_swap_kernel(const __grid_constant__ CUtensorMap kv128,
                                const __grid_constant__ CUtensorMap kv64, const Params p) {
  using namespace swap;
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
  uint4 qv[kPer];
  q_load(p, row_of, rows, smem, tid, lane, qv);
  const uint32_t bar0 = sbase + Smem::kBar;  // slot sl, chunk c: bar0 + 8 (5 sl + c)
  const uint32_t rdy0 = bar0 + 8 * 20;        // P^T of a tile written (128 arrivals: the scores WG)
  const uint32_t fre0 = rdy0 + 8 * 4;         // P^T of a tile read (256 arrivals: the value WGs)
  const uint32_t mrd0 = fre0 + 8 * 4;         // block i % 2's max and factors published (128)
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
    const uint32_t slot = sbase + Smem::kKV + sl * kRawBlock;
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

  const float qs = q_split(p, smem, sbase, n, rows, hg, tid, qv);
  __syncthreads();
  const Cta cta{smem, sbase, bar0, rdy0, fre0, mrd0, bt, nblk, blo, n, (n - 1) / kPage - blo,
                rows, hg, tid, wg, t, w, lane, g, q, sr};
  if (wg >= 2) {
    regs_dec<kRegsScores>();
    float lsum[12];
    scores_loop(p, cta, qs, issue, lsum);
    scores_epilogue(p, cta, row_of, lsum);
  } else {
    regs_inc<kRegsValue>();
    float acc[96];
    values_loop(p, cta, issue, acc);
    values_epilogue(p, cta, row_of, acc);
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
