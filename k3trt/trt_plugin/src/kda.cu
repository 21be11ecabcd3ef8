// KdaRecurrent: q, k, v, g, beta, state -> o, final_state, all_states
// KdaChunked:   q, k, v, g, beta, state -> o, final_state
// (k3trt/plugins/kda.py: per head S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T, o_t = S_t^T q scale,
// fp32; q, k, g [B?, T, H, dk], v [B?, T, H, dv], beta [B?, T, H], state fp32 [B?, H, dk, dv].)
// Both plugins run the token-by-token recurrence: each column of a head's state evolves on its own,
// so one thread owns one column and keeps it in the final_state output, which is the working state.
// KdaChunked equals KdaRecurrent up to rounding (the torch op's contract); a chunked (WY) kernel
// for long prefills is the fast path still to come.
#include "plugin.h"

namespace k3trt
{
namespace
{
std::vector<FieldSpec> const kRecurrentFields = {
    {"scale", PluginFieldType::kFLOAT32, ""},
    {"save_all", PluginFieldType::kINT32, ""},
};
std::vector<FieldSpec> const kChunkedFields = {
    {"scale", PluginFieldType::kFLOAT32, ""},
    {"chunk_size", PluginFieldType::kINT32, "64"},
};

constexpr int32_t kThreads = 128;

struct KdaIo
{
    void const *q, *k, *v, *g, *beta;
    DataType qType, kType, vType, gType, betaType;
    float const* state;
    void* o;
    float* finalState;
    float* allStates;   // nullptr unless save_all
};

// grid: B * H blocks; dynamic shared memory: 3 * dk floats (q, k, exp(g) of the current token)
__global__ void __launch_bounds__(kThreads) kdaRecurrentKernel(KdaIo io, int32_t T, int32_t H, int32_t dk, int32_t dv, float scale)
{
    extern __shared__ float smem[];
    float* qs = smem;
    float* ks = smem + dk;
    float* decay = smem + 2 * dk;
    int32_t const b = blockIdx.x / H, h = blockIdx.x % H;
    int64_t const stateBase = (static_cast<int64_t>(b) * H + h) * dk * dv;
    for (int32_t col = threadIdx.x; col < dv; col += kThreads)
        for (int32_t c = 0; c < dk; ++c)
            io.finalState[stateBase + static_cast<int64_t>(c) * dv + col] = io.state[stateBase + static_cast<int64_t>(c) * dv + col];
    for (int32_t t = 0; t < T; ++t)
    {
        int64_t const tok = (static_cast<int64_t>(b) * T + t) * H + h;
        __syncthreads();   // the previous token's q/k/decay are no longer read
        for (int32_t c = threadIdx.x; c < dk; c += kThreads)
        {
            qs[c] = load(io.q, tok * dk + c, io.qType);
            ks[c] = load(io.k, tok * dk + c, io.kType);
            decay[c] = expf(load(io.g, tok * dk + c, io.gType));
        }
        __syncthreads();
        float const beta = load(io.beta, tok, io.betaType);
        for (int32_t col = threadIdx.x; col < dv; col += kThreads)
        {
            float* S = io.finalState + stateBase + col;
            float pred = 0.f;
            for (int32_t c = 0; c < dk; ++c)
            {
                float const s = S[static_cast<int64_t>(c) * dv] * decay[c];
                S[static_cast<int64_t>(c) * dv] = s;
                pred += ks[c] * s;
            }
            float const u = beta * (load(io.v, tok * dv + col, io.vType) - pred);
            float out = 0.f;
            float* saved = io.allStates ? io.allStates + tok * dk * dv + col : nullptr;
            for (int32_t c = 0; c < dk; ++c)
            {
                float const s = S[static_cast<int64_t>(c) * dv] + ks[c] * u;
                S[static_cast<int64_t>(c) * dv] = s;
                out += qs[c] * s;
                if (saved)
                    saved[static_cast<int64_t>(c) * dv] = s;
            }
            store(io.o, tok * dv + col, out * scale, io.vType);
        }
    }
}

class Kda : public OpPlugin
{
public:
    Kda(char const* name, std::vector<FieldSpec> const& specs, Attributes const& a, bool recurrent)
        : OpPlugin(name, specs, a)
        , mRecurrent(recurrent)
        , mScale(static_cast<float>(a.f("scale")))
        , mSaveAll(recurrent && a.i("save_all") != 0)
    {
    }
    int32_t nbInputs() const noexcept override { return 6; }
    int32_t nbOut() const noexcept override { return mRecurrent ? 3 : 2; }
    bool outputTypes(DataType* out, DataType const* in) const noexcept override
    {
        out[0] = in[2];
        out[1] = DataType::kFLOAT;
        if (mRecurrent)
            out[2] = DataType::kFLOAT;
        return isFloat(in[2]);
    }
    bool shapes(DimsExprs const* in, DimsExprs* out, IExprBuilder& b) const noexcept override
    {
        int32_t const rank = in[0].nbDims;
        if ((rank != 3 && rank != 4) || in[2].nbDims != rank || in[5].nbDims != rank)
            return false;
        out[0] = in[2];
        out[1] = in[5];
        if (!mRecurrent)
            return true;
        if (mSaveAll)
        {
            // (*q.shape[:-2], *state.shape[-3:]) = [B?, T, H, dk, dv]
            out[2].nbDims = rank + 1;
            for (int32_t i = 0; i < rank - 2; ++i)
                out[2].d[i] = in[0].d[i];
            for (int32_t i = 0; i < 3; ++i)
                out[2].d[rank - 2 + i] = in[5].d[in[5].nbDims - 3 + i];
        }
        else
        {
            out[2].nbDims = 1;
            out[2].d[0] = b.constant(0);
        }
        return true;
    }
    bool supportsType(int32_t pos, PluginTensorDesc const* io) const noexcept override
    {
        if (pos < 5)
            return isFloat(io[pos].type);   // q, k, v, g, beta: any float dtype each
        if (pos == 6)
            return io[6].type == io[2].type;   // o: v's dtype
        return io[pos].type == DataType::kFLOAT;   // state, final_state, all_states
    }
    std::string check(PluginTensorDesc const* in, PluginTensorDesc const*) const noexcept override
    {
        Dims const& q = in[0].dims;
        int32_t const r = q.nbDims;
        if (in[1].dims.nbDims != r || in[3].dims.nbDims != r || in[4].dims.nbDims != r - 1)
            return "q, k, g must be [B?, T, H, dk] and beta [B?, T, H]";
        int64_t const batch = r == 4 ? q.d[0] : 1;
        Dims const& s = in[5].dims;
        if (s.d[s.nbDims - 3] != q.d[r - 2] || s.d[s.nbDims - 2] != q.d[r - 1] || s.d[s.nbDims - 1] != in[2].dims.d[r - 1]
            || volume(s) != batch * q.d[r - 2] * q.d[r - 1] * in[2].dims.d[r - 1])
            return "state must be [B?, H, dk, dv]";
        return "";
    }
    cudaError_t run(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void*, cudaStream_t stream) noexcept override
    {
        Dims const& q = in[0].dims;
        int32_t const r = q.nbDims;
        int32_t const batch = r == 4 ? static_cast<int32_t>(q.d[0]) : 1;
        int32_t const T = static_cast<int32_t>(q.d[r - 3]), H = static_cast<int32_t>(q.d[r - 2]);
        int32_t const dk = static_cast<int32_t>(q.d[r - 1]), dv = static_cast<int32_t>(in[2].dims.d[r - 1]);
        KdaIo io{inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], in[0].type, in[1].type, in[2].type, in[3].type,
            in[4].type, static_cast<float const*>(inputs[5]), outputs[0], static_cast<float*>(outputs[1]),
            mSaveAll ? static_cast<float*>(outputs[2]) : nullptr};
        size_t const smem = 3 * dk * sizeof(float);
        if (smem > 48 * 1024)
            return cudaErrorInvalidValue;
        if (batch * H > 0)
            kdaRecurrentKernel<<<batch * H, kThreads, smem, stream>>>(io, T, H, dk, dv, mScale);
        return cudaGetLastError();
    }
    OpPlugin* copy() const noexcept override { return new Kda(*this); }

private:
    bool mRecurrent;
    float mScale;
    bool mSaveAll;
};

OpPlugin* makeRecurrent(Attributes const& attrs, std::string&)
{
    return new Kda("KdaRecurrent", kRecurrentFields, attrs, true);
}

OpPlugin* makeChunked(Attributes const& attrs, std::string& error)
{
    if (attrs.i("chunk_size") < 1)
    {
        error = "chunk_size must be >= 1";
        return nullptr;
    }
    return new Kda("KdaChunked", kChunkedFields, attrs, false);
}
} // namespace

Creator* kdaRecurrentCreator()
{
    static Creator creator("KdaRecurrent", kRecurrentFields, makeRecurrent);
    return &creator;
}

Creator* kdaChunkedCreator()
{
    static Creator creator("KdaChunked", kChunkedFields, makeChunked);
    return &creator;
}
} // namespace k3trt
