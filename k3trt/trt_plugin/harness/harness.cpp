// Drives a plugin library's runtime half the way TensorRT does, without TensorRT: dlopen the library,
// getCreators, createPlugin (build phase) with the fields an ONNX node carries, the build-phase
// queries (output types and shapes, supportsFormatCombination, configurePlugin, workspace,
// aliasing), then the engine-load path (getFieldsToSerialize -> createPlugin in the runtime phase ->
// attachToContext -> onShapeChange) and enqueue on caller-owned device buffers. Shapes are concrete,
// so the expression builder folds every dimension to a constant. A C ABI for ctypes (harness.py).
#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{
using GetCreators = IPluginCreatorInterface* const* (*) (int32_t&);

void fail(char* err, int32_t len, std::string const& msg)
{
    if (err && len > 0)
        std::snprintf(err, len, "%s", msg.c_str());
}

// ------------------------------------------------------------------------ constant shape expressions
class ConstImpl : public apiv::VDimensionExpr
{
public:
    explicit ConstImpl(int64_t v) : mValue(v) {}
    bool isConstant() const override { return true; }
    int64_t getConstantValue() const override { return mValue; }
    bool isSizeTensor() const override { return false; }

private:
    int64_t mValue;
};

class ConstExpr : public IDimensionExpr
{
public:
    explicit ConstExpr(int64_t v) : mConst(v) { mImpl = &mConst; }
    ~ConstExpr() noexcept override = default;

private:
    ConstImpl mConst;
};

class BuilderImpl : public apiv::VExprBuilder
{
public:
    IDimensionExpr const* constant(int64_t value) override
    {
        mExprs.emplace_back(std::make_unique<ConstExpr>(value));
        return mExprs.back().get();
    }
    IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& a, IDimensionExpr const& b) override
    {
        int64_t const x = a.getConstantValue(), y = b.getConstantValue();
        switch (op)
        {
        case DimensionOperation::kSUM: return constant(x + y);
        case DimensionOperation::kPROD: return constant(x * y);
        case DimensionOperation::kMAX: return constant(x > y ? x : y);
        case DimensionOperation::kMIN: return constant(x < y ? x : y);
        case DimensionOperation::kSUB: return constant(x - y);
        case DimensionOperation::kEQUAL: return constant(x == y);
        case DimensionOperation::kLESS: return constant(x < y);
        case DimensionOperation::kFLOOR_DIV: return constant(y ? (x / y - ((x % y != 0) && ((x < 0) != (y < 0)))) : 0);
        case DimensionOperation::kCEIL_DIV: return constant(y ? (x + y - 1) / y : 0);
        }
        return constant(0);
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
    {
        return nullptr;   // no k3trt op has data-dependent output shapes
    }

private:
    std::deque<std::unique_ptr<ConstExpr>> mExprs;
};

class ExprBuilder : public IExprBuilder
{
public:
    ExprBuilder() { mImpl = &mBuilder; }
    ~ExprBuilder() noexcept override = default;

private:
    BuilderImpl mBuilder;
};

class ResourceContext : public IPluginResourceContext
{
public:
    IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
    IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
};

// ------------------------------------------------------------------------ library and session
struct Library
{
    void* handle{};
    std::vector<IPluginCreatorV3One*> creators;
};

struct Session
{
    IPluginCreatorV3One* creator{};
    std::string name;
    IPluginV3* build{};
    IPluginV3* runtime{};   // the attached clone that enqueues
    ResourceContext context;
    std::vector<PluginTensorDesc> in, out;

    ~Session()
    {
        delete runtime;
        delete build;
    }
};

bool sameKind(InterfaceInfo const& info, char const* kind) { return info.kind && std::strcmp(info.kind, kind) == 0; }
} // namespace

extern "C"
{
void* k3h_open(char const* path, char* err, int32_t errLen)
{
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle)
        return fail(err, errLen, std::string("dlopen: ") + dlerror()), nullptr;
    auto getCreators = reinterpret_cast<GetCreators>(dlsym(handle, "getCreators"));
    if (!getCreators)
        return fail(err, errLen, "the library exports no getCreators"), nullptr;
    auto* lib = new Library{handle, {}};
    int32_t n = 0;
    IPluginCreatorInterface* const* list = getCreators(n);
    for (int32_t i = 0; i < n; ++i)
    {
        if (!sameKind(list[i]->getInterfaceInfo(), "PLUGIN CREATOR_V3ONE"))
            return fail(err, errLen, std::string("creator ") + std::to_string(i) + " is not an IPluginCreatorV3One"), nullptr;
        lib->creators.push_back(static_cast<IPluginCreatorV3One*>(list[i]));
    }
    return lib;
}

