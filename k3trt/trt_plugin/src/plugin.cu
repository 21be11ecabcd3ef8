// The shared plugin plumbing (plugin.h) and the library's exported entry points.
#include "plugin.h"

#include <cstdio>
#include <cstdlib>

namespace k3trt
{
namespace
{
ILoggerFinder* gLoggerFinder = nullptr;   // set once by TensorRT when it loads the library

bool readField(PluginField const& f, std::string& text)
{
    if (f.data == nullptr && f.length > 0)
        return false;
    switch (f.type)
    {
    case PluginFieldType::kCHAR:
    {
        auto const* c = static_cast<char const*>(f.data);
        int32_t n = 0;
        while (n < f.length && c[n] != '\0')
            ++n;
        text.assign(c, n);
        return true;
    }
    case PluginFieldType::kINT8: text = std::to_string(*static_cast<int8_t const*>(f.data)); return f.length >= 1;
    case PluginFieldType::kINT16: text = std::to_string(*static_cast<int16_t const*>(f.data)); return f.length >= 1;
    case PluginFieldType::kINT32: text = std::to_string(*static_cast<int32_t const*>(f.data)); return f.length >= 1;
    case PluginFieldType::kINT64: text = std::to_string(*static_cast<int64_t const*>(f.data)); return f.length >= 1;
    case PluginFieldType::kFLOAT32:
    {
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.9g", *static_cast<float const*>(f.data));
        text = buf;
        return f.length >= 1;
    }
    case PluginFieldType::kFLOAT64:
    {
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.17g", *static_cast<double const*>(f.data));
        text = buf;
        return f.length >= 1;
    }
    default: return false;
    }
}
} // namespace

void trace(char const* plugin, char const* method)
{
    // K3TRT_PLUGIN_TRACE=1: every TensorRT-facing call on stderr, to see how far a host got
    static bool const enabled = std::getenv("K3TRT_PLUGIN_TRACE") != nullptr;
    if (enabled)
        std::fprintf(stderr, "k3trt plugin trace: %s::%s\n", plugin, method);
}

void logMessage(ILogger::Severity severity, std::string const& msg)
{
    std::string const line = "k3trt plugin: " + msg;
    ILogger* logger = gLoggerFinder ? gLoggerFinder->findLogger() : nullptr;
    if (logger)
        logger->log(severity, line.c_str());
    else if (severity <= ILogger::Severity::kWARNING)
        std::fprintf(stderr, "%s\n", line.c_str());
}

// --------------------------------------------------------------------------- Attributes
bool Attributes::parse(std::vector<FieldSpec> const& specs, PluginFieldCollection const* fc, std::string& error)
{
    std::map<std::string, PluginField const*> given;
    for (int32_t i = 0; fc && i < fc->nbFields; ++i)
        if (fc->fields[i].name)
            given[fc->fields[i].name] = &fc->fields[i];
    for (auto const& spec : specs)
    {
        auto it = given.find(spec.name);
        std::string text;
        if (it == given.end())
        {
            if (spec.defaultValue[0] == '\0')
            {
                error = std::string("missing field ") + spec.name;
                return false;
            }
            text = spec.defaultValue;
        }
        else if (!readField(*it->second, text))
        {
            error = std::string("field ") + spec.name + " has an unsupported type or no data";
            return false;
        }
        mText[spec.name] = text;
    }
    return true;
}

int64_t Attributes::i(char const* name) const { return std::strtoll(s(name).c_str(), nullptr, 10); }
double Attributes::f(char const* name) const { return std::strtod(s(name).c_str(), nullptr); }

std::string const& Attributes::s(char const* name) const
{
    static std::string const empty;
    auto it = mText.find(name);
    return it == mText.end() ? empty : it->second;
}

PluginFieldCollection const* Attributes::serialize(std::vector<FieldSpec> const& specs)
{
    mStore.clear();
    mFields.clear();
    mStore.reserve(specs.size());
    for (auto const& spec : specs)
    {
        std::vector<char> bytes;
        int32_t length = 1;
        if (spec.type == PluginFieldType::kINT32)
        {
            int32_t v = static_cast<int32_t>(i(spec.name));
            bytes.assign(reinterpret_cast<char*>(&v), reinterpret_cast<char*>(&v) + sizeof v);
        }
        else if (spec.type == PluginFieldType::kFLOAT32)
        {
            float v = static_cast<float>(f(spec.name));
            bytes.assign(reinterpret_cast<char*>(&v), reinterpret_cast<char*>(&v) + sizeof v);
        }
        else
        {
            std::string const& t = s(spec.name);
            bytes.assign(t.begin(), t.end());
            bytes.push_back('\0');
            length = static_cast<int32_t>(t.size());
        }
        mStore.push_back(std::move(bytes));
        mFields.emplace_back(spec.name, mStore.back().data(), spec.type, length);
    }
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
    return &mCollection;
}

// --------------------------------------------------------------------------- OpPlugin
IPluginCapability* OpPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    trace(mName, "getCapabilityInterface");
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

int32_t OpPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbIn, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    trace(mName, "configurePlugin");
    if (nbIn != nbInputs() || nbOutputs != nbOut())
    {
        logError(std::string(mName) + ": expected " + std::to_string(nbInputs()) + " inputs and "
            + std::to_string(nbOut()) + " outputs, got " + std::to_string(nbIn) + " and " + std::to_string(nbOutputs));
        return 1;
    }
    return 0;
}

