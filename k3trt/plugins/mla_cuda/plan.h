// The launch plan of the SM90 MLA kernels for callers without Python (the TensorRT plugin,
// k3trt/trt_plugin/src/mla_verify.cu): schedule.py's rule (pick_schedule, swap_head_group, tiles,
// default_splits, wave_splits) over plans.choose_splits, on the constants both read from
// mla_constants.h. tests/trt_plugin/test_mla_plan.py compiles this header and compares it with
// schedule.py over a grid of batches, rows, heads, cache dtypes and SM counts.
#pragma once

#include <algorithm>

#include "mla_constants.h"

namespace k3mla {

struct Plan {
  int schedule;     // kSchedulePair or kScheduleSwap
  int head_group;   // heads a swap CTA takes (swap_head_group)
  int splits;       // split-K count (default_splits)
  int wave_splits;  // the split rule's spread (wave_splits)
};

inline int swap_head_group(int q_per_req, int heads) {
  int g = std::min(kSwapMaxRows / std::max(q_per_req, 1), heads);
  while (g > 1 && heads % g) --g;
  return g;
}

inline int pick_schedule(bool kv_fp8, int q_per_req, int heads, int batch) {
  const int rows = q_per_req * swap_head_group(q_per_req, heads);
  if (kv_fp8 && batch >= kSwapMinBatch && rows > 0 &&
      (rows == q_per_req * heads || rows == kSwapMaxRows))
    return kScheduleSwap;
  return kSchedulePair;
}

inline int tiles(int batch, int q_per_req, int heads, int schedule) {
  if (schedule == kScheduleSwap) return batch * (heads / std::max(1, swap_head_group(q_per_req, heads)));
  return batch * ((q_per_req * heads + 63) / 64);
}

// plans.choose_splits: the smallest split count whose grid fills the waves to >= 85%, else the best fill
inline int choose_splits(long programs, int num_sms, int max_splits = kMaxSplits) {
  int best = 1;
  double best_eff = 0.0;
  for (int s = 1; s <= max_splits; ++s) {
    const long p = programs * s;
    const double eff = static_cast<double>(p) / (static_cast<double>((p + num_sms - 1) / num_sms) * num_sms);
    if (eff >= 0.85) return s;
    if (eff > best_eff + 1e-9) best = s, best_eff = eff;
  }
  return best;
}

inline Plan make_plan(bool kv_fp8, int batch, int q_per_req, int heads, int num_sms) {
  Plan p;
  p.schedule = pick_schedule(kv_fp8, q_per_req, heads, batch);
  p.head_group = swap_head_group(q_per_req, heads);
  const int t = std::max(1, tiles(batch, q_per_req, heads, p.schedule));
  p.splits = choose_splits(t, num_sms);
  p.wave_splits = std::max(1, std::min(p.splits, num_sms / t));
  return p;
}

// bytes of split scratch a call takes (part_o 16-bit [rows, splits, kDV], part_lse fp32 [rows, splits])
inline long scratch_bytes(const Plan& p, int batch, int q_per_req, int heads) {
  if (p.splits <= 1) return 0;
  const long rows = static_cast<long>(batch) * q_per_req * heads;
  return rows * p.splits * (kDV * 2 + 4);
}

}  // namespace k3mla
