// ShortConv: x [B?, T, C], weight [C, 1, K] | [C, K], conv_state [B?, C, K-1] -> y, new_state, all_states
// (k3trt/plugins/kda.py short_conv: y = SiLU(causal depthwise conv of the window followed by x) in x's
// dtype, fp32 arithmetic; the window is first cast to x's dtype, as the reference concatenates it with
// x; new_state / all_states (the window after every position, empty unless save_all) in the state's
// dtype). One thread per (sequence, channel), the window in registers.
#include "plugin.h"

namespace k3trt
{
namespace
{
std::vector<FieldSpec> const kFields = {
    {"save_all", PluginFieldType::kINT32, "0"},
};

constexpr int32_t kMaxWindow = 15;   // K - 1

__global__ void shortConvKernel(void const* x, DataType xType, void const* weight, DataType wType, void const* state,
    DataType sType, void* y, void* newState, void* allStates, int32_t batch, int32_t T, int32_t C, int32_t K)
{
    int32_t const idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= batch * C)
        return;
    int32_t const b = idx / C, c = idx % C, win = K - 1;
    float window[kMaxWindow];
    float w[kMaxWindow + 1];
    for (int32_t j = 0; j < K; ++j)
        w[j] = load(weight, static_cast<int64_t>(c) * K + j, wType);
    int64_t const stateBase = (static_cast<int64_t>(b) * C + c) * win;
    for (int32_t j = 0; j < win; ++j)
        window[j] = roundTo(load(state, stateBase + j, sType), xType);
    for (int32_t t = 0; t < T; ++t)
    {
        int64_t const xi = (static_cast<int64_t>(b) * T + t) * C + c;
        float const xt = load(x, xi, xType);
        float acc = win > 0 ? window[0] * w[0] : xt * w[0];
        for (int32_t j = 1; j < K; ++j)
            acc += (j < win ? window[j] : xt) * w[j];
        store(y, xi, acc / (1.f + expf(-acc)), xType);
        for (int32_t j = 0; j + 1 < win; ++j)
            window[j] = window[j + 1];
        if (win > 0)
            window[win - 1] = xt;
        if (allStates)
            for (int32_t j = 0; j < win; ++j)
                store(allStates, xi * win + j, window[j], sType);
    }
    for (int32_t j = 0; j < win; ++j)
        store(newState, stateBase + j, window[j], sType);
}

class ShortConv : public OpPlugin
{
public:
    ShortConv(Attributes const& a)
        : OpPlugin("ShortConv", kFields, a)
        , mSaveAll(a.i("save_all") != 0)
    {
    }
    int32_t nbInputs() const noexcept override { return 3; }
    int32_t nbOut() const noexcept override { return 3; }
    bool outputTypes(DataType* out, DataType const* in) const noexcept override
    {
        out[0] = in[0];
        out[1] = in[2];
        out[2] = in[2];
        return isFloat(in[0]) && isFloat(in[2]);
    }
    bool shapes(DimsExprs const* in, DimsExprs* out, IExprBuilder& b) const noexcept override
    {
        int32_t const rank = in[0].nbDims;
        if ((rank != 2 && rank != 3) || in[2].nbDims != rank)
            return false;
        out[0] = in[0];
        out[1] = in[2];
        if (mSaveAll)
        {
            // [B?, T, C, K-1]: x's leading dims and the state's last two
            out[2].nbDims = rank + 1;
            for (int32_t i = 0; i < rank - 1; ++i)
                out[2].d[i] = in[0].d[i];
            out[2].d[rank - 1] = in[2].d[rank - 2];
            out[2].d[rank] = in[2].d[rank - 1];
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
        if (pos < 3)
            return isFloat(io[pos].type);
        return io[pos].type == (pos == 3 ? io[0].type : io[2].type);
    }
    std::string check(PluginTensorDesc const* in, PluginTensorDesc const*) const noexcept override
    {
        Dims const &x = in[0].dims, &s = in[2].dims;
        int64_t const C = x.d[x.nbDims - 1], K = volume(in[1].dims) / (C > 0 ? C : 1);
        if (in[1].dims.d[0] != C || K < 1 || K - 1 > kMaxWindow || s.d[s.nbDims - 2] != C || s.d[s.nbDims - 1] != K - 1)
            return "x, weight and conv_state do not fit ([B,] T, C), [C, 1, K], ([B,] C, K-1) with K <= 16";
        return "";
    }
    cudaError_t run(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void*, cudaStream_t stream) noexcept override
    {
        Dims const& x = in[0].dims;
        int32_t const batch = x.nbDims == 3 ? static_cast<int32_t>(x.d[0]) : 1;
        int32_t const T = static_cast<int32_t>(x.d[x.nbDims - 2]), C = static_cast<int32_t>(x.d[x.nbDims - 1]);
        int32_t const K = static_cast<int32_t>(volume(in[1].dims) / C);
        if (batch * C > 0)
            shortConvKernel<<<blocksFor(batch * C, 128), 128, 0, stream>>>(inputs[0], in[0].type, inputs[1],
                in[1].type, inputs[2], in[2].type, outputs[0], outputs[1], mSaveAll ? outputs[2] : nullptr, batch, T,
                C, K);
        return cudaGetLastError();
    }
    OpPlugin* copy() const noexcept override { return new ShortConv(*this); }

private:
    bool mSaveAll;
};

OpPlugin* make(Attributes const& attrs, std::string&) { return new ShortConv(attrs); }
} // namespace

Creator* shortConvCreator()
{
    static Creator creator("ShortConv", kFields, make);
    return &creator;
}
} // namespace k3trt
