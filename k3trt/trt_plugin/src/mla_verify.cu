// MlaVerify: q, kv_cache, block_table, seq_lens -> out, lse (k3trt/plugins/mla_verify.py, whose
// docstring is the contract: absorbed MLA over a paged latent cache, causal over the Q rows of a
// request, DCP-local lengths, the optional sparse chunk policy). One block per (query row, head),
// online softmax over tiles of cache tokens, fp32 throughout: the fallback. The kernel a call runs
// (kernelFor): on SM90 the torch op's SM90 kernels where they take the call (mla_verify_sm90.cu),
// else the mma.sync kernel where it takes it (mla_verify_mma.cu: bf16 q, SM120's fast path), else
// this one. K3TRT_MLA_KERNEL (plain | mma | sm90 | auto, the default), read when the plugin is
// created, narrows the choice to one kernel and the fallback (tests and benchmarks compare them).
#include "mla_verify_mma.h"
#include "mla_verify_sm90.h"
#include "plugin.h"

#include <cstdlib>
#include <string>

namespace k3trt
{
namespace
{
std::vector<FieldSpec> const kFields = {
    {"q_per_req", PluginFieldType::kINT32, ""},
    {"softmax_scale", PluginFieldType::kFLOAT32, ""},
    {"kv_scale", PluginFieldType::kFLOAT32, "1.0"},
    {"d_v", PluginFieldType::kINT32, "512"},
    {"dcp_size", PluginFieldType::kINT32, "1"},
    {"dcp_rank", PluginFieldType::kINT32, "0"},
    {"dcp_interleave", PluginFieldType::kINT32, "1"},
    {"sparse_chunk", PluginFieldType::kINT32, "0"},
    {"sparse_sink", PluginFieldType::kINT32, "1"},
    {"sparse_stride", PluginFieldType::kINT32, "1"},
    {"sparse_recent", PluginFieldType::kINT32, "1"},
};

struct Params
{
    int32_t qPerReq, dv, dcpSize, dcpRank, dcpInterleave, sparseChunk, sparseSink, sparseStride, sparseRecent;
    float softmaxScale, kvScale;
};

constexpr int32_t kThreads = 128;
constexpr int32_t kMaxDvPerThread = 8;   // d_v <= 1024
constexpr int32_t kMaxD = 1024;

__device__ int64_t localLen(int64_t length, Params const& p)
{
    if (p.dcpSize == 1)
        return length;
    int64_t const span = static_cast<int64_t>(p.dcpSize) * p.dcpInterleave;
    int64_t tail = length % span - static_cast<int64_t>(p.dcpRank) * p.dcpInterleave;
    tail = tail < 0 ? 0 : (tail > p.dcpInterleave ? p.dcpInterleave : tail);
    return (length / span) * p.dcpInterleave + tail;
}

__device__ bool sparseKeeps(int64_t token, int64_t n, Params const& p)
{
    if (p.sparseChunk <= 0)
        return true;
    int64_t const c = token / p.sparseChunk;
    int64_t const chunks = (n + p.sparseChunk - 1) / p.sparseChunk;
    int64_t const rel = c - p.sparseSink;
    // Python's % is non-negative for a positive stride; C++'s follows the dividend's sign
    int64_t const mod = ((rel % p.sparseStride) + p.sparseStride) % p.sparseStride;
    return c < p.sparseSink || c >= chunks - p.sparseRecent || mod == 0;
}

__global__ void __launch_bounds__(kThreads) mlaVerifyKernel(void const* q, DataType qType, void const* kv,
    DataType kvType, int32_t const* blockTable, int32_t const* seqLens, void* out, float* lse, int32_t heads,
    int32_t width, int32_t page, int32_t maxBlocks, Params p)
{
    __shared__ float qs[kMaxD];
    __shared__ float scores[kThreads];
    __shared__ float reduce[kThreads / 32];
    __shared__ float mShared, totalShared;

    int32_t const row = blockIdx.x / heads, head = blockIdx.x % heads, tid = threadIdx.x;
    int32_t const b = row / p.qPerReq, j = row % p.qPerReq;
    int64_t const seqLen = seqLens[b];
    int64_t const n = localLen(seqLen > 0 ? seqLen : 0, p);   // the request's full local length
    int64_t global = seqLen - (p.qPerReq - 1 - j);
    int64_t const visible = localLen(global > 0 ? global : 0, p);

    int64_t const qBase = (static_cast<int64_t>(row) * heads + head) * width;
    for (int32_t d = tid; d < width; d += kThreads)
        qs[d] = load(q, qBase + d, qType);
    float acc[kMaxDvPerThread];
    for (int32_t i = 0; i < kMaxDvPerThread; ++i)
        acc[i] = 0.f;
    float m = -INFINITY, total = 0.f;
    __syncthreads();

    for (int64_t start = 0; start < visible; start += kThreads)
    {
        // 1. one token per thread: its score (or -inf when masked)
        int64_t const t = start + tid;
        float s = -INFINITY;
        if (t < visible && sparseKeeps(t, n, p))
        {
            int64_t const pageId = blockTable[static_cast<int64_t>(b) * maxBlocks + t / page];
            int64_t const base = (pageId * page + t % page) * width;
            float dot = 0.f;
            for (int32_t d = 0; d < width; ++d)
                dot += qs[d] * load(kv, base + d, kvType);
            s = dot * p.kvScale * p.softmaxScale;
        }
        scores[tid] = s;
        // 2. the tile's max, the running max and the rescale of what came before
        float tileMax = s;
        for (int32_t o = 16; o > 0; o >>= 1)
            tileMax = fmaxf(tileMax, __shfl_xor_sync(0xffffffffu, tileMax, o));
        if (tid % 32 == 0)
            reduce[tid / 32] = tileMax;
        __syncthreads();
        if (tid == 0)
        {
            float mx = reduce[0];
            for (int32_t w = 1; w < kThreads / 32; ++w)
                mx = fmaxf(mx, reduce[w]);
            mShared = fmaxf(m, mx);
        }
        __syncthreads();
        float const mNew = mShared;
        if (isinf(mNew) && mNew < 0)
        {
            __syncthreads();   // nothing seen yet: keep m = -inf, acc = 0
            continue;
        }
        float const alpha = isinf(m) ? 0.f : expf(m - mNew);
        float const pr = isinf(s) ? 0.f : expf(s - mNew);
        scores[tid] = pr;
        float part = pr;
        for (int32_t o = 16; o > 0; o >>= 1)
            part += __shfl_xor_sync(0xffffffffu, part, o);
        __syncthreads();
        if (tid % 32 == 0)
            reduce[tid / 32] = part;
        __syncthreads();
        if (tid == 0)
        {
            float sum = 0.f;
            for (int32_t w = 0; w < kThreads / 32; ++w)
                sum += reduce[w];
            totalShared = sum;
        }
        __syncthreads();
        total = total * alpha + totalShared;
        m = mNew;
        // 3. values: thread tid owns columns tid, tid + kThreads, ...
        int64_t const count = visible - start < kThreads ? visible - start : kThreads;
        for (int32_t i = 0; i < kMaxDvPerThread; ++i)
            acc[i] *= alpha;
        for (int64_t k = 0; k < count; ++k)
        {
            float const w = scores[k];
            if (w == 0.f)
                continue;   // masked: the row may hold NaN and must not be read
            int64_t const tk = start + k;
            int64_t const pageId = blockTable[static_cast<int64_t>(b) * maxBlocks + tk / page];
            int64_t const base = (pageId * page + tk % page) * width;
            for (int32_t i = 0; i < kMaxDvPerThread; ++i)
            {
                int32_t const d = tid + i * kThreads;
                if (d < p.dv)
                    acc[i] += w * load(kv, base + d, kvType) * p.kvScale;
            }
        }
        __syncthreads();
    }

    int64_t const outBase = (static_cast<int64_t>(row) * heads + head) * p.dv;
    for (int32_t i = 0; i < kMaxDvPerThread; ++i)
    {
        int32_t const d = tid + i * kThreads;
        if (d < p.dv)
            store(out, outBase + d, total > 0.f ? acc[i] / total : 0.f, qType);
    }
    if (tid == 0)
        lse[static_cast<int64_t>(row) * heads + head] = total > 0.f ? m + logf(total) : -INFINITY;
}

class MlaVerify : public OpPlugin
{
public:
    MlaVerify(Attributes const& a)
        : OpPlugin("MlaVerify", kFields, a)
    {
        mP = Params{static_cast<int32_t>(a.i("q_per_req")), static_cast<int32_t>(a.i("d_v")),
            static_cast<int32_t>(a.i("dcp_size")), static_cast<int32_t>(a.i("dcp_rank")),
            static_cast<int32_t>(a.i("dcp_interleave")), static_cast<int32_t>(a.i("sparse_chunk")),
            static_cast<int32_t>(a.i("sparse_sink")), static_cast<int32_t>(a.i("sparse_stride")),
            static_cast<int32_t>(a.i("sparse_recent")), static_cast<float>(a.f("softmax_scale")),
            static_cast<float>(a.f("kv_scale"))};
        mSm90 = MlaSm90Config{mP.qPerReq, mP.dv, mP.dcpSize, mP.sparseChunk, mP.softmaxScale, mP.kvScale};
        mMma = MlaMmaConfig{mP.qPerReq, mP.dv, mP.dcpSize, mP.sparseChunk, mP.softmaxScale, mP.kvScale};
        char const* kernel = std::getenv("K3TRT_MLA_KERNEL");
        mKernels = kernel == nullptr ? "auto" : kernel;
    }
    std::string invalid() const
    {
        if (mP.qPerReq < 1 || mP.dv < 1 || mP.dv > kThreads * kMaxDvPerThread)
            return "q_per_req must be >= 1 and d_v in [1, 1024]";
        if (mP.dcpSize < 1 || mP.dcpRank < 0 || mP.dcpRank >= mP.dcpSize || mP.dcpInterleave < 1 || mP.sparseStride < 1)
            return "bad DCP (dcp_size, dcp_rank, dcp_interleave) or sparse_stride";
        return "";
    }
    int32_t nbInputs() const noexcept override { return 4; }
    int32_t nbOut() const noexcept override { return 2; }
    bool outputTypes(DataType* out, DataType const* in) const noexcept override
    {
        out[0] = in[0];
        out[1] = DataType::kFLOAT;
        return isFloat(in[0]);
    }
    bool shapes(DimsExprs const* in, DimsExprs* out, IExprBuilder& b) const noexcept override
    {
        if (in[0].nbDims != 3 || in[1].nbDims != 3 || in[2].nbDims != 2 || in[3].nbDims != 1)
            return false;
        out[0] = in[0];
        out[0].d[2] = b.constant(mP.dv);
        out[1].nbDims = 2;
        out[1].d[0] = in[0].d[0];
        out[1].d[1] = in[0].d[1];
        return true;
    }
    bool supportsType(int32_t pos, PluginTensorDesc const* io) const noexcept override
    {
        switch (pos)
        {
        case 0: return isFloat(io[0].type);
        case 1: return io[1].type == io[0].type || io[1].type == DataType::kFP8;
        case 2:
        case 3: return io[pos].type == DataType::kINT32;
        case 4: return io[4].type == io[0].type;
        default: return io[5].type == DataType::kFLOAT;
        }
    }
    std::string check(PluginTensorDesc const* in, PluginTensorDesc const*) const noexcept override
    {
        Dims const &q = in[0].dims, &kv = in[1].dims, &bt = in[2].dims;
        if (q.d[2] != kv.d[2] || q.d[2] > kMaxD || mP.dv > q.d[2])
            return "q and kv_cache widths differ, exceed 1024, or are below d_v";
        if (q.d[0] != bt.d[0] * mP.qPerReq || in[3].dims.d[0] != bt.d[0])
            return "q rows, block-table rows, seq_lens and q_per_req disagree";
        return "";
    }
    size_t workspace(PluginTensorDesc const* in, PluginTensorDesc const*) const noexcept override
    {
        return mlaSm90Workspace(in, mSm90);
    }
    cudaError_t run(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        std::string const kernel = kernelFor(in, workspace != nullptr);
        if (kernel == "mma")
            return mlaMmaRun(in, mMma, inputs, outputs, stream);
        if (kernel == "sm90")
        {
            std::string error;
            cudaError_t const e = mlaSm90Run(in, mSm90, inputs, outputs, workspace, stream, error);
            if (!error.empty())
                logError("MlaVerify (SM90 kernels): " + error);
            return e;
        }
        Dims const &q = in[0].dims, &kv = in[1].dims;
        int64_t const blocks = q.d[0] * q.d[1];
        if (blocks > 0)
            mlaVerifyKernel<<<static_cast<uint32_t>(blocks), kThreads, 0, stream>>>(inputs[0], in[0].type, inputs[1],
                in[1].type, static_cast<int32_t const*>(inputs[2]), static_cast<int32_t const*>(inputs[3]), outputs[0],
                static_cast<float*>(outputs[1]), static_cast<int32_t>(q.d[1]), static_cast<int32_t>(q.d[2]),
                static_cast<int32_t>(kv.d[1]), static_cast<int32_t>(in[2].dims.d[1]), mP);
        return cudaGetLastError();
    }
    OpPlugin* copy() const noexcept override { return new MlaVerify(*this); }

private:
    // hasWorkspace: the SM90 path keeps its split scratch and error word there; an engine built
    // where no SM90 GPU answered getWorkspaceSize has none (nullptr), and takes the next kernel
    std::string kernelFor(PluginTensorDesc const* in, bool hasWorkspace) const
    {
        bool const any = mKernels == "auto";
        if ((any || mKernels == "sm90") && hasWorkspace && mlaSm90Takes(in, mSm90))
            return "sm90";
        if ((any || mKernels == "mma") && mlaMmaTakes(in, mMma))
            return "mma";
        return "plain";
    }

    Params mP;
    MlaSm90Config mSm90;
    MlaMmaConfig mMma;
    std::string mKernels;   // K3TRT_MLA_KERNEL
};

OpPlugin* make(Attributes const& attrs, std::string& error)
{
    auto* plugin = new MlaVerify(attrs);
    error = plugin->invalid();
    if (error.empty())
        return plugin;
    delete plugin;
    return nullptr;
}
} // namespace

Creator* mlaVerifyCreator()
{
    static Creator creator("MlaVerify", kFields, make);
    return &creator;
}
} // namespace k3trt
