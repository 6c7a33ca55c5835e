// How the AVX512-BF16 decode kernel (decode_attention_bf16.cpp) reads an int8 cache (kv_quant.h) on
// AVX512-VNNI: no widening to floats at all. A task's query rows are rounded to int16 once, each
// with a scale of its own (max |q| / 32767: an error under 1/100 of bf16's on the largest values);
// K and V rows are sign-extended from int8 to int16 in registers, and vpdpwssd sums two products
// at a time in int32. Integer sums are exact, so a tile gives the same bits whether it was packed
// for several sequences or not, in whatever order its products were summed. V: each tile's softmax
// weights (times their rows' scales) are rounded to int16 against the tile's largest, and the
// tile's int32 sums are added to the fp32 sums times that step.
//
// Overflow: |q| <= 32767 and |k| <= 127 over at most 256 dims sum to under 2^31; a V tile sums at
// most 16 products of 32767 * 127.

#pragma once

#include "decode_tiles.h"
#include "kv_quant.h"

#include <vector>

namespace pagecli {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGECLI_HAVE_INT16_DOT 1

struct Int8Cache {
  using Elem = uint8_t;
  using Row = int8_t;
  static constexpr bool kScaled = true;
  static constexpr bool kWidens = false;
  static constexpr int64_t row_elems(int64_t dim) { return dim + kKvScaleBytes; }

  template <int CHUNKS>
  static const Row* load(const Elem* row, Row*, float& scale) {
    scale = row_scale<KvQuant::kInt8>(row, 32 * CHUNKS);
    return reinterpret_cast<const Row*>(row);
  }

  // Chunk c of a row: 32 values as int16.
  static __m512i chunk(const Row* row, int c) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
  }

  struct Query {
    const int16_t* q;
    float scale;
  };

