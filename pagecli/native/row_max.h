// The largest value of a row of logits and whether it holds a NaN, in one vectorized pass, and the first
// index of a value: the greedy choice (greedy.cpp, greedy_choices.h) and the sampler's weights (sampling.cpp)
// start from them.

#pragma once

#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace pagecli {

// The largest non-NaN value of row[0, n) and whether the row holds a NaN.
template <typename scalar_t>
inline float max_of_row(const scalar_t* row, int64_t n, bool& has_nan) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(best);
  __mmask16 nan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(row + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    acc = _mm512_max_ps(v, acc);  // a NaN in v keeps acc (the second operand)
  }
  best = _mm512_reduce_max_ps(acc);
  has_nan = nan != 0;
#elif defined(__AVX2__)
  has_nan = false;
  if constexpr (std::is_same_v<scalar_t, float>) {
    __m256 acc = _mm256_set1_ps(best), unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      acc = _mm256_max_ps(v, acc);  // a NaN in v keeps acc (the second operand)
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (float lane : lanes) best = std::max(best, lane);
    has_nan = _mm256_movemask_ps(unordered) != 0;
  }
#else
  has_nan = false;
#endif
  for (; i < n; ++i) {
    const float v = to_float(row[i]);
    if (std::isnan(v)) {
      has_nan = true;
    } else if (v > best) {
      best = v;
    }
  }
  return best;
}

// The first index of `value` in row[0, n) (present: max_of_row found it there; 0 if not).
template <typename scalar_t>
inline int64_t first_index_of(const scalar_t* row, int64_t n, float value) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(value);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(row + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    const __m256 target = _mm256_set1_ps(value);
    for (; i + 8 <= n; i += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
      if (hit) return i + __builtin_ctz(hit);
    }
  }
#endif
  for (; i < n; ++i) {
    if (to_float(row[i]) == value) return i;
  }
  return 0;
}

}  // namespace pagecli