// One line per creator: name, namespace, version, then field:type pairs (PluginFieldType values).
int32_t k3h_describe(void* libPtr, char* buf, int32_t len)
{
    std::string text;
    for (auto* c : static_cast<Library*>(libPtr)->creators)
    {
        text += std::string(c->getPluginName()) + "\t" + c->getPluginNamespace() + "\t" + c->getPluginVersion();
        PluginFieldCollection const* fields = c->getFieldNames();
        for (int32_t i = 0; fields && i < fields->nbFields; ++i)
            text += std::string("\t") + fields->fields[i].name + ":" + std::to_string(static_cast<int32_t>(fields->fields[i].type));
        text += "\n";
    }
    if (static_cast<int32_t>(text.size()) >= len)
        return -static_cast<int32_t>(text.size()) - 1;
    std::memcpy(buf, text.c_str(), text.size() + 1);
    return static_cast<int32_t>(text.size());
}

void* k3h_create(void* libPtr, char const* name, int32_t nbFields, char const* const* names, int32_t const* types,
    void const* const* data, int32_t const* lengths, char* err, int32_t errLen)
{
    auto* lib = static_cast<Library*>(libPtr);
    for (auto* c : lib->creators)
    {
        if (std::strcmp(c->getPluginName(), name) != 0)
            continue;
        std::vector<PluginField> fields;
        for (int32_t i = 0; i < nbFields; ++i)
            fields.emplace_back(names[i], data[i], static_cast<PluginFieldType>(types[i]), lengths[i]);
        PluginFieldCollection fc{nbFields, fields.data()};
        IPluginV3* plugin = c->createPlugin(name, &fc, TensorRTPhase::kBUILD);
        if (!plugin)
            return fail(err, errLen, std::string(name) + ": createPlugin returned nullptr (the log says why)"), nullptr;
        auto* core = static_cast<IPluginV3OneCore*>(plugin->getCapabilityInterface(PluginCapabilityType::kCORE));
        if (!core || std::strcmp(core->getPluginName(), name) || std::strcmp(core->getPluginNamespace(), c->getPluginNamespace())
            || std::strcmp(core->getPluginVersion(), c->getPluginVersion()))
        {
            delete plugin;
            return fail(err, errLen, std::string(name) + ": the core capability disagrees with the creator"), nullptr;
        }
        auto* s = new Session;
        s->creator = c;
        s->name = name;
        s->build = plugin;
        return s;
    }
    return fail(err, errLen, std::string("no creator named ") + name), nullptr;
}

