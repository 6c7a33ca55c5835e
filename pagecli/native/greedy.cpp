// The greedy choice: each row's first index of its largest logit, as torch.max(dim=-1) gives it. For
// one stream it is a pass over a vocabulary-sized row per token (49,152 bf16 values for SmolLM2),
// where torch's reduction, called from Python right after the output layer, took 50-180 us. And the
// merge of the choices an output product took as it stored its tiles (greedy_choices.h).

#include "cpu_ops.h"
#include "greedy_choices.h"
#include "row_max.h"
#include "simd.h"
#include "work_share.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

#include <cmath>
#include <limits>

namespace pagecli {
namespace {

constexpr int64_t kChunk = 1024;  // logits per chunk of greedy_tokens' one pass: 4 KiB of float32

}  // namespace

std::vector<int64_t> greedy_tokens(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.size(1) > 0,
              "logits must be a CPU [rows, vocab] tensor");
  const torch::Tensor rows = logits.contiguous();
  const int64_t count = rows.size(0), vocab = rows.size(1);
  std::vector<int64_t> tokens(count);
  PAGECLI_DISPATCH(rows.scalar_type(), "greedy_tokens", [&] {
    const scalar_t* p = rows.data_ptr<scalar_t>();
    std::vector<char> nan_rows(count, 0);
    // One pass over the row: the maximum of each chunk of kChunk logits, the first chunk holding the
    // largest, then the first index of that value within that chunk (still in L1). Was the row's maximum
    // and then a second pass to find its index (half the row again on average).
    const auto pick = [&](int64_t r) {
      const scalar_t* row = p + r * vocab;
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_start = 0;
      for (int64_t start = 0; start < vocab; start += kChunk) {
        bool has_nan = false;
        const float top = max_of_row(row + start, std::min(kChunk, vocab - start), has_nan);
        if (has_nan) {
          nan_rows[r] = 1;
          tokens[r] = 0;
          return;
        }
        if (top > best) {  // strictly: an equal maximum later in the row is not the first
          best = top;
          best_start = start;
        }
      }
      tokens[r] = best_start + first_index_of(row + best_start, std::min(kChunk, vocab - best_start), best);
    };
    // Rows shared out over the threads only where there are millions of logits (a 64-row step of 49,152:
    // 0.4-0.6 ms on one AVX2 core): below that a parallel region's start costs more than it saves.
    if (count * vocab >= (int64_t{1} << 21)) {
      parallel_shared_items(count, 1, pick);
    } else {
      for (int64_t r = 0; r < count; ++r) pick(r);
    }
    for (int64_t r = 0; r < count; ++r) {
      // A NaN: whatever torch.max makes of it (it is not a case worth a path of its own).
      if (nan_rows[r]) tokens[r] = choice_of_nan_row(rows[r]);
    }
  });
  return tokens;
}

int64_t choice_of_nan_row(const at::Tensor& row) { return std::get<1>(row.max(0)).item<int64_t>(); }

at::Tensor GreedyChoices::finish(const at::Tensor& stored) {
  if (overflow_.load(std::memory_order_relaxed)) return at::Tensor();
  PAGECLI_DISPATCH(stored.scalar_type(), "greedy_choices", [&] {
    for (int64_t slot = 0; slot < slots_; ++slot) {
      const Tile& last = pending_[slot];
      if (last.rows) fold(static_cast<const scalar_t*>(last.y), last, best_.data() + slot * stride_);
    }
  });
  at::Tensor choices = at::empty({rows_}, stored.options().dtype(at::kLong));  // [rows]
  int64_t* out = choices.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows_; ++r) {
    Best merged;
    for (int64_t slot = 0; slot < slots_; ++slot) {
      if (!used_[slot]) continue;
      const Best& best = best_[slot * stride_ + r];
      merged.nan |= best.nan;
      if (best.index != Best{}.index) merged.take(best.value, best.index);
    }
    if (!merged.nan && merged.index == Best{}.index) return at::Tensor();  // no tile of this row was folded
    out[r] = merged.nan ? choice_of_nan_row(stored[r]) : merged.index;
  }
  return choices;
}

}  // namespace pagecli
