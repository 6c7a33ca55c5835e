// SIMD and AMX tile helpers shared by pagecli's CPU kernels: the level macros (which of AVX-512,
// AVX512-BF16 and AMX this build has), dtype dispatch, 8-lane (AVX2) and 16-lane (AVX-512)
// loads/stores/rounding in each engine dtype, exp, lane sums, and the AMX tile configuration and moves.

#pragma once

// torch/types.h, not torch/extension.h (Python bindings and all of torch's API): bindings.cpp alone
// needs those, and each kernel file then builds in about half the time.
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGECLI_HAVE_BF16_DOT 1
#else
#define PAGECLI_HAVE_BF16_DOT 0
#endif
#if PAGECLI_HAVE_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PAGECLI_HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define PAGECLI_HAVE_AMX 0
#endif

// Runs __VA_ARGS__ (a lambda using scalar_t) for float32, bfloat16 or float16: the dtypes the
// engine runs in (ATen's stock float dispatch includes double, which load16/store16 do not take).
#define PAGECLI_DISPATCH(TYPE, NAME, ...)                                                      \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                     \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)               \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace pagecli {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

#if defined(__AVX2__) && defined(__FMA__)
// 8 values widened to float32 (float32: as they are, so sums over them are the same instructions) and stored
// back rounded to nearest-even, as c10's conversions round (bf16 NaN stays a quiet NaN): load16/store16 below
// on AVX2's 256-bit registers.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32: widen and shift left
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#else
inline __m256 load8(const c10::Half* p) {
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(wide);
}
#endif
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(c10::Half* p, __m256 v) {
#if defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  alignas(32) float wide[8];
  _mm256_store_ps(wide, v);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::Half>(wide[i]);
#endif
}
#endif

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // bf16 is the top half of an fp32: widen to 32 bits and shift left.
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Stores 16 floats rounded to nearest-even, as c10's conversions round.
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
#endif
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// x rounded to scalar_t and back: the rounding a PyTorch op in that dtype applies.
template <typename scalar_t>
inline __m512 round16(__m512 x) {
  alignas(64) scalar_t tmp[16];
  store16(tmp, x);
  return load16(tmp);
}
template <>
inline __m512 round16<float>(__m512 x) { return x; }

// exp(x) for 16 floats: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for e^r, then
// scaling by 2^n (vscalefps). Relative error about 2e-7; inputs below -87 give 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif


#if defined(__AVX512F__)
// out[t] = the sum of the 16 lanes of a[t], for t < 16: a transpose-and-add tree (four levels of
// shuffles), much cheaper than sixteen horizontal sums.
inline __m512 sum_lanes_16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of tokens 4i .. 4i+3
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // Add the four 128-bit lanes: tokens 0-7 then 8-15, then all sixteen in order.
  const __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e, f, 0x88), _mm512_shuffle_f32x4(e, f, 0xDD));
}


// The mask of lanes [0, n) of 16, n clamped to [0, 16]: the valid lanes of a row's tail.
inline __mmask16 first_lanes(int64_t n) {
  return n <= 0 ? 0 : n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}
#endif

#if PAGECLI_HAVE_AMX
// Linux hands a process AMX's tile registers only once it asks for them (arch_prctl
// ARCH_REQ_XCOMP_PERM for the XTILEDATA state component); asked once, for every thread.
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Sets this thread's eight tile registers to 16 rows of 64 bytes each (palette 1): the only shape
// pagecli's AMX kernels use.
inline void load_tile_config() {
  struct alignas(64) {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  _tile_loadconfig(&config);
}

// C[j] += A B[j] for the accumulators j < count (tiles 0-3): A in tile 4, or 5 when `a_in_5`; B[j]
// the tile at b + j * b_step, loaded into tiles 6 and 7 in turn.
inline void accumulate_tiles(int64_t count, bool a_in_5, const uint32_t* b, int64_t b_step) {
  if (a_in_5) {
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 5, 6);
    if (count > 1) { _tile_loadd(7, b + b_step, 64); _tile_dpbf16ps(1, 5, 7); }
    if (count > 2) { _tile_loadd(6, b + 2 * b_step, 64); _tile_dpbf16ps(2, 5, 6); }
    if (count > 3) { _tile_loadd(7, b + 3 * b_step, 64); _tile_dpbf16ps(3, 5, 7); }
  } else {
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (count > 1) { _tile_loadd(7, b + b_step, 64); _tile_dpbf16ps(1, 4, 7); }
    if (count > 2) { _tile_loadd(6, b + 2 * b_step, 64); _tile_dpbf16ps(2, 4, 6); }
    if (count > 3) { _tile_loadd(7, b + 3 * b_step, 64); _tile_dpbf16ps(3, 4, 7); }
  }
}

// Stores accumulators j < count (tiles 0-3) at dst + j * 16 floats, rows `stride` floats apart.
inline void store_tiles(int64_t count, float* dst, int64_t stride) {
  _tile_stored(0, dst, stride * 4);
  if (count > 1) _tile_stored(1, dst + 16, stride * 4);
  if (count > 2) _tile_stored(2, dst + 32, stride * 4);
  if (count > 3) _tile_stored(3, dst + 48, stride * 4);
}

// Loads accumulators j < count (tiles 0-3) from src + j * 16 floats, as store_tiles left them.
inline void load_tiles(int64_t count, const float* src, int64_t stride) {
  _tile_loadd(0, src, stride * 4);
  if (count > 1) _tile_loadd(1, src + 16, stride * 4);
  if (count > 2) _tile_loadd(2, src + 32, stride * 4);
  if (count > 3) _tile_loadd(3, src + 48, stride * 4);
}

inline void zero_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Column c of a stored [16, 16] fp32 tile, as 16 lanes.
inline __m512 tile_column(const float* tile, int64_t c) {
  const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  return _mm512_i32gather_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(c))), tile, 4);
}
#endif

}  // namespace pagecli
