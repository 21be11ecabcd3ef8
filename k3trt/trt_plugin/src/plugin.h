// The shared half of every k3trt TensorRT plugin: attribute fields, the IPluginV3 capability
// plumbing, the creator, and device-side dtype helpers. Each op (one .cu file) supplies only its
// shape/type rules and its kernels through the OpPlugin hooks below.
#pragma once

#include <NvInferRuntime.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace k3trt
{
using namespace nvinfer1;

constexpr char const* kNamespace = "k3trt";
constexpr char const* kVersion = "1";

// Logs through the logger TensorRT hands the library (setLoggerFinder), else to stderr.
void logMessage(ILogger::Severity severity, std::string const& msg);
inline void logError(std::string const& msg) { logMessage(ILogger::Severity::kERROR, msg); }
void trace(char const* plugin, char const* method);

// --------------------------------------------------------------------------- attribute fields
// An op's attribute: name, kind, and the torch op's default ("" = required). Kinds are what the ONNX
// attribute becomes: INT -> kINT32 (TensorRT's ONNX parser narrows int64), FLOAT -> kFLOAT32,
// STRING -> kCHAR. Readers also take kINT64 / kFLOAT64 / kINT8 / kINT16, whatever a caller sends.
struct FieldSpec
{
    char const* name;
    PluginFieldType type;
    char const* defaultValue;
};

class Attributes
{
public:
    // Fills every spec'd field from fc (or its default); false with `error` set on a missing or
    // malformed field. Fields not in specs (the parser's plugin_namespace / plugin_version) are ignored.
    bool parse(std::vector<FieldSpec> const& specs, PluginFieldCollection const* fc, std::string& error);
    int64_t i(char const* name) const;
    double f(char const* name) const;
    std::string const& s(char const* name) const;
    // The fields in their declared kinds, for getFieldsToSerialize (valid while this object lives).
    PluginFieldCollection const* serialize(std::vector<FieldSpec> const& specs);

private:
    std::map<std::string, std::string> mText;   // every value kept as text: one representation
    std::vector<std::vector<char>> mStore;
    std::vector<PluginField> mFields;
    PluginFieldCollection mCollection{};
};

// --------------------------------------------------------------------------- shapes and types
// Dims of one tensor as the runtime half sees them.
inline int64_t volume(Dims const& d)
{
    int64_t v = 1;
    for (int32_t i = 0; i < d.nbDims; ++i)
        v *= d.d[i];
    return v;
}

inline bool isFloat(DataType t) { return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16; }

// --------------------------------------------------------------------------- the plugin
// One object serves all three capabilities (TensorRT asks for each through getCapabilityInterface).
class OpPlugin : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuildV2, public IPluginV3OneRuntime
{
public:
    OpPlugin(char const* name, std::vector<FieldSpec> const& specs, Attributes attrs)
        : mName(name), mSpecs(specs), mAttrs(std::move(attrs)) {}
    ~OpPlugin() override = default;

    // --- per-op hooks
    virtual int32_t nbInputs() const noexcept = 0;
    virtual int32_t nbOut() const noexcept = 0;
    // Output dtypes from input dtypes (false: unsupported combination).
    virtual bool outputTypes(DataType* out, DataType const* in) const noexcept = 0;
    // Output shapes from input shapes.
    virtual bool shapes(DimsExprs const* in, DimsExprs* out, IExprBuilder& b) const noexcept = 0;
    // Whether io[pos]'s dtype is accepted given io[0..pos-1] (format kLINEAR is checked here).
    virtual bool supportsType(int32_t pos, PluginTensorDesc const* io) const noexcept = 0;
    // Checks of the concrete shapes (runtime and configure); "" when fine.
    virtual std::string check(PluginTensorDesc const* in, PluginTensorDesc const* out) const noexcept { return ""; }
    virtual size_t workspace(PluginTensorDesc const* in, PluginTensorDesc const* out) const noexcept { return 0; }
    virtual int32_t aliased(int32_t outputIndex) const noexcept { return -1; }
    virtual cudaError_t run(PluginTensorDesc const* in, PluginTensorDesc const* out, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept = 0;
    virtual OpPlugin* copy() const noexcept = 0;

    // --- IPluginV3
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override;
    IPluginV3* clone() noexcept override
    {
        trace(mName, "clone");
        return copy();
    }

    // --- IPluginV3OneCore
    AsciiChar const* getPluginName() const noexcept override { return mName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

    // --- IPluginV3OneBuild(V2)
    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(
        DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(
        int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override
    {
        trace(mName, "getNbOutputs");
        return nbOut();
    }
    size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t getAliasedInput(int32_t outputIndex) noexcept override
    {
        trace(mName, "getAliasedInput");
        return aliased(outputIndex);
    }

    // --- IPluginV3OneRuntime
    int32_t onShapeChange(
        PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
        void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    IPluginV3* attachToContext(IPluginResourceContext* context) noexcept override
    {
        trace(mName, "attachToContext");
        return copy();
    }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        trace(mName, "getFieldsToSerialize");
        return mAttrs.serialize(mSpecs);
    }

protected:
    Attributes const& attrs() const { return mAttrs; }

private:
    char const* mName;
    std::vector<FieldSpec> const& mSpecs;
    Attributes mAttrs;
};

// --------------------------------------------------------------------------- the creator
using Factory = OpPlugin* (*) (Attributes const&, std::string& error);

class Creator : public IPluginCreatorV3One
{
public:
    Creator(char const* name, std::vector<FieldSpec> const& specs, Factory factory);
    IPluginV3* createPlugin(AsciiChar const* name, PluginFieldCollection const* fc, TensorRTPhase phase) noexcept override;
    PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldNames; }
    AsciiChar const* getPluginName() const noexcept override { return mName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kNamespace; }

private:
    char const* mName;
    std::vector<FieldSpec> const& mSpecs;
    Factory mFactory;
    std::vector<PluginField> mFields;
    PluginFieldCollection mFieldNames{};
};

// Each op's .cu defines its creator; plugins.cpp lists them for getCreators.
Creator* mlaVerifyCreator();
Creator* mlaCacheWriteCreator();
Creator* kdaRecurrentCreator();
Creator* kdaChunkedCreator();
Creator* shortConvCreator();
Creator* moeExpertsCreator();
Creator* mergeAttnStatesCreator();

// --------------------------------------------------------------------------- device helpers
// Element access by runtime dtype: one kernel serves every dtype combination, which keeps the
// library's compile time small; the fast kernels will specialise.
__device__ __forceinline__ float load(void const* p, int64_t i, DataType t)
{
    switch (t)
    {
    case DataType::kHALF: return __half2float(static_cast<__half const*>(p)[i]);
    case DataType::kBF16: return __bfloat162float(static_cast<__nv_bfloat16 const*>(p)[i]);
    case DataType::kFP8:
        return static_cast<float>(static_cast<__nv_fp8_e4m3 const*>(p)[i]);
    default: return static_cast<float const*>(p)[i];
    }
}

__device__ __forceinline__ void store(void* p, int64_t i, float v, DataType t)
{
    switch (t)
    {
    case DataType::kHALF: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case DataType::kBF16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DataType::kFP8: static_cast<__nv_fp8_e4m3*>(p)[i] = __nv_fp8_e4m3(v); break;
    default: static_cast<float*>(p)[i] = v;
    }
}

// v rounded to dtype t and back (the reference's intermediate casts).
__device__ __forceinline__ float roundTo(float v, DataType t)
{
    switch (t)
    {
    case DataType::kHALF: return __half2float(__float2half_rn(v));
    case DataType::kBF16: return __bfloat162float(__float2bfloat16_rn(v));
    default: return v;
    }
}

__device__ __forceinline__ int64_t loadIndex(void const* p, int64_t i, DataType t)
{
    return t == DataType::kINT64 ? static_cast<int64_t const*>(p)[i] : static_cast<int32_t const*>(p)[i];
}

inline int32_t blocksFor(int64_t n, int32_t threads) { return static_cast<int32_t>((n + threads - 1) / threads); }

} // namespace k3trt
