// Each row's greedy choice taken inside an output product, tile by tile as the kernel stores its
// outputs (still in L1), so the step needs no second pass over the logits (greedy_tokens' 12.6 MB at
// 64 rows of a 49,152-token vocabulary, out of the caches by then). The products that take it:
// float_panels.cpp and panel_i16.h (for_panel_tiles), gemm_bf16.cpp, act_quant.h's VNNI products.
//
// The choice is greedy_tokens': the first index of the row's largest value. A thread folds every tile
// it stores into its own slot, per row the largest value and its first index, a larger value or an
// equal one at a smaller index winning; that rule is associative and commutative, so the slots merge
// the same whatever thread took which tile (work_share.h hands tiles to whichever thread is free),
// and the result is the first index of the largest value over the whole row. A row holding a NaN is
// marked and chosen at the end as greedy_tokens chooses it (torch.max over the row as stored).

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "row_max.h"
#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagecli {

// The choice greedy_tokens makes for a row holding a NaN: torch.max's index over it.
int64_t choice_of_nan_row(const at::Tensor& row);

// Whether row[0, n) holds a value not below `floor`, or a NaN: whether a tile can change a row's choice.
template <typename scalar_t>
inline bool reaches(const scalar_t* row, int64_t n, float floor) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 f = _mm512_set1_ps(floor);
  __mmask16 hit = 0;
  for (; i + 16 <= n; i += 16) hit |= _mm512_cmp_ps_mask(load16(row + i), f, _CMP_NLT_UQ);
  if (hit) return true;
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    const __m256 f = _mm256_set1_ps(floor);
    __m256 hit = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) hit = _mm256_or_ps(hit, _mm256_cmp_ps(_mm256_loadu_ps(row + i), f, _CMP_NLT_UQ));
    if (_mm256_movemask_ps(hit)) return true;
  }
#endif
  for (; i < n; ++i) {
    if (!(to_float(row[i]) < floor)) return true;
  }
  return false;
}

class GreedyChoices {
 public:
  // For a product of `rows` rows, run in a parallel region of at most at::get_num_threads() threads.
  explicit GreedyChoices(int64_t rows)
      : rows_(rows), stride_(rows + 4),
        slots_(std::max<int64_t>({1, omp_get_max_threads(), at::get_num_threads()})),
        best_(slots_ * stride_), used_(slots_, 0), pending_(slots_) {}

  // Takes one stored tile into this thread's slot: y points at output [m0, c0], rows `stride` values
  // apart; the tile is `rows` rows by `cols` columns. It is folded when the thread stores its next tile
  // (or in finish): read back right after its stores, a tile's vector loads wait for them to retire (a
  // load wider than the stores it reads is not forwarded).
  template <typename scalar_t>
  void tile(const scalar_t* y, int64_t stride, int64_t m0, int64_t rows, int64_t c0, int64_t cols) {
    // OpenMP's thread number inside a region of its own (a Team's, or ATen's on its OpenMP backend), else
    // ATen's (its native thread pool; 0 outside any region).
    const int64_t slot = omp_in_parallel() ? omp_get_thread_num() : at::get_thread_num();
    if (slot >= slots_) {  // a region larger than promised: the caller falls back to a pass of its own
      overflow_.store(true, std::memory_order_relaxed);
      return;
    }
    Best* mine = best_.data() + slot * stride_;
    if (!used_[slot]) {
      std::fill(mine, mine + rows_, Best{});
      used_[slot] = 1;
    }
    Tile& pending = pending_[slot];
    if (pending.rows) fold(static_cast<const scalar_t*>(pending.y), pending, mine);
    pending = Tile{y, stride, m0, rows, c0, cols};
  }

  // The choices merged over the threads, int64 [rows], for `stored`, the product's output [rows, N] the
  // tiles were taken from (a NaN row is read there); undefined when a slot overflowed.
  at::Tensor finish(const at::Tensor& stored);

 private:
  struct Best {
    float value = -std::numeric_limits<float>::infinity();
    int64_t index = std::numeric_limits<int64_t>::max();  // none yet
    bool nan = false;

    void take(float v, int64_t i) {
      if (v > value || (v == value && i < index)) {
        value = v;
        index = i;
      }
    }
  };

  struct alignas(64) Tile {  // a line of its own: each thread writes its slot's at every tile
    const void* y = nullptr;
    int64_t stride = 0, m0 = 0, rows = 0, c0 = 0, cols = 0;  // rows 0: none
  };

  template <typename scalar_t>
  static void fold(const scalar_t* y, const Tile& t, Best* mine) {
    for (int64_t r = 0; r < t.rows; ++r) {
      const scalar_t* row = y + r * t.stride;
      Best& best = mine[t.m0 + r];
      if (best.nan || !reaches(row, t.cols, best.value)) continue;  // the common case: nothing here beats it
      bool has_nan = false;
      const float top = max_of_row(row, t.cols, has_nan);
      if (has_nan) {
        best.nan = true;
      } else if (top > best.value || (top == best.value && t.c0 < best.index)) {
        best.take(top, t.c0 + first_index_of(row, t.cols, top));
      }
    }
  }

  int64_t rows_, stride_, slots_;  // stride_: a slot's rows, padded so two threads' rows rarely share a line
  std::vector<Best> best_;         // [slots_, stride_]
  std::vector<char> used_;         // per slot: whether its thread stored a tile (its rows are set)
  std::vector<Tile> pending_;      // per slot: the last tile its thread stored, not yet folded
  std::atomic<bool> overflow_{false};
};

}  // namespace pagecli
