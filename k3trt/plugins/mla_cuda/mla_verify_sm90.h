// Host interface of the SM90 MLA verification kernel (shared by mla_verify_sm90.cu and binding.cpp).
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
  int wave_splits, min_split_blocks, full_split_blocks;  // the split rule (sm90_common.cuh)
  int schedule;           // 0: shared-block kernel, 1: pair, 2: swap
  float softmax_scale, kv_scale;
  void* out;              // [B*Q, H, 512] bf16
  float* lse;             // [B*Q, H] fp32
  void* part_o;           // [B*Q*H, splits, 512] bf16, fp16 with an fp8 cache (splits > 1)
  float* part_lse;        // [B*Q*H, splits] fp32      (splits > 1)
  int* err;               // int32[4], zero-initialised; see mla_verify_sm90.cu
};
// Launches the verification kernel (+ the split merge); 0 on success, else a message in msg.
int launch(const LaunchArgs& a, cudaStream_t stream, char* msg, size_t msg_len);
#ifdef MLA_TIMELINE
// the diagnostic build's per-CTA phase stamps since the last read, which zeroes them
// (mla_verify_sm90_pair.cu)
cudaError_t timeline_copy(void* dst, size_t bytes);
#endif
}  // namespace k3mla
