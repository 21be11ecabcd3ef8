// Host interface of the SM90 MLA verification kernels (launch.cu), called by binding.cpp.
#pragma once
#include <cuda_runtime.h>
#include <cstddef>

namespace k3mla {
struct LaunchArgs {
  const void* q;          // [B*Q, H, 576] bf16
  const void* kv;         // [num_pages, 64, 576] bf16 or fp8-e4m3
  long num_pages;
  bool kv_fp8;
  const int* block_table; // [B, bt_stride] int32
  int bt_stride;
  const int* seq_lens;    // [B] int32
  int batch, q_per_req, heads, num_splits;
  int wave_splits, min_split_blocks, full_split_blocks;  // the split rule (common.cuh)
  int schedule;           // kSchedulePair or kScheduleSwap (mla_constants.h)
  int head_group;         // heads a swap CTA takes (swap_head_group in Python); unused by pair
  float softmax_scale, kv_scale;
  void* out;              // [B*Q, H, 512] bf16
  float* lse;             // [B*Q, H] fp32
  void* part_o;           // [B*Q*H, splits, 512] bf16, fp16 with an fp8 cache (splits > 1)
  float* part_lse;        // [B*Q*H, splits] fp32      (splits > 1)
  int* err;               // int32[4], zero-initialised: the first mbarrier timeout (common.cuh)
};
// Launches the verification kernel (+ the split merge); 0 on success, else a message in msg.
int launch(const LaunchArgs& a, cudaStream_t stream, char* msg, size_t msg_len);
#ifdef MLA_TIMELINE
// the timeline build's per-CTA phase stamps since the last read, which zeroes them (pair.cu;
// built by benchmarks/mla_verify.py --timeline only)
cudaError_t timeline_copy(void* dst, size_t bytes);
#endif
}  // namespace k3mla