int32_t OpPlugin::getOutputDataTypes(
    DataType* outTypes, int32_t nbOutputs, DataType const* inTypes, int32_t nbIn) const noexcept
{
    trace(mName, "getOutputDataTypes");
    if (nbIn != nbInputs() || nbOutputs != nbOut() || !outputTypes(outTypes, inTypes))
    {
        logError(std::string(mName) + ": unsupported input count or dtypes");
        return 1;
    }
    return 0;
}

int32_t OpPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbIn, DimsExprs const*, int32_t,
    DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& b) noexcept
{
    trace(mName, "getOutputShapes");
    if (nbIn != nbInputs() || nbOutputs != nbOut() || !shapes(inputs, outputs, b))
    {
        logError(std::string(mName) + ": input ranks do not fit the op");
        return 1;
    }
    return 0;
}

bool OpPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbIn, int32_t nbOutputs) noexcept
{
    trace(mName, "supportsFormatCombination");
    if (nbIn != nbInputs() || nbOutputs != nbOut() || inOut[pos].desc.format != TensorFormat::kLINEAR)
        return false;
    std::vector<PluginTensorDesc> io(pos + 1);
    for (int32_t i = 0; i <= pos; ++i)
        io[i] = inOut[i].desc;
    return supportsType(pos, io.data());
}

size_t OpPlugin::getWorkspaceSize(
    DynamicPluginTensorDesc const* inputs, int32_t nbIn, DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept
{
    trace(mName, "getWorkspaceSize");
    // sized for the profile's largest shapes: enough for every smaller one
    std::vector<PluginTensorDesc> in(nbIn), out(nbOutputs);
    for (int32_t i = 0; i < nbIn; ++i)
        in[i] = inputs[i].desc, in[i].dims = inputs[i].max;
    for (int32_t i = 0; i < nbOutputs; ++i)
        out[i] = outputs[i].desc, out[i].dims = outputs[i].max;
    return workspace(in.data(), out.data());
}

int32_t OpPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbIn, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    trace(mName, "onShapeChange");
    if (nbIn != nbInputs() || nbOutputs != nbOut())
        return 1;
    std::string const problem = check(in, out);
    if (!problem.empty())
    {
        logError(std::string(mName) + ": " + problem);
        return 1;
    }
    return 0;
}

int32_t OpPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
    void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept
{
    trace(mName, "enqueue");
    cudaError_t const err = run(inputDesc, outputDesc, inputs, outputs, workspace, stream);
    if (err != cudaSuccess)
    {
        logError(std::string(mName) + ": enqueue failed: " + cudaGetErrorString(err));
        return 1;
    }
    return 0;
}

// --------------------------------------------------------------------------- Creator
Creator::Creator(char const* name, std::vector<FieldSpec> const& specs, Factory factory)
    : mName(name), mSpecs(specs), mFactory(factory)
{
    for (auto const& spec : mSpecs)
        mFields.emplace_back(spec.name, nullptr, spec.type, 1);
    mFieldNames.nbFields = static_cast<int32_t>(mFields.size());
    mFieldNames.fields = mFields.data();
}

IPluginV3* Creator::createPlugin(AsciiChar const* name, PluginFieldCollection const* fc, TensorRTPhase) noexcept
{
    trace(mName, "createPlugin");
    try
    {
        Attributes attrs;
        std::string error;
        OpPlugin* plugin = attrs.parse(mSpecs, fc, error) ? mFactory(attrs, error) : nullptr;
        if (!plugin)
            logError(std::string(mName) + " (" + (name ? name : "") + "): " + error);
        return plugin;
    }
    catch (std::exception const& e)
    {
        logError(std::string(mName) + ": " + e.what());
        return nullptr;
    }
}
} // namespace k3trt

// --------------------------------------------------------------------------- exported entry points
// TensorRT's IPluginRegistry::loadLibrary looks these up by name (the plugin chapter of its
// developer guide): getCreators for IPluginCreatorV3One creators, setLoggerFinder optionally.
#define K3TRT_EXPORT extern "C" __attribute__((visibility("default")))

K3TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    k3trt::gLoggerFinder = finder;
}

K3TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static nvinfer1::IPluginCreatorInterface* const creators[] = {
        k3trt::mlaVerifyCreator(),
        k3trt::mlaCacheWriteCreator(),
        k3trt::kdaRecurrentCreator(),
        k3trt::kdaChunkedCreator(),
        k3trt::shortConvCreator(),
        k3trt::moeExpertsCreator(),
        k3trt::mergeAttnStatesCreator(),
    };
    nbCreators = static_cast<int32_t>(sizeof creators / sizeof creators[0]);
    return creators;
}