  // The int16 rows of a task's queries: row r of sequence j at (j * width + r) * dim.
  template <int CHUNKS>
  class Queries {
   public:
    void prepare(const c10::BFloat16* first, int64_t s0, int64_t s1, int64_t seqs, int64_t width) {
      constexpr int64_t D = 32 * CHUNKS;
      width_ = width;
      rows_.resize(seqs * width * D);
      scales_.resize(seqs * width);
      for (int64_t j = 0; j < seqs; ++j) {
        for (int64_t r = 0; r < width; ++r) {
          const c10::BFloat16* q = first + j * s0 + r * s1;
          __m512 top = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(q + d)));
          const float amax = _mm512_reduce_max_ps(top);
          const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
          int16_t* dst = rows_.data() + (j * width + r) * D;
          for (int64_t d = 0; d < D; d += 16) {
            const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(load16(q + d), inverse));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), _mm512_cvtepi32_epi16(rounded));
          }
          scales_[j * width + r] = amax / 32767.f;
        }
      }
    }
    Query row(int64_t j, int64_t r) const {
      return {rows_.data() + (j * width_ + r) * 32 * CHUNKS, scales_[j * width_ + r]};
    }

   private:
    std::vector<int16_t> rows_;
    std::vector<float> scales_;
    int64_t width_ = 0;
  };

  // out[i] = factor[i] * q.scale * (q . k_i) for the tile's n rows.
  template <int CHUNKS>
  static void tile_scores(const Query& q, const Row* const* rows, int64_t n, __m512 factor, float* out) {
    __m512i qv[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) qv[c] = _mm512_loadu_si512(reinterpret_cast<const __m512i*>(q.q) + c);
    __m512i acc[16];
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_setzero_si512();
      if (i < n) {
        for (int c = 0; c < CHUNKS; ++c) acc[i] = _mm512_dpwssd_epi32(acc[i], chunk(rows[i], c), qv[c]);
      }
    }
    store_scores(sum_lanes_16_epi32(acc), q.scale, factor, n, out);
  }

  template <int CHUNKS>
  static void pack_k(const Row* const* rows, __m512i* kt) {
    widened_tile<CHUNKS>(rows, [&](const int16_t* const* wide_rows) { pack_k_tile<CHUNKS>(wide_rows, kt); });
  }

  template <int CHUNKS>
  static void packed_scores(const Query& q, const __m512i* kt, __m512 factor, float* out) {
    const int32_t* words = reinterpret_cast<const int32_t*>(q.q);
    __m512i sums = _mm512_setzero_si512();
    for (int w = 0; w < 16; ++w) {
      for (int c = 0; c < CHUNKS; ++c) {
        sums = _mm512_dpwssd_epi32(sums, kt[16 * c + w], _mm512_set1_epi32(words[16 * c + w]));
      }
    }
    store_scores(sums, q.scale, factor, 16, out);
  }

  // acc += sum over the tile's tokens i < n of w[i] * v_i (w already times each row's scale), two
  // tokens per vpdpwssd, in the interleaved dim order of pack_v_tile (see natural_dims).
  template <int CHUNKS>
  static void tile_accumulate(float* acc, const float* w, const Row* const* rows, int64_t n) {
    alignas(64) uint32_t pairs[8];
    const float step = weight_pairs(w, n, pairs);
    if (step == 0.f) return;
    __m512i o[2 * CHUNKS];
    for (int c = 0; c < 2 * CHUNKS; ++c) o[c] = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 2) {
      const __m512i weight = _mm512_set1_epi32(static_cast<int>(pairs[i / 2]));
      for (int c = 0; c < CHUNKS; ++c) {
        const __m512i a = chunk(rows[i], c);
        const __m512i b = i + 1 < n ? chunk(rows[i + 1], c) : _mm512_setzero_si512();
        o[2 * c] = _mm512_dpwssd_epi32(o[2 * c], _mm512_unpacklo_epi16(a, b), weight);
        o[2 * c + 1] = _mm512_dpwssd_epi32(o[2 * c + 1], _mm512_unpackhi_epi16(a, b), weight);
      }
    }
    add_scaled<CHUNKS>(acc, o, step);
  }

  template <int CHUNKS>
  static void pack_v(const Row* const* rows, __m512i* vp) {
    widened_tile<CHUNKS>(rows, [&](const int16_t* const* wide_rows) { pack_v_tile<CHUNKS>(wide_rows, vp); });
  }

  template <int CHUNKS>
  static void packed_accumulate(float* acc, const float* w, const __m512i* vp) {
    alignas(64) uint32_t pairs[8];
    const float step = weight_pairs(w, 16, pairs);
    if (step == 0.f) return;
    __m512i o[2 * CHUNKS];
    for (int c = 0; c < 2 * CHUNKS; ++c) o[c] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i weight = _mm512_set1_epi32(static_cast<int>(pairs[j]));
      for (int c = 0; c < 2 * CHUNKS; ++c) o[c] = _mm512_dpwssd_epi32(o[c], vp[j * 2 * CHUNKS + c], weight);
    }
    add_scaled<CHUNKS>(acc, o, step);
  }

 private:
  static void store_scores(__m512i sums, float q_scale, __m512 factor, int64_t n, float* out) {
    const __m512 scores = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(q_scale)), factor);
    _mm512_mask_storeu_ps(out, first_lanes(n), scores);
  }

  // pack(wide_rows) over the tile's 16 rows sign-extended to int16 (a shared tile, packed once).
  template <int CHUNKS, typename Pack>
  static void widened_tile(const Row* const* rows, Pack&& pack) {
    alignas(64) int16_t wide[16 * 32 * CHUNKS];
    const int16_t* wide_rows[16];
    for (int i = 0; i < 16; ++i) {
      for (int c = 0; c < CHUNKS; ++c) _mm512_store_si512(wide + (i * CHUNKS + c) * 32, chunk(rows[i], c));
      wide_rows[i] = wide + i * 32 * CHUNKS;
    }
    pack(wide_rows);
  }

  // The tile's weights w[0, n) (>= 0) as int16 against their largest, packed two a word (token 2p
  // low, 2p + 1 high) into pairs; returns the value of one int16 step (0: every weight is 0).
  static float weight_pairs(const float* w, int64_t n, uint32_t* pairs) {
    const __m512 weights = _mm512_maskz_loadu_ps(first_lanes(n), w);
    const float top = _mm512_reduce_max_ps(weights);
    if (!(top > 0.f)) return 0.f;
    const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(weights, _mm512_set1_ps(32767.f / top)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), _mm512_cvtepi32_epi16(rounded));
    return top / 32767.f;
  }

  template <int CHUNKS>
  static void add_scaled(float* acc, const __m512i* o, float step) {
    const __m512 s = _mm512_set1_ps(step);
    for (int c = 0; c < 2 * CHUNKS; ++c) {
      _mm512_storeu_ps(acc + 16 * c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(o[c]), s, _mm512_loadu_ps(acc + 16 * c)));
    }
  }
};
#else
#define PAGECLI_HAVE_INT16_DOT 0
#endif

}  // namespace pagecli
