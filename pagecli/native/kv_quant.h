// The quantized KV cache rows (pagecli/kv_format.py) in C++: quantizing a row as
// quantize_rows does, byte for byte, and the AVX2 pieces decode attention reads such rows with
// (widening a tile of rows to fp32, scores and weighted sums over a widened tile, softmax). The same
// code runs at every level: AVX2, FMA and F16C are part of the avx512 and amx levels too.
//
// Row of one (token, kv head): head_dim data bytes, then the row's scale as float16 (little endian).
//   int8  (torch.int8 cache):  value = int8 data * scale
//   fp8   (torch.uint8 cache): value = e4m3fn data * scale

#pragma once

#include "simd.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "pagecli's quantized KV kernels need AVX2, FMA and F16C (every build level has them)"
#endif

namespace pagecli {

constexpr int64_t kKvScaleBytes = 2;  // the fp16 scale after each row's data

enum class KvQuant { kInt8, kFp8 };

// The format a cache tensor's dtype names, or false when it is a float cache.
inline bool is_quantized_kv(c10::ScalarType dtype) { return dtype == at::kChar || dtype == at::kByte; }
inline KvQuant kv_quant_of(c10::ScalarType dtype) { return dtype == at::kChar ? KvQuant::kInt8 : KvQuant::kFp8; }

// Writes x[0, dim) as one cache row at dst (dim data bytes, then the fp16 scale): the bytes
// kv_format.quantize_rows gives. The scale is max|x| / range in fp32, rounded to fp16 (nearest even);
// values are x * (1 / scale) in fp32 clamped to the range, then rounded half to even (int8, under
// the default rounding mode) or converted as torch converts float32 to float8_e4m3fn (fp8).
template <KvQuant F, typename scalar_t>
inline void quantize_row(const scalar_t* x, int64_t dim, uint8_t* dst) {
  constexpr float range = F == KvQuant::kInt8 ? 127.f : 448.f;
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const c10::Half scale_half(amax / range);
  const float scale = static_cast<float>(scale_half);
  const float inverse = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float v = std::min(std::max(to_float(x[d]) * inverse, -range), range);
    if constexpr (F == KvQuant::kInt8) {
      dst[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v)));
    } else {
      dst[d] = c10::Float8_e4m3fn(v).x;
    }
  }
  std::memcpy(dst + dim, &scale_half.x, kKvScaleBytes);
}

// The factor a row's widened data is multiplied by: its fp16 scale, times 256 for fp8 (widen8 gives
// e4m3fn values / 256).
template <KvQuant F>
inline float row_scale(const uint8_t* row, int64_t dim) {
  uint16_t bits;
  std::memcpy(&bits, row + dim, kKvScaleBytes);
  const float scale = _cvtsh_ss(bits);
  return F == KvQuant::kFp8 ? scale * 256.f : scale;
}

// 16 bytes of a row's data -> 16 floats at dst (int8: the values; fp8: the values / 256). An e4m3fn
// byte S.EEEE.MMM moved to bits 15 and 13..7 of a float16 is that float16's S.0EEEE.MMM0000000: the
// same value times 2^(7 - 15), normal or subnormal alike. Sign-extended to 16 bits and shifted left
// by 7, the byte's sign lands in bit 15 (and 14) and the rest in bits 13..7, so one mask finishes
// it. (0x7F/0xFF, e4m3fn's NaN, never occurs: stores clamp.)
template <KvQuant F>
inline void widen16(const uint8_t* p, float* dst) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (F == KvQuant::kInt8) {
    _mm256_storeu_ps(dst, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    _mm256_storeu_ps(dst + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes))));
  } else {
    const __m256i half_bits = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                               _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm256_castsi256_si128(half_bits)));
    _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(half_bits, 1)));
  }
}

// Rows rows[i] (i < n <= 16) -> buf[i * dim + d] as floats (before scaling), scales[i] = row_scale.
template <KvQuant F>
inline void widen_quantized_tile(const uint8_t* const* rows, int64_t n, int64_t dim, float* buf, float* scales) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < dim; d += 16) widen16<F>(rows[i] + d, buf + i * dim + d);
    scales[i] = row_scale<F>(rows[i], dim);
  }
}

// 16 values of a float cache row -> 16 floats at dst, by simd.h's load8: fp32 as they are, bf16
// zero-extended and shifted into the high half, fp16 through F16C.
template <typename scalar_t>
inline void widen16(const scalar_t* p, float* dst) {
  _mm256_storeu_ps(dst, load8(p));
  _mm256_storeu_ps(dst + 8, load8(p + 8));
}

// The row formats the tiled decode kernel (decode_attention_tiled.cpp) reads: Elem is the
// cache's element type, a row of one (token, kv head) is row_elems(head_dim) of them, and widen
// points widened[i] at row i of n (<= 16) as fp32 (head_dim a multiple of 16): in buf, at
// buf + i * dim, or (float32) the row itself, with the factor each row's score and weight are
// multiplied by in scales[i] when kScaled.
template <KvQuant F>
struct QuantizedRows {
  using Elem = uint8_t;
  static constexpr bool kScaled = true;
  static int64_t row_elems(int64_t dim) { return dim + kKvScaleBytes; }
  static void widen(const Elem* const* rows, int64_t n, int64_t dim, float* buf, float* scales,
                    const float** widened) {
    widen_quantized_tile<F>(rows, n, dim, buf, scales);
    for (int64_t i = 0; i < n; ++i) widened[i] = buf + i * dim;
  }
};

