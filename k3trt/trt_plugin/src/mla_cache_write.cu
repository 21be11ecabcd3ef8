// MlaCacheWrite: kv_c [T, R], k_pe [T, P], cache [blocks, page, R+P], slot_mapping int64 [T] -> cache_out
// (k3trt/plugins/cache_write.py, the functional form export.py's mla_cache_update). Row t goes to flat
// row slot_mapping[t]; negative slots (padding) and slots past the cache are skipped (a kernel cannot
// raise; the torch op raises IndexError for the latter). An fp8 cache stores x / kv_scale, saturated.
// cache_out is aliased to cache (IPluginV3OneBuildV2::getAliasedInput, TensorRT's preview feature
// kALIASED_PLUGIN_IO_10_03): with aliasing on, the write is in place; without it the plugin first
// copies the cache into cache_out, which is the functional semantics at the cost of one copy.
#include "plugin.h"

namespace k3trt
{
namespace
{
std::vector<FieldSpec> const kFields = {
    {"kv_scale", PluginFieldType::kFLOAT32, ""},
};

constexpr float kFp8Max = 448.f;

__global__ void cacheWriteKernel(void const* kvc, void const* kpe, DataType inType, void* cache, DataType cacheType,
    int64_t const* slots, int64_t tokens, int32_t r, int32_t width, int64_t rows, float kvScale)
{
    int64_t const idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (idx >= tokens * width)
        return;
    int64_t const t = idx / width;
    int32_t const c = static_cast<int32_t>(idx % width);
    int64_t const slot = slots[t];
    if (slot < 0 || slot >= rows)
        return;
    float v = c < r ? load(kvc, t * r + c, inType) : load(kpe, t * (width - r) + (c - r), inType);
    if (cacheType == DataType::kFP8)
        v = fminf(fmaxf(v / kvScale, -kFp8Max), kFp8Max);
    store(cache, slot * width + c, v, cacheType);
}

size_t elementSize(DataType t)
{
    switch (t)
    {
    case DataType::kFLOAT: return 4;
    case DataType::kHALF:
    case DataType::kBF16: return 2;
    default: return 1;
    }
}

class MlaCacheWrite : public OpPlugin
{
public:
    MlaCacheWrite(Attributes const& a)
        : OpPlugin("MlaCacheWrite", kFields, a)
        , mKvScale(static_cast<float>(a.f("kv_scale")))
    {
    }
    int32_t nbInputs() const noexcept override { return 4; }
    int32_t nbOut() const noexcept override { return 1; }
    bool outputTypes(DataType* out, DataType const* in) const noexcept override
    {
        out[0] = in[2];
        return isFloat(in[0]) && (isFloat(in[2]) || in[2] == DataType::kFP8);
    }
    bool shapes(DimsExprs const* in, DimsExprs* out, IExprBuilder&) const noexcept override
    {
        out[0] = in[2];
        return in[0].nbDims == 2 && in[1].nbDims == 2 && in[2].nbDims == 3 && in[3].nbDims == 1;
    }
    bool supportsType(int32_t pos, PluginTensorDesc const* io) const noexcept override
    {
        switch (pos)
        {
        case 0: return isFloat(io[0].type);
        case 1: return io[1].type == io[0].type;
        case 2: return isFloat(io[2].type) || io[2].type == DataType::kFP8;
        case 3: return io[3].type == DataType::kINT64;
        default: return io[4].type == io[2].type;
        }
    }
    int32_t aliased(int32_t outputIndex) const noexcept override { return outputIndex == 0 ? 2 : -1; }
    std::string check(PluginTensorDesc const* in, PluginTensorDesc const*) const noexcept override
    {
        if (in[0].dims.d[1] + in[1].dims.d[1] != in[2].dims.d[2])
            return "kv_c width + k_pe width != cache row width";
        if (in[0].dims.d[0] != in[1].dims.d[0] || in[0].dims.d[0] != in[3].dims.d[0])
            return "kv_c, k_pe and slot_mapping disagree on the token count";
        return "";
    }
    cudaError_t run(PluginTensorDesc const* in, PluginTensorDesc const* out, void const* const* inputs,
        void* const* outputs, void*, cudaStream_t stream) noexcept override
    {
        int64_t const rows = in[2].dims.d[0] * in[2].dims.d[1];
        int32_t const width = static_cast<int32_t>(in[2].dims.d[2]);
        if (outputs[0] != inputs[2] && rows > 0)
        {
            cudaError_t const err = cudaMemcpyAsync(outputs[0], inputs[2], rows * width * elementSize(in[2].type),
                cudaMemcpyDeviceToDevice, stream);
            if (err != cudaSuccess)
                return err;
        }
        int64_t const tokens = in[0].dims.d[0];
        if (tokens * width > 0)
            cacheWriteKernel<<<blocksFor(tokens * width, 256), 256, 0, stream>>>(inputs[0], inputs[1], in[0].type,
                outputs[0], in[2].type, static_cast<int64_t const*>(inputs[3]), tokens,
                static_cast<int32_t>(in[0].dims.d[1]), width, rows, mKvScale);
        return cudaGetLastError();
    }
    OpPlugin* copy() const noexcept override { return new MlaCacheWrite(*this); }

private:
    float mKvScale;
};

OpPlugin* make(Attributes const& attrs, std::string&) { return new MlaCacheWrite(attrs); }
} // namespace

Creator* mlaCacheWriteCreator()
{
    static Creator creator("MlaCacheWrite", kFields, make);
    return &creator;
}
} // namespace k3trt
