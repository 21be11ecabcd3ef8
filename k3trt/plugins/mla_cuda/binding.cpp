// Torch binding of the SM90 MLA verification kernels (launch.cu). Python allocates every buffer
// (so tests can poison them), picks the schedule and passes the CUDA stream; this file only checks
// and launches.
#include <torch/extension.h>

#include <cuda_runtime.h>

#include <string>

#include "launch.h"
#include "mla_constants.h"

static void forward(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                    torch::Tensor seq_lens, int64_t q_per_req, double softmax_scale,
                    double kv_scale, int64_t num_splits, int64_t wave_splits,
                    int64_t min_split_blocks, int64_t full_split_blocks,
                    torch::Tensor out, torch::Tensor lse, torch::Tensor part_o,
                    torch::Tensor part_lse, torch::Tensor err, int64_t schedule,
                    int64_t head_group, int64_t stream) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == torch::kBFloat16 && q.is_contiguous(),
              "q must be contiguous bf16 on CUDA");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == k3mla::kD, "q must be [B*Q, H, ", k3mla::kD, "]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0, "q not 16-aligned");
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(1) == k3mla::kPage &&
                  kv_cache.size(2) == k3mla::kD &&
                  kv_cache.is_contiguous(),
              "kv_cache must be contiguous [pages, ", k3mla::kPage, ", ", k3mla::kD, "]");
  const bool fp8 = kv_cache.element_size() == 1;
  TORCH_CHECK(fp8 || kv_cache.scalar_type() == torch::kBFloat16, "kv_cache must be bf16 or fp8");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 16 == 0, "kv_cache not 16-aligned");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "block_table must be int32 [B, pages] with unit inner stride");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() &&
                  out.size(-1) == k3mla::kDV,
              "out must be contiguous bf16 [.., ", k3mla::kDV, "]");
  TORCH_CHECK(lse.scalar_type() == torch::kFloat32 && lse.is_contiguous(), "lse must be fp32");
  TORCH_CHECK(err.scalar_type() == torch::kInt32 && err.numel() >= 4, "err must be int32[4]");
  const int batch = static_cast<int>(block_table.size(0));
  TORCH_CHECK(q.size(0) == batch * q_per_req, "q rows != batch * q_per_req");
  if (num_splits > 1) {
    TORCH_CHECK(part_o.scalar_type() == (fp8 ? torch::kHalf : torch::kBFloat16) &&
                    part_lse.scalar_type() == torch::kFloat32,
                "split scratch must be bf16 (fp16 with an fp8 cache) for O and fp32 for lse");
    TORCH_CHECK(part_o.numel() >= q.size(0) * q.size(1) * num_splits * k3mla::kDV &&
                    part_lse.numel() >= q.size(0) * q.size(1) * num_splits,
                "split scratch too small");
  }
  k3mla::LaunchArgs a;
  a.q = q.data_ptr();
  a.kv = kv_cache.data_ptr();
  a.num_pages = kv_cache.size(0);
  a.kv_fp8 = fp8;
  a.block_table = block_table.data_ptr<int>();
  a.bt_stride = static_cast<int>(block_table.stride(0));
  a.seq_lens = seq_lens.data_ptr<int>();
  a.batch = batch;
  a.q_per_req = static_cast<int>(q_per_req);
  a.heads = static_cast<int>(q.size(1));
  a.num_splits = static_cast<int>(num_splits);
  a.wave_splits = static_cast<int>(wave_splits);
  a.min_split_blocks = static_cast<int>(min_split_blocks);
  a.full_split_blocks = static_cast<int>(full_split_blocks);
  a.schedule = static_cast<int>(schedule);
  a.head_group = static_cast<int>(head_group);
  a.softmax_scale = static_cast<float>(softmax_scale);
  a.kv_scale = static_cast<float>(kv_scale);
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  a.part_o = num_splits > 1 ? part_o.data_ptr() : nullptr;
  a.part_lse = num_splits > 1 ? part_lse.data_ptr<float>() : nullptr;
  a.err = err.data_ptr<int>();
  if (batch == 0 || q.size(1) == 0) return;
  char msg[256] = {0};
  const int rc = k3mla::launch(a, reinterpret_cast<cudaStream_t>(stream), msg, sizeof(msg));
  TORCH_CHECK(rc == 0, "mla_verify_sm90: ", std::string(msg));
}

#ifdef MLA_TIMELINE
// the timeline build's stamps: uint64 [ctas, 12] (slots in pair.cu)
static torch::Tensor timeline(int64_t ctas) {
  auto t = torch::zeros({ctas, 12}, torch::kInt64);
  const cudaError_t e = k3mla::timeline_copy(t.data_ptr(), t.numel() * 8);
  TORCH_CHECK(e == cudaSuccess, "timeline copy: ", cudaGetErrorString(e));
  return t;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "k3trt MLA verification, SM90 kernel (+ split merge)");
#ifdef MLA_TIMELINE
  m.def("timeline", &timeline,
        "per-CTA phase stamps of the pair kernel since the last read (which zeroes them)");
#endif
}