template <typename scalar_t>
struct FloatRows {
  using Elem = scalar_t;
  static constexpr bool kScaled = false;
  static int64_t row_elems(int64_t dim) { return dim; }
  static void widen(const Elem* const* rows, int64_t n, int64_t dim, float* buf, float*, const float** widened) {
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        widened[i] = rows[i];
      } else {
        for (int64_t d = 0; d < dim; d += 16) widen16(rows[i] + d, buf + i * dim + d);
        widened[i] = buf + i * dim;
      }
    }
  }
};

// Lane i of the result = the sum of the 8 lanes of a[i].
inline __m256 sum_lanes_8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // 128-bit halves: dims 0-3, 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The mask of lanes [0, n) of 8, for maskload/maskstore.
inline __m256i first_lanes_8(int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes);
}

// Scores of M (<= 8) widened rows b[i] for one query row q: sums[i] = q . row_i.
template <int M>
inline __m256 scores_of_8(const float* q, const float* const* b, int64_t dim) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(b[i] + d), acc[i]);
  }
  return sum_lanes_8(acc);
}

// out[i] = scales[i] * (q . row_i) for the n (<= 16) widened rows rows[i]: the row's scale is
// applied once to its score, not to each of its values. No scales (float rows): out[i] = q . row_i.
inline void quantized_tile_scores(const float* q, int64_t n, const float* const* rows, const float* scales, int64_t dim,
                                  float* out) {
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - i0);
    const float* const* b = rows + i0;
    __m256 sums;
    switch (m) {
      case 8: sums = scores_of_8<8>(q, b, dim); break;
      case 7: sums = scores_of_8<7>(q, b, dim); break;
      case 6: sums = scores_of_8<6>(q, b, dim); break;
      case 5: sums = scores_of_8<5>(q, b, dim); break;
      case 4: sums = scores_of_8<4>(q, b, dim); break;
      case 3: sums = scores_of_8<3>(q, b, dim); break;
      case 2: sums = scores_of_8<2>(q, b, dim); break;
      default: sums = scores_of_8<1>(q, b, dim); break;
    }
    const __m256i valid = first_lanes_8(m);
    _mm256_maskstore_ps(out + i0, valid, scales ? _mm256_mul_ps(sums, _mm256_maskload_ps(scales + i0, valid)) : sums);
  }
}

// acc[d0, d0 + 8 * C) += sum over rows i < n of w[i] * row_i, the C vectors of sums in registers.
template <int C>
inline void accumulate_dims(float* acc, const float* w, int64_t n, const float* const* rows, int64_t d0) {
  __m256 o[C];
  for (int c = 0; c < C; ++c) o[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 wi = _mm256_set1_ps(w[i]);
    const float* row = rows[i] + d0;
    for (int c = 0; c < C; ++c) o[c] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(row + 8 * c), o[c]);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, o[c]);
}

// acc[0, dim) += sum over the n widened rows rows[i] of w[i] * row_i (w already times each row's
// scale), 64 dims at a time.
inline void quantized_tile_accumulate(float* acc, const float* w, int64_t n, const float* const* rows, int64_t dim) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    switch (std::min<int64_t>(8, (dim - d0) / 8)) {
      case 8: accumulate_dims<8>(acc, w, n, rows, d0); break;
      case 7: accumulate_dims<7>(acc, w, n, rows, d0); break;
      case 6: accumulate_dims<6>(acc, w, n, rows, d0); break;
      case 5: accumulate_dims<5>(acc, w, n, rows, d0); break;
      case 4: accumulate_dims<4>(acc, w, n, rows, d0); break;
      case 3: accumulate_dims<3>(acc, w, n, rows, d0); break;
      case 2: accumulate_dims<2>(acc, w, n, rows, d0); break;
      default: accumulate_dims<1>(acc, w, n, rows, d0); break;
    }
  }
}

// exp(x) for 8 floats, as simd.h's exp16: x = n ln2 + r, a degree-6 polynomial for e^r, times 2^n
// (built in the exponent bits). Relative error about 2e-7.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

inline float hsum8(__m256 x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// scores[i] = exp(scores[i] - max) for i < n (n >= 1); returns their sum: a row's softmax before
// the division.
inline float softmax_numerators(float* scores, int64_t n) {
  __m256 m0 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(scores + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(scores + i + 8));
  }
  float best = -std::numeric_limits<float>::infinity();
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  for (const float lane : lanes) best = std::max(best, lane);
  for (; i < n; ++i) best = std::max(best, scores[i]);
  const __m256 shift = _mm256_set1_ps(best);
  __m256 total = _mm256_setzero_ps();
  for (i = 0; i < n; i += 8) {
    const __m256i valid = first_lanes_8(n - i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(scores + i, valid), shift));
    _mm256_maskstore_ps(scores + i, valid, e);
    total = _mm256_add_ps(total, _mm256_and_ps(e, _mm256_castsi256_ps(valid)));
  }
  return hsum8(total);
}

// decode_attention_tiled.cpp: paged decode attention over int8 or fp8 caches (checked inputs).
void paged_decode_quantized(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, double scale);

// decode_attention_tiled.cpp: the same kernel over a float cache (float32, bfloat16, float16;
// head_dim a multiple of 16, checked inputs): the float path of builds without AVX-512.
void paged_decode_float_tiled(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_lens, double scale);

// kv_quant.cpp: cache slot slots[t] of [blocks, block_size, kv_heads, head_dim + 2] = rows[t] quantized.
void store_kv_quantized(torch::Tensor rows, torch::Tensor cache, torch::Tensor slots);

}  // namespace pagecli
