// The launchers of the SM90 MLA verification kernels, one per file (pair.cu, swap.cu, merge.cu),
// called by launch() (launch.cu) once it has built the tensor maps and the Params.
#pragma once

#include "common.cuh"

namespace k3mla {

// launches the pair-schedule kernel (pair.cu); q_map: Q as [B*Q*H, 576] bf16 rows,
// 64x64 boxes, 128-byte swizzle; a CUDA error code
cudaError_t launch_pair(const CUtensorMap& kv_map, const CUtensorMap& q_map, const Params& p,
                        dim3 grid, bool fp8, cudaStream_t stream);
// launches the swap-AB kernel (swap.cu: fp8 cache, at most kSwapMaxRows rows a CTA); kv128 /
// kv64: the raw cache as [pages*64, 576] bytes in 128-byte boxes with the 128-byte swizzle / 64-byte
// boxes with the 64-byte swizzle (the rope chunk, read by wgmma as it lies)
cudaError_t launch_swap(const CUtensorMap& kv128, const CUtensorMap& kv64, const Params& p,
                        dim3 grid, cudaStream_t stream);

// the shared memory launch_merge's grouped kernel takes for a plan of `splits` (launch() refuses
// plans past 48 KB)
size_t merge_smem_bytes(int splits);
// launches the split merge (merge.cu) of rows [0, rows) after the verify kernel on `stream`
cudaError_t launch_merge(const Params& p, long rows, bool kv_fp8, float kv_scale,
                         cudaStream_t stream);

}  // namespace k3mla
