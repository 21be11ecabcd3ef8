// MlaVerify with tensor cores through mma.sync (bf16 m16n8k16, fp32 accumulate): the kernel for
// GPUs without the SM90 kernels' wgmma/TMA, first of all TensorRT-RTX's SM120 target. mma.sync
// runs on sm_80 and later, so the library's sm_90a part carries it too and it is validated on an
// H200 through the harness (K3TRT_MLA_KERNEL=mma). Same semantics as the plain kernel for what it
// takes: bf16 q [B*Q, H, width], a bf16 or fp8 cache [pages, page, width], width a multiple of 16
// up to 576, d_v a multiple of 32 up to 512, no DCP, no sparse policy.
//
// One CTA of 4 warps per (request, 16 folded rows (j, h) of its Q*H): the 16 q rows in shared
// memory; per tile of 16 cache tokens (read once for the 16 rows, fp8 widened to bf16, tokens past
// the request's length zeroed so that an unwritten slot's NaN never meets a zero weight), warps 0-1
// compute the 16x16 scores (Q K^T, 8 tokens each), 16 threads run the online softmax per row (the
// row's causal length masks), and each warp accumulates P V into its quarter of d_v in registers.
#include "mla_verify_mma.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace k3trt
{
namespace
{
constexpr int32_t kRows = 16, kTile = 16, kWarps = 4, kMaxWidth = 576, kMaxDv = 512;
constexpr int32_t kMaxNTiles = kMaxDv / kWarps / 8;   // n8 tiles of d_v per warp

struct MmaArgs
{
    void const* q;
    void const* kv;
    bool kvFp8;
    int32_t const* blockTable;
    int32_t const* seqLens;
    __nv_bfloat16* out;
    float* lse;
    int32_t qPerReq, heads, width, dv, page, maxBlocks;
    float scale, kvScale;   // scale: softmax_scale * kv_scale (scores); kvScale: the values
};

__device__ __forceinline__ void mma16816(float* d, uint32_t const* a, uint32_t const* b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ uint32_t pack(__nv_bfloat16 lo, __nv_bfloat16 hi)
{
    return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

__global__ void __launch_bounds__(kWarps * 32) mlaVerifyMmaKernel(MmaArgs a)
{
    __shared__ __align__(16) __nv_bfloat16 qs[kRows][kMaxWidth];
    __shared__ __align__(16) __nv_bfloat16 kvs[kTile][kMaxWidth];
    __shared__ float scores[kRows][kTile];
    __shared__ __align__(16) __nv_bfloat16 probs[kRows][kTile];
    __shared__ float rowMax[kRows], rowSum[kRows], rowAlpha[kRows];
    __shared__ int32_t rowVisible[kRows];

    int32_t const b = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int32_t const folded = a.qPerReq * a.heads, row0 = blockIdx.y * kRows;
    int64_t const seqLen = a.seqLens[b] > 0 ? a.seqLens[b] : 0;
    int32_t const W = a.width;

    // the 16 rows: q (zero past the request's rows), their causal lengths, the softmax state
    for (int32_t i = tid; i < kRows * W; i += blockDim.x)
    {
        int32_t const r = i / W, d = i % W, fr = row0 + r;
        __nv_bfloat16 v = __float2bfloat16(0.f);
        if (fr < folded)
        {
            int64_t const qRow = static_cast<int64_t>(b) * a.qPerReq + fr / a.heads;
            v = static_cast<__nv_bfloat16 const*>(a.q)[(qRow * a.heads + fr % a.heads) * W + d];
        }
        qs[r][d] = v;
    }
    if (tid < kRows)
    {
        int32_t const fr = row0 + tid;
        int64_t const vis = fr < folded ? seqLen - (a.qPerReq - 1 - fr / a.heads) : 0;
        rowVisible[tid] = static_cast<int32_t>(vis > 0 ? vis : 0);
        rowMax[tid] = -INFINITY;
        rowSum[tid] = 0.f;
    }
    int32_t const nTiles = a.dv / kWarps / 8, colBase = warp * (a.dv / kWarps);
    float acc[kMaxNTiles][4];
#pragma unroll
    for (int32_t n = 0; n < kMaxNTiles; ++n)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    __syncthreads();
    int32_t tokens = 0;
    for (int32_t r = 0; r < kRows; ++r)
        tokens = rowVisible[r] > tokens ? rowVisible[r] : tokens;

    int32_t const g = lane / 4, c2 = (lane % 4) * 2;   // the mma fragments' row group and column pair
    for (int32_t start = 0; start < tokens; start += kTile)
    {
        // 1. the tile's cache rows (bf16), zero past the last visible token
        for (int32_t i = tid; i < kTile * W; i += blockDim.x)
        {
            int32_t const t = i / W, d = i % W;
            int64_t const tok = start + t;
            float v = 0.f;
            if (tok < tokens)
            {
                int64_t const pageId = a.blockTable[static_cast<int64_t>(b) * a.maxBlocks + tok / a.page];
                int64_t const idx = (pageId * a.page + tok % a.page) * W + d;
                v = a.kvFp8 ? static_cast<float>(static_cast<__nv_fp8_e4m3 const*>(a.kv)[idx])
                            : __bfloat162float(static_cast<__nv_bfloat16 const*>(a.kv)[idx]);
            }
            kvs[t][d] = __float2bfloat16(v);
        }
        __syncthreads();
        // 2. scores: warp w < 2 takes tokens 8w..8w+7 (B[k][n] = K[token n][dim k])
        if (warp < 2)
        {
            float s[4] = {0.f, 0.f, 0.f, 0.f};
            for (int32_t k0 = 0; k0 < W; k0 += 16)
            {
                uint32_t af[4] = {*reinterpret_cast<uint32_t const*>(&qs[g][k0 + c2]),
                    *reinterpret_cast<uint32_t const*>(&qs[g + 8][k0 + c2]),
                    *reinterpret_cast<uint32_t const*>(&qs[g][k0 + c2 + 8]),
                    *reinterpret_cast<uint32_t const*>(&qs[g + 8][k0 + c2 + 8])};
                uint32_t bf[2] = {*reinterpret_cast<uint32_t const*>(&kvs[warp * 8 + g][k0 + c2]),
                    *reinterpret_cast<uint32_t const*>(&kvs[warp * 8 + g][k0 + c2 + 8])};
                mma16816(s, af, bf);
            }
            scores[g][warp * 8 + c2] = s[0] * a.scale;
            scores[g][warp * 8 + c2 + 1] = s[1] * a.scale;
            scores[g + 8][warp * 8 + c2] = s[2] * a.scale;
            scores[g + 8][warp * 8 + c2 + 1] = s[3] * a.scale;
        }
        __syncthreads();
        // 3. online softmax, one thread per row
        if (tid < kRows)
        {
            int32_t const vis = rowVisible[tid];
            float tileMax = -INFINITY;
            for (int32_t t = 0; t < kTile; ++t)
                if (start + t < vis)
                    tileMax = fmaxf(tileMax, scores[tid][t]);
            float const m = rowMax[tid], mNew = fmaxf(m, tileMax);
            float const alpha = isinf(mNew) ? 1.f : (isinf(m) ? 0.f : expf(m - mNew));
            float sum = 0.f;
            for (int32_t t = 0; t < kTile; ++t)
            {
                float const p = start + t < vis ? expf(scores[tid][t] - mNew) : 0.f;
                sum += p;
                probs[tid][t] = __float2bfloat16(p);
            }
            rowMax[tid] = mNew;
            rowSum[tid] = rowSum[tid] * alpha + sum;
            rowAlpha[tid] = alpha;
        }
        __syncthreads();
        // 4. O = O * alpha + P V over this warp's d_v columns (B[k][n] = V[token k][column n])
        float const alphaLo = rowAlpha[g], alphaHi = rowAlpha[g + 8];
        uint32_t pf[4] = {*reinterpret_cast<uint32_t const*>(&probs[g][c2]),
            *reinterpret_cast<uint32_t const*>(&probs[g + 8][c2]),
            *reinterpret_cast<uint32_t const*>(&probs[g][c2 + 8]),
            *reinterpret_cast<uint32_t const*>(&probs[g + 8][c2 + 8])};
#pragma unroll
        for (int32_t n = 0; n < kMaxNTiles; ++n)
        {
            if (n >= nTiles)   // (a static bound, so acc stays in registers)
                break;
            acc[n][0] *= alphaLo, acc[n][1] *= alphaLo, acc[n][2] *= alphaHi, acc[n][3] *= alphaHi;
            int32_t const col = colBase + n * 8 + g;
            uint32_t bf[2] = {pack(kvs[c2][col], kvs[c2 + 1][col]), pack(kvs[c2 + 8][col], kvs[c2 + 9][col])};
            mma16816(acc[n], pf, bf);
        }
        __syncthreads();
    }

    // 5. out = O / l (0 for a row that sees nothing), lse = m + log l
    for (int32_t half = 0; half < 2; ++half)
    {
        int32_t const r = g + 8 * half, fr = row0 + r;
        if (fr >= folded)
            continue;
        float const l = rowSum[r], inv = l > 0.f ? a.kvScale / l : 0.f;
        int64_t const outRow = (static_cast<int64_t>(b) * a.qPerReq + fr / a.heads) * a.heads + fr % a.heads;
#pragma unroll
        for (int32_t n = 0; n < kMaxNTiles; ++n)
        {
            if (n >= nTiles)
                break;
            int32_t const col = colBase + n * 8 + c2;
            a.out[outRow * a.dv + col] = __float2bfloat16(acc[n][2 * half] * inv);
            a.out[outRow * a.dv + col + 1] = __float2bfloat16(acc[n][2 * half + 1] * inv);
        }
        if (warp == 0 && lane % 4 == 0)
            a.lse[outRow] = l > 0.f ? rowMax[r] + logf(l) : -INFINITY;
    }
}
} // namespace

bool mlaMmaTakes(PluginTensorDesc const* in, MlaMmaConfig const& c)
{
    Dims const &q = in[0].dims, &kv = in[1].dims;
    return c.dcpSize == 1 && c.sparseChunk <= 0 && c.dv % (kWarps * 8) == 0 && c.dv <= kMaxDv
        && in[0].type == DataType::kBF16 && (in[1].type == DataType::kBF16 || in[1].type == DataType::kFP8)
        && q.nbDims == 3 && q.d[2] % 16 == 0 && q.d[2] <= kMaxWidth && c.dv <= q.d[2] && kv.nbDims == 3
        && kv.d[2] == q.d[2];
}

cudaError_t mlaMmaRun(PluginTensorDesc const* in, MlaMmaConfig const& c, void const* const* inputs,
    void* const* outputs, cudaStream_t stream)
{
    Dims const &q = in[0].dims, &kv = in[1].dims, &bt = in[2].dims;
    int32_t const batch = static_cast<int32_t>(bt.d[0]), heads = static_cast<int32_t>(q.d[1]);
    if (batch == 0 || heads == 0)
        return cudaSuccess;
    MmaArgs a{inputs[0], inputs[1], in[1].type == DataType::kFP8, static_cast<int32_t const*>(inputs[2]),
        static_cast<int32_t const*>(inputs[3]), static_cast<__nv_bfloat16*>(outputs[0]), static_cast<float*>(outputs[1]),
        c.qPerReq, heads, static_cast<int32_t>(q.d[2]), c.dv, static_cast<int32_t>(kv.d[1]),
        static_cast<int32_t>(bt.d[1]), c.softmaxScale * c.kvScale, c.kvScale};
    dim3 grid(batch, (c.qPerReq * heads + kRows - 1) / kRows);
    mlaVerifyMmaKernel<<<grid, kWarps * 32, 0, stream>>>(a);
    return cudaGetLastError();
}
} // namespace k3trt
