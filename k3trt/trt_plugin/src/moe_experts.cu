// MoeExperts: x [T, W], ids int64 [T, k], weights fp32 [T, k], w_gate / w_up [E, I, W], w_down [E, W, I] -> y [T, W]
// (export.py's moe_experts, whose reference is moe.Experts._loop: for each token, the sum over its
// chosen experts of weight * down(act(gate(x), up(x))); the GEMM outputs and the activation are
// rounded to x's dtype as the reference's are, the weighted sum is fp32). Routed: only the chosen
// experts' rows are read. Two kernels, one warp per output element: h = act(...) into the workspace
// [T, k, I] (fp32), then y. Ids outside [0, E) contribute nothing (the torch op would fail on them).
#include "plugin.h"

namespace k3trt
{
namespace
{
std::vector<FieldSpec> const kFields = {
    {"activation", PluginFieldType::kCHAR, ""},
    {"beta", PluginFieldType::kFLOAT32, ""},
    {"linear_beta", PluginFieldType::kFLOAT32, ""},
};

enum class Act : int32_t
{
    kSILU = 0,
    kSITU = 1
};

// hidden_act -> kernel branch (plugins/norm_act.py ACTIVATIONS)
struct ActName
{
    char const* name;
    Act act;
};
constexpr ActName kActs[] = {{"silu", Act::kSILU}, {"situ", Act::kSITU}};

constexpr int32_t kWarps = 4;

__device__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

__device__ float warpSum(float v)
{
    for (int32_t o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__global__ void moeHiddenKernel(void const* x, DataType dt, int64_t const* ids, void const* wGate, void const* wUp,
    float* hidden, int64_t T, int32_t topk, int32_t E, int32_t I, int32_t W, Act act, float beta, float linearBeta)
{
    int64_t const warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
    int32_t const lane = threadIdx.x % 32;
    if (warp >= T * topk * I)
        return;
    int64_t const t = warp / (static_cast<int64_t>(topk) * I);
    int32_t const slot = static_cast<int32_t>(warp / I % topk), i = static_cast<int32_t>(warp % I);
    int64_t const e = ids[t * topk + slot];
    if (e < 0 || e >= E)
    {
        if (lane == 0)
            hidden[warp] = 0.f;
        return;
    }
    int64_t const wRow = (e * I + i) * W;
    float g = 0.f, u = 0.f;
    for (int32_t c = lane; c < W; c += 32)
    {
        float const xv = load(x, t * W + c, dt);
        g += xv * load(wGate, wRow + c, dt);
        u += xv * load(wUp, wRow + c, dt);
    }
    g = roundTo(warpSum(g), dt);
    u = roundTo(warpSum(u), dt);
    if (lane != 0)
        return;
    float h;
    if (act == Act::kSITU)
    {
        float const gs = beta * tanhf(g / beta) * sigmoid(g);
        float const us = linearBeta != 0.f ? linearBeta * tanhf(u / linearBeta) : u;
        h = gs * us;
    }
    else
        h = g * sigmoid(g) * u;
    hidden[warp] = roundTo(h, dt);
}

__global__ void moeDownKernel(DataType dt, int64_t const* ids, float const* weights, void const* wDown,
    float const* hidden, void* y, int64_t T, int32_t topk, int32_t E, int32_t I, int32_t W)
{
    int64_t const warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
    int32_t const lane = threadIdx.x % 32;
    if (warp >= T * W)
        return;
    int64_t const t = warp / W;
    int32_t const w = static_cast<int32_t>(warp % W);
    float total = 0.f;
    for (int32_t slot = 0; slot < topk; ++slot)
    {
        int64_t const e = ids[t * topk + slot];
        if (e < 0 || e >= E)
            continue;
        float const* h = hidden + (t * topk + slot) * I;
        int64_t const wRow = (e * W + w) * I;
        float d = 0.f;
        for (int32_t i = lane; i < I; i += 32)
            d += h[i] * load(wDown, wRow + i, dt);
        total += roundTo(warpSum(d), dt) * weights[t * topk + slot];
    }
    if (lane == 0)
        store(y, warp, total, dt);
}

class MoeExperts : public OpPlugin
{
public:
    MoeExperts(Attributes const& a, Act act)
        : OpPlugin("MoeExperts", kFields, a)
        , mAct(act)
        , mBeta(static_cast<float>(a.f("beta")))
        , mLinearBeta(static_cast<float>(a.f("linear_beta")))
    {
    }
    int32_t nbInputs() const noexcept override { return 6; }
    int32_t nbOut() const noexcept override { return 1; }
    bool outputTypes(DataType* out, DataType const* in) const noexcept override
    {
        out[0] = in[0];
        return isFloat(in[0]);
    }
    bool shapes(DimsExprs const* in, DimsExprs* out, IExprBuilder&) const noexcept override
    {
        out[0] = in[0];
        return in[0].nbDims == 2 && in[1].nbDims == 2 && in[2].nbDims == 2 && in[3].nbDims == 3 && in[4].nbDims == 3
            && in[5].nbDims == 3;
    }
    bool supportsType(int32_t pos, PluginTensorDesc const* io) const noexcept override
    {
        switch (pos)
        {
        case 0: return isFloat(io[0].type);
        case 1: return io[1].type == DataType::kINT64;
        case 2: return io[2].type == DataType::kFLOAT;
        default: return io[pos].type == io[0].type;   // w_gate, w_up, w_down, y
        }
    }
    std::string check(PluginTensorDesc const* in, PluginTensorDesc const*) const noexcept override
    {
        Dims const &x = in[0].dims, &g = in[3].dims, &d = in[5].dims;
        if (in[1].dims.d[0] != x.d[0] || in[2].dims.d[0] != x.d[0] || in[2].dims.d[1] != in[1].dims.d[1])
            return "x, ids and weights disagree on tokens or top-k";
        if (g.d[2] != x.d[1] || volume(in[4].dims) != volume(g) || d.d[0] != g.d[0] || d.d[1] != x.d[1] || d.d[2] != g.d[1])
            return "w_gate / w_up must be [E, I, W] and w_down [E, W, I]";
        return "";
    }
    size_t workspace(PluginTensorDesc const* in, PluginTensorDesc const*) const noexcept override
    {
        return static_cast<size_t>(volume(in[1].dims)) * in[3].dims.d[1] * sizeof(float);
    }
    cudaError_t run(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        int64_t const T = in[0].dims.d[0];
        int32_t const W = static_cast<int32_t>(in[0].dims.d[1]), topk = static_cast<int32_t>(in[1].dims.d[1]);
        int32_t const E = static_cast<int32_t>(in[3].dims.d[0]), I = static_cast<int32_t>(in[3].dims.d[1]);
        auto const* ids = static_cast<int64_t const*>(inputs[1]);
        auto* hidden = static_cast<float*>(workspace);
        DataType const dt = in[0].type;
        int64_t const hiddenWarps = T * topk * I, outWarps = T * W;
        if (hiddenWarps > 0)
            moeHiddenKernel<<<blocksFor(hiddenWarps, kWarps), kWarps * 32, 0, stream>>>(inputs[0], dt, ids, inputs[3],
                inputs[4], hidden, T, topk, E, I, W, mAct, mBeta, mLinearBeta);
        if (outWarps > 0)
            moeDownKernel<<<blocksFor(outWarps, kWarps), kWarps * 32, 0, stream>>>(dt, ids,
                static_cast<float const*>(inputs[2]), inputs[5], hidden, outputs[0], T, topk, E, I, W);
        return cudaGetLastError();
    }
    OpPlugin* copy() const noexcept override { return new MoeExperts(*this); }

private:
    Act mAct;
    float mBeta, mLinearBeta;
};

OpPlugin* make(Attributes const& attrs, std::string& error)
{
    for (auto const& a : kActs)
        if (attrs.s("activation") == a.name)
        {
            if (a.act == Act::kSITU && attrs.f("beta") == 0.0)
            {
                error = "situ needs a nonzero beta";
                return nullptr;
            }
            return new MoeExperts(attrs, a.act);
        }
    error = "unknown activation '" + attrs.s("activation") + "' (silu, situ)";
    return nullptr;
}
} // namespace

Creator* moeExpertsCreator()
{
    static Creator creator("MoeExperts", kFields, make);
    return &creator;
}
} // namespace k3trt
