// MergeAttnStates: out_a, lse_a, out_b, lse_b -> out, lse (k3trt/plugins/merge.py).
// out_* [T, H, d_v] (one float dtype), lse_* [T, H] fp32; arithmetic in fp32.
#include "plugin.h"

namespace k3trt
{
namespace
{
std::vector<FieldSpec> const kFields = {};

__global__ void mergeKernel(void const* outA, float const* lseA, void const* outB, float const* lseB, void* out,
    float* lse, int64_t rows, int32_t dv, DataType dt)
{
    int64_t const idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (idx >= rows * dv)
        return;
    int64_t const row = idx / dv;
    float const a = lseA[row], b = lseB[row];
    float const m = fmaxf(a, b);
    float const mSafe = isinf(m) && m < 0 ? 0.f : m;
    float const wa = expf(a - mSafe), wb = expf(b - mSafe);
    float const total = wa + wb;
    // a side with zero weight is not read: garbage (NaN) there must not leak into the result
    float acc = 0.f;
    if (wa > 0.f)
        acc += load(outA, idx, dt) * wa;
    if (wb > 0.f)
        acc += load(outB, idx, dt) * wb;
    store(out, idx, total > 0.f ? acc * (1.f / total) : 0.f, dt);
    if (idx % dv == 0)
        lse[row] = total > 0.f ? mSafe + logf(total) : -INFINITY;
}

class MergeAttnStates : public OpPlugin
{
public:
    using OpPlugin::OpPlugin;
    int32_t nbInputs() const noexcept override { return 4; }
    int32_t nbOut() const noexcept override { return 2; }
    bool outputTypes(DataType* out, DataType const* in) const noexcept override
    {
        out[0] = in[0];
        out[1] = DataType::kFLOAT;
        return isFloat(in[0]);
    }
    bool shapes(DimsExprs const* in, DimsExprs* out, IExprBuilder&) const noexcept override
    {
        out[0] = in[0];
        out[1] = in[1];
        return in[0].nbDims == 3 && in[1].nbDims == 2;
    }
    bool supportsType(int32_t pos, PluginTensorDesc const* io) const noexcept override
    {
        switch (pos)
        {
        case 0: return isFloat(io[0].type);
        case 2:
        case 4: return io[pos].type == io[0].type;
        default: return io[pos].type == DataType::kFLOAT;   // lse_a, lse_b, lse
        }
    }
    std::string check(PluginTensorDesc const* in, PluginTensorDesc const*) const noexcept override
    {
        if (volume(in[0].dims) != volume(in[2].dims) || volume(in[1].dims) != volume(in[3].dims)
            || volume(in[1].dims) * in[0].dims.d[2] != volume(in[0].dims))
            return "out_a/out_b must be [T, H, d_v] and lse_a/lse_b [T, H]";
        return "";
    }
    cudaError_t run(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void*, cudaStream_t stream) noexcept override
    {
        int64_t const rows = volume(in[1].dims);
        int32_t const dv = static_cast<int32_t>(in[0].dims.d[2]);
        if (rows * dv > 0)
            mergeKernel<<<blocksFor(rows * dv, 256), 256, 0, stream>>>(inputs[0], static_cast<float const*>(inputs[1]),
                inputs[2], static_cast<float const*>(inputs[3]), outputs[0], static_cast<float*>(outputs[1]), rows, dv,
                in[0].type);
        return cudaGetLastError();
    }
    OpPlugin* copy() const noexcept override { return new MergeAttnStates(*this); }
};

OpPlugin* make(Attributes const& attrs, std::string&)
{
    return new MergeAttnStates("MergeAttnStates", kFields, attrs);
}
} // namespace

Creator* mergeAttnStatesCreator()
{
    static Creator creator("MergeAttnStates", kFields, make);
    return &creator;
}
} // namespace k3trt
