// MlaVerify's tensor-core kernel for every GPU from sm_80 (mla_verify_mma.cu): SM120 first.
#pragma once

#include "plugin.h"

namespace k3trt
{
// the MlaVerify attributes the mma.sync kernel reads
struct MlaMmaConfig
{
    int32_t qPerReq, dv, dcpSize, sparseChunk;
    float softmaxScale, kvScale;
};

// whether the kernel takes this call (in: MlaVerify's input descs)
bool mlaMmaTakes(PluginTensorDesc const* in, MlaMmaConfig const& c);
// launches it on `stream`
cudaError_t mlaMmaRun(PluginTensorDesc const* in, MlaMmaConfig const& c, void const* const* inputs,
    void* const* outputs, cudaStream_t stream);
} // namespace k3trt
