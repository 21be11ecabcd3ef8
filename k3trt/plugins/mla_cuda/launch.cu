// Host launch of the SM90 MLA verification kernels: checks the call, builds the TMA tensor maps
// and the kernels' Params, launches the schedule's verify kernel (pair.cu or swap.cu) and, with
// split-K, the merge (merge.cu) as a programmatic dependent launch behind it.

#include <cuda.h>

#include <algorithm>

#include "kernels.h"
#include "launch.h"

namespace k3mla {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiledFn get_encode_fn(char* msg, size_t msg_len) {
  static EncodeTiledFn fn = nullptr;
  if (fn) return fn;
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                   cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || ptr == nullptr) {
    snprintf(msg, msg_len, "cuTensorMapEncodeTiled not found (cuda error %d, query %d)",
             static_cast<int>(e), static_cast<int>(q));
    return nullptr;
  }
  fn = reinterpret_cast<EncodeTiledFn>(ptr);
  return fn;
}

// Returns 0 on success, else writes a message into msg.
int launch(const LaunchArgs& a, cudaStream_t stream, char* msg, size_t msg_len) {
  if (a.num_splits > 1 && merge_smem_bytes(a.num_splits) > 48 * 1024) {
    snprintf(msg, msg_len, "num_splits %d: the merge kernel's shared memory would pass 48 KB",
             a.num_splits);
    return 1;
  }
  EncodeTiledFn encode = get_encode_fn(msg, msg_len);
  if (!encode) return 1;
  // 576-wide rows in boxes of box_x elements x 64 rows: the KV cache's pages (bf16 with the 128-byte
  // swizzle, or raw fp8 bytes in 64-byte boxes), the pair kernel's Q tile (bf16, swizzled: the wgmma
  // A layout), and the swap kernel's raw fp8 rows (value chunks in 128-byte boxes with the 128-byte
  // swizzle, the rope chunk in a 64-byte box with the 64-byte swizzle: both are wgmma operands as
  // they lie)
  auto encode_rows = [&](CUtensorMap* map, const void* base, long rows, bool bytes, int box_x,
                         CUtensorMapSwizzle swizzle) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kD) * (bytes ? 1 : 2)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_x), 64};
    const cuuint32_t estr[2] = {1, 1};
    return encode(map, bytes ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                  const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  if (a.schedule != kSchedulePair && a.schedule != kScheduleSwap) {
    snprintf(msg, msg_len, "schedule %d is not a kernel schedule", a.schedule);
    return 1;
  }
  const bool swap = a.schedule == kScheduleSwap;
  // the swap CTA's tile: q_per_req x head_group rows (Python's swap_head_group picks it)
  const int head_group = swap ? a.head_group : a.heads;
  if (swap && (!a.kv_fp8 || head_group < 1 || a.heads % head_group != 0 ||
               a.q_per_req * head_group > kSwapMaxRows)) {
    snprintf(msg, msg_len, "schedule swap takes an fp8 cache and a head group dividing the %d "
             "heads with at most %d rows (q_per_req %d, head_group %d)", a.heads, kSwapMaxRows,
             a.q_per_req, a.head_group);
    return 1;
  }
  CUtensorMap map, q_map;
  const long q_rows = static_cast<long>(a.batch) * a.q_per_req * a.heads;
  const long kv_rows = a.num_pages * kPage;
  // (swap: map = the value chunks, q_map = the rope chunk; it reads Q with plain loads)
  constexpr CUtensorMapSwizzle kSw128 = CU_TENSOR_MAP_SWIZZLE_128B;
  CUresult r = swap ? encode_rows(&map, a.kv, kv_rows, true, 128, kSw128)
                    : encode_rows(&map, a.kv, kv_rows, a.kv_fp8, 64,
                                  a.kv_fp8 ? CU_TENSOR_MAP_SWIZZLE_NONE : kSw128);
  if (r == CUDA_SUCCESS)
    r = swap ? encode_rows(&q_map, a.kv, kv_rows, true, 64, CU_TENSOR_MAP_SWIZZLE_64B)
             : encode_rows(&q_map, a.q, q_rows, false, 64, kSw128);
  if (r != CUDA_SUCCESS) {
    snprintf(msg, msg_len, "cuTensorMapEncodeTiled failed with CUresult %d", static_cast<int>(r));
    return 1;
  }
  Params p;
  p.q = a.q;
  p.block_table = a.block_table;
  p.seq_lens = a.seq_lens;
  p.out = a.out;
  p.lse = a.lse;
  p.part_o = static_cast<uint16_t*>(a.part_o);
  p.part_lse = a.part_lse;
  p.err = a.err;
  p.bt_stride = a.bt_stride;
  p.q_per_req = a.q_per_req;
  p.heads = a.heads;
  p.rows_per_req = a.q_per_req * a.heads;
  p.head_group = head_group;
  p.num_splits = a.num_splits;
  p.rule = {std::max(1, std::min(a.wave_splits, a.num_splits)), std::max(1, a.min_split_blocks),
            std::max(1, a.full_split_blocks)};
  const float log2e = 1.4426950408889634f;
  p.scale_log2 = a.softmax_scale * a.kv_scale * log2e * (a.kv_fp8 ? 16.f : 1.f);
  p.out_scale = a.kv_scale;

  // x: the pair kernels' 64-row M tiles of a request, or the swap kernel's head groups
  const int m_tiles = swap ? a.heads / head_group : (p.rows_per_req + 63) / 64;
  dim3 grid(m_tiles, a.num_splits, a.batch);
  cudaError_t e = swap ? launch_swap(map, q_map, p, grid, stream)
                       : launch_pair(map, q_map, p, grid, a.kv_fp8, stream);
  if (e != cudaSuccess) {
    snprintf(msg, msg_len, "verify kernel setup: %s", cudaGetErrorString(e));
    return 1;
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(msg, msg_len, "verify kernel launch: %s", cudaGetErrorString(e));
    return 1;
  }
  if (a.num_splits > 1) {
    e = launch_merge(p, static_cast<long>(a.batch) * p.rows_per_req, a.kv_fp8, a.kv_scale, stream);
    if (e != cudaSuccess) {
      snprintf(msg, msg_len, "merge kernel launch: %s", cudaGetErrorString(e));
      return 1;
    }
  }
  return 0;
}

}  // namespace k3mla