// Inputs: dtypes (DataType values), ranks and dims (8 per tensor). Writes the outputs' count, dtypes,
// ranks, dims (8 each, room for 8 outputs), the workspace size and the aliased input of each output.
int32_t k3h_configure(void* sessPtr, int32_t nbIn, int32_t const* inTypes, int32_t const* inRanks, int64_t const* inDims,
    int32_t* nbOutOut, int32_t* outTypes, int32_t* outRanks, int64_t* outDims, int64_t* workspace, int32_t* aliased,
    char* err, int32_t errLen)
{
    auto* s = static_cast<Session*>(sessPtr);
    auto* build = static_cast<IPluginV3OneBuild*>(s->build->getCapabilityInterface(PluginCapabilityType::kBUILD));
    if (!build || !sameKind(build->getInterfaceInfo(), "PLUGIN_V3ONE_BUILD"))
        return fail(err, errLen, "no build capability"), 1;
    int32_t const nbOut = build->getNbOutputs();
    if (nbOut < 1 || nbOut > 8)
        return fail(err, errLen, "getNbOutputs out of range"), 1;
    *nbOutOut = nbOut;

    std::vector<DataType> inT(nbIn), outT(nbOut);
    std::vector<DimsExprs> inE(nbIn), outE(nbOut);
    ExprBuilder exprs;
    s->in.assign(nbIn, PluginTensorDesc{});
    for (int32_t i = 0; i < nbIn; ++i)
    {
        inT[i] = static_cast<DataType>(inTypes[i]);
        s->in[i].type = inT[i];
        s->in[i].format = TensorFormat::kLINEAR;
        s->in[i].scale = -1.f;
        s->in[i].dims.nbDims = inRanks[i];
        inE[i].nbDims = inRanks[i];
        for (int32_t d = 0; d < inRanks[i]; ++d)
        {
            s->in[i].dims.d[d] = inDims[i * 8 + d];
            inE[i].d[d] = exprs.constant(inDims[i * 8 + d]);
        }
    }
    if (build->getOutputDataTypes(outT.data(), nbOut, inT.data(), nbIn) != 0)
        return fail(err, errLen, "getOutputDataTypes failed"), 1;
    if (build->getOutputShapes(inE.data(), nbIn, nullptr, 0, outE.data(), nbOut, exprs) != 0)
        return fail(err, errLen, "getOutputShapes failed"), 1;
    s->out.assign(nbOut, PluginTensorDesc{});
    for (int32_t o = 0; o < nbOut; ++o)
    {
        s->out[o].type = outT[o];
        s->out[o].format = TensorFormat::kLINEAR;
        s->out[o].scale = -1.f;
        s->out[o].dims.nbDims = outE[o].nbDims;
        outTypes[o] = static_cast<int32_t>(outT[o]);
        outRanks[o] = outE[o].nbDims;
        for (int32_t d = 0; d < outE[o].nbDims; ++d)
        {
            if (!outE[o].d[d] || !outE[o].d[d]->isConstant())
                return fail(err, errLen, "an output dimension is not an expression of the inputs"), 1;
            s->out[o].dims.d[d] = outDims[o * 8 + d] = outE[o].d[d]->getConstantValue();
        }
    }
    // what the builder asks before it picks formats: each position in order, earlier ones fixed
    std::vector<DynamicPluginTensorDesc> io(nbIn + nbOut);
    for (int32_t i = 0; i < nbIn + nbOut; ++i)
    {
        PluginTensorDesc const& d = i < nbIn ? s->in[i] : s->out[i - nbIn];
        io[i].desc = d;
        io[i].min = io[i].max = io[i].opt = d.dims;
    }
    for (int32_t pos = 0; pos < nbIn + nbOut; ++pos)
        if (!build->supportsFormatCombination(pos, io.data(), nbIn, nbOut))
            return fail(err, errLen, "supportsFormatCombination refuses position " + std::to_string(pos)), 1;
    if (build->configurePlugin(io.data(), nbIn, io.data() + nbIn, nbOut) != 0)
        return fail(err, errLen, "configurePlugin failed"), 1;
    *workspace = static_cast<int64_t>(build->getWorkspaceSize(io.data(), nbIn, io.data() + nbIn, nbOut));
    bool const v2 = build->getInterfaceInfo().major >= 2;
    for (int32_t o = 0; o < nbOut; ++o)
        aliased[o] = v2 ? static_cast<IPluginV3OneBuildV2*>(build)->getAliasedInput(o) : -1;

    // the engine-load path: serialize the fields, recreate in the runtime phase, attach to a context
    auto* rt = static_cast<IPluginV3OneRuntime*>(s->build->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (!rt || !sameKind(rt->getInterfaceInfo(), "PLUGIN_V3ONE_RUNTIME"))
        return fail(err, errLen, "no runtime capability"), 1;
    IPluginV3* loaded = s->creator->createPlugin(s->name.c_str(), rt->getFieldsToSerialize(), TensorRTPhase::kRUNTIME);
    if (!loaded)
        return fail(err, errLen, "createPlugin from the serialized fields failed"), 1;
    auto* loadedRt = static_cast<IPluginV3OneRuntime*>(loaded->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    delete s->runtime;
    s->runtime = loadedRt ? loadedRt->attachToContext(&s->context) : nullptr;
    delete loaded;
    if (!s->runtime)
        return fail(err, errLen, "attachToContext failed"), 1;
    auto* attached = static_cast<IPluginV3OneRuntime*>(s->runtime->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (attached->setTactic(0) != 0 || attached->onShapeChange(s->in.data(), nbIn, s->out.data(), nbOut) != 0)
        return fail(err, errLen, "setTactic / onShapeChange refused the shapes (the log says why)"), 1;
    return 0;
}

int32_t k3h_enqueue(void* sessPtr, void const* const* inputs, void* const* outputs, void* workspace, void* stream,
    char* err, int32_t errLen)
{
    auto* s = static_cast<Session*>(sessPtr);
    if (!s->runtime)
        return fail(err, errLen, "k3h_configure first"), 1;
    auto* rt = static_cast<IPluginV3OneRuntime*>(s->runtime->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (rt->enqueue(s->in.data(), s->out.data(), inputs, outputs, workspace, static_cast<cudaStream_t>(stream)) != 0)
        return fail(err, errLen, s->name + ": enqueue failed (the log says why)"), 1;
    return 0;
}

void k3h_destroy(void* sessPtr) { delete static_cast<Session*>(sessPtr); }
}
