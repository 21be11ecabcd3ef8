// MlaVerify on SM90: the torch op's own kernels and launcher (k3trt/plugins/mla_cuda/launch.cu,
// compiled into the library's sm_90a part by build.py with K3TRT_MLA_SM90 defined), planned by
// mla_cuda/plan.h, the C++ copy of the rule the torch op applies (schedule.py). The plugin takes
// this path for the calls the kernels are built for (bf16 q [B*Q, H, 576], d_v 512, a [pages, 64,
// 576] bf16 or fp8 cache, no DCP, no sparse policy) on a compute-capability 9.0 device; everything
// else runs the plain kernel (mla_verify.cu).
#include "mla_verify_sm90.h"

#ifdef K3TRT_MLA_SM90
#include "launch.h"
#include "plan.h"
#endif

namespace k3trt
{
namespace
{
constexpr size_t kAlign = 256;

size_t alignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

#ifdef K3TRT_MLA_SM90
// the current device's SM count when it is compute capability 9.0, else 0
int32_t sm90Count()
{
    int32_t device = 0, major = 0, minor = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess
        || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess
        || cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess
        || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    {
        cudaGetLastError();   // no device (a CPU build): not an error of this call
        return 0;
    }
    return major == 9 && minor == 0 ? sms : 0;
}

// (err int32[4], part_lse fp32 [rows, splits], part_o 16-bit [rows, splits, 512]), each 256-aligned
size_t callBytes(k3mla::Plan const& plan, int32_t batch, int32_t q, int32_t heads)
{
    long const rows = static_cast<long>(batch) * q * heads;
    size_t bytes = alignUp(4 * sizeof(int32_t));
    if (plan.splits > 1)
        bytes += alignUp(rows * plan.splits * sizeof(float)) + alignUp(rows * plan.splits * k3mla::kDV * 2);
    return bytes;
}
#endif
} // namespace

bool mlaSm90Built()
{
#ifdef K3TRT_MLA_SM90
    return true;
#else
    return false;
#endif
}

bool mlaSm90Takes(PluginTensorDesc const* in, MlaSm90Config const& c)
{
#ifdef K3TRT_MLA_SM90
    Dims const &q = in[0].dims, &kv = in[1].dims;
    return c.dcpSize == 1 && c.sparseChunk <= 0 && c.dv == k3mla::kDV && in[0].type == DataType::kBF16
        && (in[1].type == DataType::kBF16 || in[1].type == DataType::kFP8) && q.nbDims == 3 && q.d[2] == k3mla::kD
        && kv.nbDims == 3 && kv.d[1] == k3mla::kPage && kv.d[2] == k3mla::kD && sm90Count() > 0;
#else
    (void) in;
    (void) c;
    return false;
#endif
}

size_t mlaSm90Workspace(PluginTensorDesc const* inMax, MlaSm90Config const& c)
{
#ifdef K3TRT_MLA_SM90
    if (!mlaSm90Takes(inMax, c))
        return 0;
    // sized on the device the engine is built on (full TensorRT builds on its target GPU): the
    // largest over every batch up to the profile's, as smaller batches may split further
    int32_t const sms = sm90Count(), heads = static_cast<int32_t>(inMax[0].dims.d[1]);
    int32_t const maxBatch = static_cast<int32_t>(inMax[2].dims.d[0]);
    bool const fp8 = inMax[1].type == DataType::kFP8;
    size_t most = 0;
    for (int32_t b = 1; b <= maxBatch; ++b)
    {
        size_t const n = callBytes(k3mla::make_plan(fp8, b, c.qPerReq, heads, sms), b, c.qPerReq, heads);
        most = n > most ? n : most;
    }
    return most;
#else
    (void) inMax;
    (void) c;
    return 0;
#endif
}

cudaError_t mlaSm90Run(PluginTensorDesc const* in, MlaSm90Config const& c, void const* const* inputs,
    void* const* outputs, void* workspace, cudaStream_t stream, std::string& error)
{
#ifdef K3TRT_MLA_SM90
    Dims const &q = in[0].dims, &kv = in[1].dims, &bt = in[2].dims;
    int32_t const batch = static_cast<int32_t>(bt.d[0]), heads = static_cast<int32_t>(q.d[1]);
    if (batch == 0 || heads == 0)
        return cudaSuccess;
    bool const fp8 = in[1].type == DataType::kFP8;
    k3mla::Plan const plan = k3mla::make_plan(fp8, batch, c.qPerReq, heads, sm90Count());
    auto* base = static_cast<char*>(workspace);
    long const rows = static_cast<long>(batch) * c.qPerReq * heads;
    k3mla::LaunchArgs a{};
    a.err = reinterpret_cast<int*>(base);
    cudaError_t e = cudaMemsetAsync(a.err, 0, 4 * sizeof(int32_t), stream);
    if (e != cudaSuccess)
        return e;
    if (plan.splits > 1)
    {
        a.part_lse = reinterpret_cast<float*>(base + alignUp(4 * sizeof(int32_t)));
        a.part_o = base + alignUp(4 * sizeof(int32_t)) + alignUp(rows * plan.splits * sizeof(float));
    }
    a.q = inputs[0];
    a.kv = inputs[1];
    a.num_pages = kv.d[0];
    a.kv_fp8 = fp8;
    a.block_table = static_cast<int const*>(inputs[2]);
    a.bt_stride = static_cast<int>(bt.d[1]);
    a.seq_lens = static_cast<int const*>(inputs[3]);
    a.batch = batch;
    a.q_per_req = c.qPerReq;
    a.heads = heads;
    a.num_splits = plan.splits;
    a.wave_splits = plan.wave_splits;
    a.min_split_blocks = k3mla::kMinSplitBlocks;
    a.full_split_blocks = k3mla::kFullSplitBlocks;
    a.schedule = plan.schedule;
    a.head_group = plan.head_group;
    a.softmax_scale = c.softmaxScale;
    a.kv_scale = c.kvScale;
    a.out = outputs[0];
    a.lse = static_cast<float*>(outputs[1]);
    char msg[256] = {0};
    if (k3mla::launch(a, stream, msg, sizeof(msg)) != 0)
    {
        error = msg;
        return cudaErrorInvalidValue;
    }
    return cudaSuccess;
#else
    (void) in, (void) c, (void) inputs, (void) outputs, (void) workspace, (void) stream;
    error = "the library was built without sm_90a: no SM90 MLA kernels";
    return cudaErrorInvalidDeviceFunction;
#endif
}
} // namespace k3trt
