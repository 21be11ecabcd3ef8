// MlaVerify's SM90 path (mla_verify_sm90.cu): the torch op's SM90 kernels behind the plugin.
#pragma once

#include "plugin.h"

#include <string>

namespace k3trt
{
// the MlaVerify attributes the SM90 path reads
struct MlaSm90Config
{
    int32_t qPerReq, dv, dcpSize, sparseChunk;
    float softmaxScale, kvScale;
};

// whether the library holds the SM90 kernels (built with sm_90a)
bool mlaSm90Built();
// whether the SM90 kernels take this call on the current device (in: MlaVerify's input descs)
bool mlaSm90Takes(PluginTensorDesc const* in, MlaSm90Config const& c);
// workspace the SM90 path needs for any call up to these (the profile's largest) shapes; 0 when
// it would not take them
size_t mlaSm90Workspace(PluginTensorDesc const* inMax, MlaSm90Config const& c);
// launches the verify kernel (+ the split merge) on `stream`; on a refusal `error` says why
cudaError_t mlaSm90Run(PluginTensorDesc const* in, MlaSm90Config const& c, void const* const* inputs,
    void* const* outputs, void* workspace, cudaStream_t stream, std::string& error);
} // namespace k3trt
