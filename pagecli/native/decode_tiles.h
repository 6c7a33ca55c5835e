// The 16-token tiles of the AVX512-BF16 / AVX512-VNNI decode kernel (decode_attention_bf16.cpp) in
// the layouts its dot products take, for rows of 16-bit values (bf16, or int8 widened to int16).
//
// Tiles of a prefix several sequences (or a prompt's rows) share are packed once and then used by
// each of them, with the same operations on the same operands in the same order as the kernel's
// unpacked tiles, so a row's results do not depend on whether its tiles were shared.

#pragma once

#include "simd.h"

namespace pagecli {

#if defined(__AVX512F__) && defined(__AVX512BW__)
// K: kt[16 * c + w] holds, for each of the 16 keys (lanes), word w (dims 2w, 2w + 1) of the key's
// c-th 32-dim chunk: the tile transposed, 16 x 16 32-bit words per chunk.
template <int CHUNKS, typename T>
inline void pack_k_tile(const T* const* rows, __m512i* kt) {
  static_assert(sizeof(T) == 2, "rows of 16-bit values");
  for (int c = 0; c < CHUNKS; ++c) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(reinterpret_cast<const __m512i*>(rows[i]) + c);
    for (int i = 0; i < 16; i += 2) {  // per 128-bit lane k: words 4k, 4k+1 (lo) / 4k+2, 4k+3 (hi) of rows i, i+1
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int a = 0; a < 4; ++a) {  // r[4a + m], lane k: word 4k + m of rows 4a .. 4a+3
      r[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
      r[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
      r[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
      r[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int m = 0; m < 4; ++m) {  // the 128-bit lanes of r[m], r[4+m], r[8+m], r[12+m] transposed
      const __m512i v0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xEE);
      const __m512i v2 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x44), v3 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xEE);
      kt[16 * c + m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
      kt[16 * c + 4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
      kt[16 * c + 8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
      kt[16 * c + 12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
  }
}

// V: vp[(j * CHUNKS + c) * 2 + half] holds tokens 2j and 2j + 1 of the tile interleaved by 16-bit
// words, per 128-bit lane: what the tile products multiply by a pair of weights.
template <int CHUNKS, typename T>
inline void pack_v_tile(const T* const* rows, __m512i* vp) {
  static_assert(sizeof(T) == 2, "rows of 16-bit values");
  for (int j = 0; j < 8; ++j) {
    const __m512i* even = reinterpret_cast<const __m512i*>(rows[2 * j]);
    const __m512i* odd = reinterpret_cast<const __m512i*>(rows[2 * j + 1]);
    for (int c = 0; c < CHUNKS; ++c) {
      const __m512i a = _mm512_loadu_si512(even + c), b = _mm512_loadu_si512(odd + c);
      vp[(j * CHUNKS + c) * 2] = _mm512_unpacklo_epi16(a, b);
      vp[(j * CHUNKS + c) * 2 + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
}

// The weighted sums of V in dim order: per 32 dims, interleaving tokens by 16-bit words put dims 8L..8L+3 of each
// 128-bit lane L in the first vector and 8L+4..8L+7 in the second.
inline void natural_dims(const float* interleaved, float inv, c10::BFloat16* dst, int64_t dim) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < dim; d += 32) {
    const __m512 lo = _mm512_loadu_ps(interleaved + d), hi = _mm512_loadu_ps(interleaved + d + 16);
    store16(dst + d, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale));
    store16(dst + d + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale));
  }
}


// Lane i of the result = the sum of the 16 lanes of a[i], in integers (exact, in any order).
inline __m512i sum_lanes_16_epi32(const __m512i* a) {
  __m512i b[8], c[4];
  for (int i = 0; i < 8; ++i) {
    const __m512i x = a[2 * i], y = a[2 * i + 1];
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512i x = b[2 * i], y = b[2 * i + 1];
    c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
  }
  const __m512i e = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88), _mm512_shuffle_i32x4(c[0], c[1], 0xDD));
  const __m512i f = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], 0x88), _mm512_shuffle_i32x4(c[2], c[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(e, f, 0x88), _mm512_shuffle_i32x4(e, f, 0xDD));
}
#endif

}  // namespace pagecli
