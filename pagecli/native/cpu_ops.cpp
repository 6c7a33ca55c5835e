// CPU kernels for the decode step, where PyTorch's general ops pay per-call costs that dominate
// a small model: paged decode attention over every sequence in one call, and a bf16
// matrix-vector product that streams the weights once (oneDNN's bf16 path is slower than fp32
// for a single row). Built on first use by pagecli.native (torch.utils.cpp_extension).
//
// Layouts (see pagecli/attention): cache [num_blocks, block_size, kv_heads, head_dim];
// block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "gemm_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
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

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

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

// Dot product of a float vector with a cache row.
template <typename scalar_t>
inline float dot_row(const float* q, const scalar_t* k, int64_t dim) {
  int64_t d = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  if (dim >= 16) {
    __m512 acc = _mm512_setzero_ps();
    for (; d + 16 <= dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
    total = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; d < dim; ++d) total += q[d] * to_float(k[d]);
  return total;
}

template <typename scalar_t>
inline void axpy_row(float* out, float weight, const scalar_t* v, int64_t dim) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 w = _mm512_set1_ps(weight);
  for (; d + 16 <= dim; d += 16) _mm512_storeu_ps(out + d, _mm512_fmadd_ps(w, load16(v + d), _mm512_loadu_ps(out + d)));
#endif
  for (; d < dim; ++d) out[d] += weight * to_float(v[d]);
}

// scores[g * stride] = (q_g . k_row) for the group of query heads sharing this kv head; k_row is
// read and widened once for all of them. CHUNKS = head_dim / 16 when known at compile time (the
// row then stays in registers), 0 for any head_dim.
template <int CHUNKS, typename scalar_t>
inline void group_scores(const float* q, int64_t group, const scalar_t* k_row, int64_t dim, float* scores,
                         int64_t stride) {
#if defined(__AVX512F__)
  if constexpr (CHUNKS > 0) {
    __m512 k[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) k[c] = load16(k_row + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + g * dim), k[0]);
      for (int c = 1; c < CHUNKS; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dim + 16 * c), k[c], acc);
      scores[g * stride] = _mm512_reduce_add_ps(acc);
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) scores[g * stride] = dot_row(q + g * dim, k_row, dim);
}

// acc[g] += weights[g * stride] * v_row for each query head of the group; v_row widened once.
template <int CHUNKS, typename scalar_t>
inline void group_accumulate(float* acc, int64_t group, const float* weights, int64_t stride, const scalar_t* v_row,
                             int64_t dim) {
#if defined(__AVX512F__)
  if constexpr (CHUNKS > 0) {
    __m512 v[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) v[c] = load16(v_row + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g * stride]);
      float* a = acc + g * dim;
      for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(w, v[c], _mm512_loadu_ps(a + 16 * c)));
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g) axpy_row(acc + g * dim, weights[g * stride], v_row, dim);
}

// The largest of scores[0, n) (n >= 1): four vector maxima in flight, not one scalar chain.
inline float max_of(const float* scores, int64_t n) {
  int64_t i = 0;
  float best = scores[0];
#if defined(__AVX512F__)
  if (n >= 64) {
    __m512 m[4];
    for (int j = 0; j < 4; ++j) m[j] = _mm512_loadu_ps(scores + 16 * j);
    for (i = 64; i + 64 <= n; i += 64) {
      for (int j = 0; j < 4; ++j) m[j] = _mm512_max_ps(m[j], _mm512_loadu_ps(scores + i + 16 * j));
    }
    best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
  }
#endif
  for (; i < n; ++i) best = std::max(best, scores[i]);
  return best;
}

// scores[i] = exp(scores[i] - shift) for i < n; returns their sum.
inline float exp_shifted_sum(float* scores, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + i), s));
    _mm512_storeu_ps(scores + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) {
    scores[i] = std::exp(scores[i] - shift);
    total += scores[i];
  }
  return total;
}

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

// Widens up to 16 cache rows (rows[i]: token i's row of one kv head) to fp32 in buf, D floats apart.
template <int CHUNKS, typename scalar_t>
inline void widen_tile(const scalar_t* const* rows, int64_t n, float* buf) {
  constexpr int D = CHUNKS * 16;
  for (int64_t i = 0; i < n; ++i) {
    for (int c = 0; c < CHUNKS; ++c) _mm512_store_ps(buf + i * D + 16 * c, load16(rows[i] + 16 * c));
  }
}

// The mask of lanes [0, n) of 16, n clamped to [0, 16]: the valid lanes of a row's tail.
inline __mmask16 first_lanes(int64_t n) {
  return n <= 0 ? 0 : n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}

// Scores of up to 16 widened K rows for the group's query heads: out[g * stride + i] = q_g . k_i.
template <int CHUNKS>
inline void widened_scores(const float* q, int64_t group, int64_t n, float* out, int64_t stride, const float* buf) {
  constexpr int D = CHUNKS * 16;
  const __mmask16 valid = first_lanes(n);
  for (int64_t g = 0; g < group; ++g) {
    __m512 qv[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) qv[c] = _mm512_loadu_ps(q + g * D + 16 * c);
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_setzero_ps();
      if (i < n) {
        for (int c = 0; c < CHUNKS; ++c) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_load_ps(buf + i * D + 16 * c), acc[i]);
      }
    }
    _mm512_mask_storeu_ps(out + g * stride, valid, sum_lanes_16(acc));
  }
}

// acc[g] += sum over the tile's tokens i of w[g * stride + i] * v_i, for up to 16 widened V rows.
template <int CHUNKS>
inline void widened_accumulate(float* acc, int64_t group, const float* w, int64_t stride, int64_t n, const float* buf) {
  constexpr int D = CHUNKS * 16;
  for (int64_t g = 0; g < group; ++g) {
    __m512 o[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) o[c] = _mm512_loadu_ps(acc + g * D + 16 * c);
    for (int64_t i = 0; i < n; ++i) {
      const __m512 weight = _mm512_set1_ps(w[g * stride + i]);
      for (int c = 0; c < CHUNKS; ++c) o[c] = _mm512_fmadd_ps(weight, _mm512_load_ps(buf + i * D + 16 * c), o[c]);
    }
    for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, o[c]);
  }
}
#endif

#if PAGECLI_HAVE_AMX
// Linux hands a process AMX's tile registers only once it asks for them (arch_prctl
// ARCH_REQ_XCOMP_PERM for the XTILEDATA state component); asked once, for every thread.
bool amx_granted() {
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

// The cache slot of token t of a sequence, from its block table.
inline int64_t slot_of(const int32_t* table, int64_t block_size, int64_t t) {
  return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
}

// Tokens [0, result) of every sequence lie in the same blocks (a prompt prefix they share through
// the prefix cache), rounded down to whole 16-token tiles; 0 when there is no such prefix.
inline int64_t shared_prefix_tokens(const int32_t* tables, int64_t max_blocks, const int32_t* lens, int64_t num_seqs,
                                    int64_t block_size) {
  if (num_seqs < 2) return 0;
  int64_t full_blocks = std::numeric_limits<int64_t>::max();  // blocks every context fills
  for (int64_t s = 0; s < num_seqs; ++s) full_blocks = std::min<int64_t>(full_blocks, lens[s] / block_size);
  int64_t common = 0;
  for (; common < full_blocks; ++common) {
    bool same = true;
    for (int64_t s = 1; s < num_seqs && same; ++s) same = tables[s * max_blocks + common] == tables[common];
    if (!same) break;
  }
  return common * block_size / 16 * 16;
}

// Splits items of the given costs into `parts` consecutive runs of about equal total cost, none
// empty when there are items enough; run r is items [bounds[r], bounds[r + 1]).
std::vector<int64_t> balanced_runs(const std::vector<int64_t>& costs, int64_t parts) {
  const int64_t n = static_cast<int64_t>(costs.size());
  int64_t total = 0;
  for (const int64_t c : costs) total += c;
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  int64_t done = 0, r = 1;
  for (int64_t i = 0; i < n && r < parts; ++i) {
    done += costs[i];
    if (done * parts >= total * r || n - (i + 1) == parts - r) bounds[r++] = i + 1;
  }
  return bounds;
}

// at::parallel_for over items [0, costs.size()), but each thread's range is chosen by cost, not by
// count: sequences and prompts of unequal lengths would leave one thread waiting on the other.
// fn(begin, end) runs once per non-empty range.
template <typename Fn>
void parallel_for_by_cost(const std::vector<int64_t>& costs, const Fn& fn) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), costs.size()));
  const std::vector<int64_t> bounds = balanced_runs(costs, parts);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (bounds[r] < bounds[r + 1]) fn(bounds[r], bounds[r + 1]);
    }
  });
}

// How the decode-attention kernels split a step into tasks. A task is a run of sequences
// [s_begin, s_end) and the kv heads [h0, h0 + heads_per_task):
//  - with sequences enough to keep every thread busy (at least 2 per thread), all kv heads per task,
//    so a task reads whole cache rows (every head of a token) and each block's lines are fetched
//    once: one sequence per task, or with a shared prefix one run of sequences per thread when the
//    kernel can widen the prefix of every head at once (`heads_together`, the AMX kernel);
//  - otherwise one kv head per task (a single long chat), and with a shared prefix the sequences
//    split into about 2 * threads / kv_heads runs so every thread has work.
// Runs are cut by context length, not by count, and run_for_each hands the threads tasks of about
// equal total length (a batch of prompts of 39 to 596 tokens, split by count, kept one thread
// waiting on the other).
struct DecodeTasks {
  struct Task {
    int64_t h0, s_begin, s_end;
  };
  int64_t heads_per_task, head_tasks;
  std::vector<int64_t> run_bounds;  // run r is sequences [run_bounds[r], run_bounds[r + 1])
  std::vector<int64_t> costs;       // per task: the context tokens it reads

  DecodeTasks(const int32_t* lens, int64_t seqs, int64_t kv_heads, bool shared_prefix, int64_t threads,
              bool heads_together) {
    const bool many = seqs >= 2 * threads;
    const bool whole_rows = many && (!shared_prefix || heads_together);
    heads_per_task = whole_rows ? kv_heads : 1;
    head_tasks = kv_heads / heads_per_task;
    int64_t seq_runs = seqs;
    if (shared_prefix) {
      seq_runs = whole_rows ? threads : std::min<int64_t>(seqs, std::max<int64_t>(1, (2 * threads + kv_heads - 1) / kv_heads));
    }
    const std::vector<int64_t> seq_costs(lens, lens + seqs);
    run_bounds = balanced_runs(seq_costs, seq_runs);
    for (int64_t r = 0; r < seq_runs; ++r) {
      int64_t tokens = 0;
      for (int64_t s = run_bounds[r]; s < run_bounds[r + 1]; ++s) tokens += lens[s];
      costs.insert(costs.end(), head_tasks, tokens);
    }
  }

  Task at(int64_t task) const {
    const int64_t run = task / head_tasks;
    return {task % head_tasks * heads_per_task, run_bounds[run], run_bounds[run + 1]};
  }
  // fn(begin, end) over ranges of task numbers, one per thread.
  template <typename Fn>
  void run_for_each(const Fn& fn) const { parallel_for_by_cost(costs, fn); }
};

// One query token per sequence, the `group` query heads of a kv head together: scores for the
// whole context (two passes: softmax in fp32, then the weighted sum of V), reading K and V
// straight from the blocks named by the block table.
//
// When every sequence starts with the same blocks (a shared system prompt), a task takes one kv
// head for a run of sequences and widens each tile of the shared prefix once for all of them,
// instead of once per sequence. Every query row still sees the same tiles in the same order, with
// the same arithmetic, so the results are bit-identical either way.
template <int CHUNKS, typename scalar_t>
void paged_decode_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                       const torch::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // Strides in elements (query/out rows may be views of a larger flat batch).
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t slot_stride = kv_heads * head_dim;  // one token of one block
  const float fscale = static_cast<float>(scale);

  const int64_t shared = CHUNKS > 0 ? shared_prefix_tokens(tables, max_blocks, lens, num_seqs, block_size) : 0;
  const DecodeTasks tasks(lens, num_seqs, kv_heads, shared > 0, at::get_num_threads(), false);
  const int64_t heads_per_task = tasks.heads_per_task;
  tasks.run_for_each([&](int64_t begin, int64_t end) {
    const int64_t width = heads_per_task * group;  // query heads of one sequence in a task
    std::vector<float> q_buf, acc, scores, denom;
    std::vector<int64_t> score_offset;  // where each sequence's [width, len] scores start
    int64_t tile_slots[16];
    const scalar_t* tile_rows[16];
    alignas(64) float tile_buf[16 * 16 * (CHUNKS > 0 ? CHUNKS : 1)];
    for (int64_t task = begin; task < end; ++task) {
      const auto [h0, s_begin, s_end] = tasks.at(task);
      const int64_t seqs = s_end - s_begin;
      q_buf.resize(seqs * width * head_dim);
      acc.assign(seqs * width * head_dim, 0.f);
      denom.resize(seqs * width);
      score_offset.resize(seqs + 1);
      score_offset[0] = 0;
      for (int64_t j = 0; j < seqs; ++j) score_offset[j + 1] = score_offset[j] + width * lens[s_begin + j];
      // scores[offset_j + r * len_j + t]: one contiguous row per query head, so the exp pass is vectorized.
      scores.resize(score_offset[seqs]);
      for (int64_t j = 0; j < seqs; ++j) {
        for (int64_t r = 0; r < width; ++r) {
          const scalar_t* src = q_ptr + (s_begin + j) * q_s0 + (h0 * group + r) * q_s1;
          float* dst = q_buf.data() + (j * width + r) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * fscale;
        }
      }
      // Both passes walk each context the same way: in tiles of 16 tokens from its start when the
      // head size has a vector version (visit(j, h, n, start) with tile_rows[i] = token start+i's
      // row of kv head h0+h), else token by token (visit(j, h, t, row)). The shared tiles are read
      // once for the task's sequences (through the first one's block table).
      auto for_each_tile = [&](const scalar_t* cache, auto&& visit) {
        auto load_tile = [&](const int32_t* table, int64_t start, int64_t n, int64_t h) {
          for (int64_t i = 0; i < n; ++i) tile_slots[i] = slot_of(table, block_size, start + i);
          for (int64_t i = 0; i < n; ++i) tile_rows[i] = cache + tile_slots[i] * slot_stride + (h0 + h) * head_dim;
        };
        for (int64_t start = 0; start < shared; start += 16) {
          load_tile(tables + s_begin * max_blocks, start, 16, 0);
          for (int64_t j = 0; j < seqs; ++j) visit(j, 0, 16, start, j == 0);
        }
        for (int64_t j = 0; j < seqs; ++j) {
          const int64_t len = lens[s_begin + j];
          for (int64_t start = shared; start < len; start += 16) {
            const int64_t n = std::min<int64_t>(16, len - start);
            for (int64_t h = 0; h < heads_per_task; ++h) {
              load_tile(tables + (s_begin + j) * max_blocks, start, n, h);
              visit(j, h, n, start, true);
            }
          }
        }
      };
      auto for_each_row = [&](const scalar_t* cache, auto&& visit) {
        for (int64_t j = 0; j < seqs; ++j) {
          const int32_t* table = tables + (s_begin + j) * max_blocks;
          for (int64_t t = 0; t < lens[s_begin + j]; ++t) {
            const scalar_t* row = cache + slot_of(table, block_size, t) * slot_stride + h0 * head_dim;
            for (int64_t h = 0; h < heads_per_task; ++h) visit(j, h, t, row + h * head_dim);
          }
        }
      };
      auto q_of = [&](int64_t j, int64_t h) { return q_buf.data() + (j * width + h * group) * head_dim; };
      auto scores_of = [&](int64_t j, int64_t h) {
        return scores.data() + score_offset[j] + h * group * lens[s_begin + j];
      };
      auto acc_of = [&](int64_t j, int64_t h) { return acc.data() + (j * width + h * group) * head_dim; };
#if defined(__AVX512F__)
      if constexpr (CHUNKS > 0) {
        for_each_tile(k_ptr, [&](int64_t j, int64_t h, int64_t n, int64_t start, bool fresh_tile) {
          if (fresh_tile) widen_tile<CHUNKS>(tile_rows, n, tile_buf);
          widened_scores<CHUNKS>(q_of(j, h), group, n, scores_of(j, h) + start, lens[s_begin + j], tile_buf);
        });
      } else
#endif
      {
        for_each_row(k_ptr, [&](int64_t j, int64_t h, int64_t t, const scalar_t* k_row) {
          group_scores<CHUNKS>(q_of(j, h), group, k_row, head_dim, scores_of(j, h) + t, lens[s_begin + j]);
        });
      }
      for (int64_t j = 0; j < seqs; ++j) {
        const int64_t len = lens[s_begin + j];
        for (int64_t r = 0; r < width; ++r) {
          float* row = scores.data() + score_offset[j] + r * len;
          denom[j * width + r] = exp_shifted_sum(row, len, max_of(row, len));
        }
      }
#if defined(__AVX512F__)
      if constexpr (CHUNKS > 0) {
        for_each_tile(v_ptr, [&](int64_t j, int64_t h, int64_t n, int64_t start, bool fresh_tile) {
          if (fresh_tile) widen_tile<CHUNKS>(tile_rows, n, tile_buf);
          widened_accumulate<CHUNKS>(acc_of(j, h), group, scores_of(j, h) + start, lens[s_begin + j], n, tile_buf);
        });
      } else
#endif
      {
        for_each_row(v_ptr, [&](int64_t j, int64_t h, int64_t t, const scalar_t* v_row) {
          group_accumulate<CHUNKS>(acc_of(j, h), group, scores_of(j, h) + t, lens[s_begin + j], v_row, head_dim);
        });
      }
      for (int64_t j = 0; j < seqs; ++j) {
        for (int64_t r = 0; r < width; ++r) {
          scalar_t* dst = o_ptr + (s_begin + j) * o_s0 + (h0 * group + r) * o_s1;
          const float* a = acc.data() + (j * width + r) * head_dim;
          const float inv = 1.f / denom[j * width + r];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
        }
      }
    }
  });
}

#if PAGECLI_HAVE_AMX
// Asks for `bytes` bytes, from element `offset` on, of the cache rows of tokens [t0, t0 + count) of
// a paged context to be brought into L1. A context's rows lie in blocks scattered over the pool,
// where the hardware prefetcher does not follow; without this, tile loads wait on memory (decode
// attention over 64 sequences of ~380 tokens: 83 -> 65 ms per step, 30 layers, 2 threads).
inline void prefetch_rows(const c10::BFloat16* cache, const int32_t* table, int64_t block_size, int64_t slot_stride,
                          int64_t offset, int64_t bytes, int64_t t0, int64_t count) {
  for (int64_t t = t0; t < t0 + count; ++t) {
    const char* row = reinterpret_cast<const char*>(cache + slot_of(table, block_size, t) * slot_stride + offset);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// V rows of tokens [t0, t0 + count) (count <= 32) of kv head `head`, pair-interleaved over tokens
// for the B operand of P V: dst[(b * 16 + p) * 16 + d] holds dims b*16+d of tokens t0+2p, t0+2p+1
// (low, high half); tokens past count are zero.
inline void pack_v_step(const c10::BFloat16* v_ptr, const int32_t* table, int64_t block_size, int64_t slot_stride,
                        int64_t head, int64_t dim, int64_t t0, int64_t count, uint32_t* dst) {
  const int64_t dim_blocks = dim / 16;
  for (int64_t p = 0; p < 16; ++p) {
    const int64_t t = t0 + 2 * p;
    const c10::BFloat16* even = 2 * p < count ? v_ptr + slot_of(table, block_size, t) * slot_stride + head * dim : nullptr;
    const c10::BFloat16* odd = 2 * p + 1 < count ? v_ptr + slot_of(table, block_size, t + 1) * slot_stride + head * dim : nullptr;
    for (int64_t b = 0; b < dim_blocks; ++b) {
      const __m512i lo = even ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + b * 16)))
                              : _mm512_setzero_si512();
      const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + b * 16)))
                             : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + (b * 16 + p) * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// Paged decode attention for bf16 caches on AMX tiles (head_dim a multiple of 32, up to 256; at
// most 16 query heads per kv head). The same tasks as paged_decode_impl; within a task, one query
// group (a sequence's query heads of one kv head) at a time:
//   scores = K q^T: A = 16 cache rows as they lie (their dims pair up in memory), B = the group's
//            queries pair-interleaved, one column per head; then times scale, in fp32;
//   softmax in fp32, as paged_decode_impl;
//   out    = P V:   A = the group's probabilities rounded to bf16 (a row per head, 32 tokens),
//            B = V pair-interleaved over tokens, C = [heads, 16 dims] for 4 dim blocks at a time.
// Over a shared prefix (a whole number of 32-token steps, its V packed once per task) the groups
// of as many sequences as fill the 16 columns go together: one tile product per prefix tile for
// all of them, after which each sequence goes on alone from those sums. Every output element
// sums its products in the same order whichever way it is computed, so the results are
// bit-identical to one sequence at a time.
void paged_decode_amx(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                      double scale) {
  using bf16 = c10::BFloat16;
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t k_steps = dim / 32, dim_blocks = dim / 16;
  const bf16* q_ptr = query.data_ptr<bf16>();
  const bf16* k_ptr = k_cache.data_ptr<bf16>();
  const bf16* v_ptr = v_cache.data_ptr<bf16>();
  bf16* o_ptr = out.data_ptr<bf16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t slot_stride = kv_heads * dim;
  const __m512 scale16 = _mm512_set1_ps(static_cast<float>(scale));
  const int64_t shared = shared_prefix_tokens(tables, max_blocks, lens, num_seqs, block_size) / 32 * 32;
  const DecodeTasks tasks(lens, num_seqs, kv_heads, shared > 0, at::get_num_threads(), true);
  // With blocks of a multiple of 16 tokens, a 16-token tile lies in one block: tile loads read its
  // K rows in place (rows past the context are read but their scores dropped).
  const bool k_in_place = block_size % 16 == 0;
  constexpr int64_t kPrefetchTokens = 64;  // how far ahead of its tile load a K or V row is fetched
  tasks.run_for_each([&](int64_t begin, int64_t end) {
    load_tile_config();  // 0-3: P V sums (K rows while scoring), 4: A, 5 and 7: B (6 and 7 for P V), 6: scores
    std::vector<uint32_t> shared_v;                       // [task heads][shared / 32][dim_blocks][16 token pairs][16 dims]
    std::vector<uint32_t> v_step(dim_blocks * 256);       // one 32-token step of V, same layout
    std::vector<uint32_t> q_pack(k_steps * 256, 0u);      // [k_steps][16 dim pairs][16 heads]
    std::vector<bf16> k_rows(16 * dim, bf16(0.f));        // a tile's K rows when they are not in place
    std::vector<bf16> p_rows(16 * 32, bf16(0.f));         // [16 query heads of the batch][32 tokens]
    std::vector<float> scores, denom(16);                 // scores: a row per query head of the batch
    std::vector<int64_t> row_at(17);                      // where each sequence's score rows start
    std::vector<float> batch_acc(32 * dim, 0.f);          // P V sums over the shared prefix: [16 + 16][dim]
    std::vector<float> acc(16 * 16 * dim);                // [sequence of the batch][16 rows][dim]
    alignas(64) float tile[16 * 16];
    for (int64_t task = begin; task < end; ++task) {
      const auto [h0, s_begin, s_end] = tasks.at(task);
      if (shared > 0) {
        shared_v.resize(tasks.heads_per_task * shared / 32 * dim_blocks * 256);
        for (int64_t h = 0; h < tasks.heads_per_task; ++h) {
          for (int64_t t0 = 0; t0 < shared; t0 += 32) {
            pack_v_step(v_ptr, tables + s_begin * max_blocks, block_size, slot_stride, h0 + h, dim, t0, 32,
                        shared_v.data() + (h * shared + t0) / 32 * dim_blocks * 256);
          }
        }
      }
      // A batch: `per` sequences whose query groups share the 16 columns of a B tile, so that each
      // tile of the shared prefix (K while scoring, V after) is multiplied once for all of them.
      const int64_t per = shared > 0 ? 16 / group : 1;
      for (int64_t s0 = s_begin; s0 < s_end; s0 += per) {
        const int64_t batch = std::min<int64_t>(per, s_end - s0);
        row_at[0] = 0;  // score row (j, c): scores[row_at[j] + c * lens[s0 + j] + t]
        for (int64_t j = 0; j < batch; ++j) row_at[j + 1] = row_at[j] + group * lens[s0 + j];
        scores.resize(row_at[batch]);
        for (int64_t head = h0; head < h0 + tasks.heads_per_task; ++head) {
          for (int64_t j = 0; j < batch; ++j) {  // column j * group + c: query head c of sequence j
            for (int64_t c = 0; c < group; ++c) {
              const uint32_t* q_pairs =
                  reinterpret_cast<const uint32_t*>(q_ptr + (s0 + j) * q_s0 + (head * group + c) * q_s1);
              for (int64_t i = 0; i < dim / 2; ++i) q_pack[i * 16 + j * group + c] = q_pairs[i];
            }
          }
          if (k_steps == 2) {
            _tile_loadd(5, q_pack.data(), 64);
            _tile_loadd(7, q_pack.data() + 256, 64);
          }
          // Scores of the tile of tokens [start, start + n) of sequences [j_begin, j_end) of the batch.
          auto score_tile = [&](const int32_t* table, int64_t len, int64_t start, int64_t j_begin, int64_t j_end) {
            const int64_t n = std::min<int64_t>(16, len - start);
            const int64_t ahead = start + kPrefetchTokens;
            if (ahead < len) {
              prefetch_rows(k_ptr, table, block_size, slot_stride, head * dim, dim * 2, ahead, std::min<int64_t>(16, len - ahead));
            }
            const bf16* a = k_ptr + slot_of(table, block_size, start) * slot_stride + head * dim;
            int64_t a_stride = slot_stride * 2;
            if (!k_in_place) {
              for (int64_t i = 0; i < n; ++i) {
                std::memcpy(k_rows.data() + i * dim, k_ptr + slot_of(table, block_size, start + i) * slot_stride + head * dim,
                            dim * 2);
              }
              a = k_rows.data();
              a_stride = dim * 2;
            }
            _tile_zero(6);
            if (k_steps == 2) {  // head_dim 64: the queries stay in tiles 5 and 7, loaded once per head
              _tile_loadd(0, a, a_stride);
              _tile_loadd(1, a + 32, a_stride);
              _tile_dpbf16ps(6, 0, 5);
              _tile_dpbf16ps(6, 1, 7);
            } else {
              for (int64_t ks = 0; ks < k_steps; ++ks) {
                _tile_loadd(4, a + ks * 32, a_stride);
                _tile_loadd(5, q_pack.data() + ks * 256, 64);
                _tile_dpbf16ps(6, 4, 5);
              }
            }
            _tile_stored(6, tile, 64);
            const __mmask16 valid = first_lanes(n);
            for (int64_t j = j_begin; j < j_end; ++j) {
              for (int64_t c = 0; c < group; ++c) {
                float* row = scores.data() + row_at[j] + c * lens[s0 + j];
                _mm512_mask_storeu_ps(row + start, valid, _mm512_mul_ps(tile_column(tile, j * group + c), scale16));
              }
            }
          };
          for (int64_t start = 0; start < shared; start += 16) score_tile(tables + s0 * max_blocks, shared, start, 0, batch);
          for (int64_t j = 0; j < batch; ++j) {
            for (int64_t start = shared; start < lens[s0 + j]; start += 16) {
              score_tile(tables + (s0 + j) * max_blocks, lens[s0 + j], start, j, j + 1);
            }
          }
          for (int64_t j = 0; j < batch; ++j) {
            for (int64_t c = 0; c < group; ++c) {
              float* row = scores.data() + row_at[j] + c * lens[s0 + j];
              denom[j * group + c] = exp_shifted_sum(row, lens[s0 + j], max_of(row, lens[s0 + j]));
            }
          }
          // P V for the 32 tokens from t0 of sequences [j_begin, j_end) (P row r - first_row is
          // query head c of sequence j, r = j * group + c), with V packed at vb, into tiles 0-3.
          auto weigh_step = [&](const uint32_t* vb, int64_t t0, int64_t b0, int64_t blocks, int64_t j_begin,
                                int64_t j_end, int64_t first_row) {
            for (int64_t j = j_begin; j < j_end; ++j) {
              const int64_t len = lens[s0 + j], count = std::min<int64_t>(32, len - t0);
              const __mmask16 lo = first_lanes(count), hi = first_lanes(count - 16);
              for (int64_t c = 0; c < group; ++c) {
                const float* p = scores.data() + row_at[j] + c * len + t0;
                bf16* dst = p_rows.data() + (j * group + c - first_row) * 32;
                store16(dst, _mm512_maskz_loadu_ps(lo, p));
                store16(dst + 16, _mm512_maskz_loadu_ps(hi, p + 16));
              }
            }
            _tile_loadd(4, p_rows.data(), 64);
            accumulate_tiles(blocks, false, vb + b0 * 256, 256);
          };
          for (int64_t b0 = 0; b0 < dim_blocks; b0 += 4) {
            const int64_t blocks = std::min<int64_t>(4, dim_blocks - b0);
            zero_tiles();
            if (shared > 0) {  // the shared steps for the whole batch; each sequence's rows go on from these sums
              for (int64_t t0 = 0; t0 < shared; t0 += 32) {
                weigh_step(shared_v.data() + ((head - h0) * shared + t0) / 32 * dim_blocks * 256, t0, b0, blocks, 0,
                           batch, 0);
              }
              store_tiles(blocks, batch_acc.data() + b0 * 16, dim);
            }
            for (int64_t j = 0; j < batch; ++j) {
              const int32_t* table = tables + (s0 + j) * max_blocks;
              const int64_t len = lens[s0 + j];
              if (shared > 0) load_tiles(blocks, batch_acc.data() + j * group * dim + b0 * 16, dim);
              for (int64_t t0 = shared; t0 < len; t0 += 32) {
                const int64_t ahead = t0 + kPrefetchTokens;
                if (b0 == 0 && ahead < len) {
                  prefetch_rows(v_ptr, table, block_size, slot_stride, head * dim, dim * 2, ahead,
                                std::min<int64_t>(32, len - ahead));
                }
                pack_v_step(v_ptr, table, block_size, slot_stride, head, dim, t0, std::min<int64_t>(32, len - t0),
                            v_step.data());
                weigh_step(v_step.data(), t0, b0, blocks, j, j + 1, j * group);
              }
              store_tiles(blocks, acc.data() + j * 16 * dim + b0 * 16, dim);
            }
          }
          for (int64_t j = 0; j < batch; ++j) {
            for (int64_t c = 0; c < group; ++c) {
              bf16* dst = o_ptr + (s0 + j) * o_s0 + (head * group + c) * o_s1;
              const __m512 inv = _mm512_set1_ps(1.f / denom[j * group + c]);
              const float* sums = acc.data() + (j * 16 + c) * dim;
              for (int64_t d = 0; d < dim; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(sums + d), inv));
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

// Common head sizes get a version whose K/V rows stay in registers.
template <typename scalar_t>
void paged_decode_for_dim(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& seq_lens, double scale) {
#if PAGECLI_HAVE_AMX
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const int64_t dim = query.size(2);
    if (dim % 32 == 0 && dim <= 256 && query.size(1) / k_cache.size(2) <= 16 && amx_granted()) {
      return paged_decode_amx(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    }
  }
#endif
  switch (query.size(2)) {
    case 64: return paged_decode_impl<4, scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 80: return paged_decode_impl<5, scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 96: return paged_decode_impl<6, scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 128: return paged_decode_impl<8, scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    default: return paged_decode_impl<0, scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  }
}

// The inputs both paged-attention entry points take: query and out [tokens, heads, head_dim] with
// contiguous rows, K/V caches [num_blocks, block_size, kv_heads, head_dim] of their dtype, and
// int32 block tables and lengths for num_seqs sequences.
void check_paged_inputs(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                        int64_t num_seqs) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out rows must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, out and cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) >= num_seqs,
              "block_tables must be contiguous int32 with a row per sequence");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() && seq_lens.size(0) >= num_seqs,
              "seq_lens must be contiguous int32 with an entry per sequence");
}

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  check_paged_inputs(out, query, k_cache, v_cache, block_tables, seq_lens, query.size(0));
  PAGECLI_DISPATCH(query.scalar_type(), "paged_decode_attention", [&] {
    paged_decode_for_dim<scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}

#if PAGECLI_HAVE_AMX
// Runs work(i) for items [0, costs.size()) on the thread pool in runs of about equal cost, each
// thread's tile registers configured for the AMX kernels.
template <typename Work>
void parallel_by_cost_with_tiles(const std::vector<int64_t>& costs, const Work& work) {
  parallel_for_by_cost(costs, [&](int64_t begin, int64_t end) {
    load_tile_config();
    for (int64_t i = begin; i < end; ++i) work(i);
    _tile_release();
  });
}

// K rows of tokens [t0, t0 + 16) of kv head `head` (rows at or past `len` zero), transposed for the
// B operand of Q K^T: dst[ks * 256 + p * 16 + n] holds dims ks*32 + 2p and 2p+1 of token t0 + n.
inline void pack_k_block(const c10::BFloat16* k_ptr, const int32_t* table, int64_t block_size, int64_t slot_stride,
                         int64_t head, int64_t dim, int64_t t0, int64_t len, uint32_t* dst) {
  alignas(64) float rows[16 * 16];  // 16 rows of 16 dim pairs, moved as 32-bit cells
  for (int64_t ks = 0; ks < dim / 32; ++ks) {
    for (int64_t n = 0; n < 16; ++n) {
      const __m512 row = t0 + n < len ? _mm512_loadu_ps(k_ptr + slot_of(table, block_size, t0 + n) * slot_stride +
                                                        head * dim + ks * 32)
                                      : _mm512_setzero_ps();
      _mm512_store_ps(rows + n * 16, row);
    }
    for (int64_t p = 0; p < 16; ++p) _mm512_storeu_ps(reinterpret_cast<float*>(dst + ks * 256 + p * 16), tile_column(rows, p));
  }
}

// Whether paged_prefill_attention takes these inputs (else the caller uses PyTorch's attention).
bool paged_prefill_supported(const torch::Tensor& query, const torch::Tensor& k_cache) {
  const int64_t dim = query.size(-1);
  return amx_granted() && query.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 &&
         dim % 32 == 0 && dim <= 256;
}

// Causal attention for the new tokens of prefilling sequences (a prompt, or a chunk of one after
// the tokens already cached), reading K and V from the blocks named by each block table, on AMX
// tiles for bf16 caches. Sequence s owns query rows [query_start[s], query_start[s + 1]) (offsets
// into the step's flat batch, minus query_start[0]); they are its last tokens, so row r of n sees
// keys [0, seq_len - n + r].
//
// First each (sequence, kv head)'s K is packed transposed (16 keys x 32 dims per tile) and its V
// pair-interleaved over keys, as paged_decode_amx packs V. Then for each query head and block of 16
// query rows, the same two passes as paged_decode_amx: scores = Q K^T in fp32 (A = the query rows
// as they lie), times scale, softmax over each row's keys, then P V with P rounded to bf16, in
// 32-key steps from key 0. Every output row sums the same products in the same order as the decode
// kernel for that token, so a prompt's last row equals what decoding that token gives, and chunking
// a prompt differently changes no bits.
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start,
                             double scale) {
  using bf16 = c10::BFloat16;
  TORCH_CHECK(paged_prefill_supported(query, k_cache), "paged_prefill_attention needs AMX, bf16 and a head size of 32-256 by 32");
  TORCH_CHECK(query.dim() == 3 && out.scalar_type() == query.scalar_type(),
              "query and out must be bf16 [num_tokens, heads, head_dim]");
  const int64_t num_seqs = seq_lens.size(0);
  check_paged_inputs(out, query, k_cache, v_cache, block_tables, seq_lens, num_seqs);
  TORCH_CHECK(query_start.scalar_type() == torch::kInt32 && query_start.is_contiguous() &&
                  query_start.size(0) == num_seqs + 1,
              "query_start must be contiguous int32 with num_seqs + 1 entries");
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[num_seqs] - starts[0] == query.size(0), "query_start does not span the query rows");
  const int64_t max_blocks = block_tables.size(1), block_size = k_cache.size(1);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = starts[s + 1] - starts[s];
    TORCH_CHECK(n >= 1 && n <= lens[s] && lens[s] <= max_blocks * block_size,
                "each sequence needs 1..seq_len query rows and a block table covering seq_len");
  }

  const int64_t num_heads = query.size(1), dim = query.size(2), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads, k_steps = dim / 32, dim_blocks = dim / 16;
  const int64_t slot_stride = kv_heads * dim;
  const bf16* q_ptr = query.data_ptr<bf16>();
  const bf16* k_ptr = k_cache.data_ptr<bf16>();
  const bf16* v_ptr = v_cache.data_ptr<bf16>();
  bf16* o_ptr = out.data_ptr<bf16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);

  // Packed K and V of each (sequence, kv head): K in [16-key block][k_steps][16 pairs][16 keys],
  // V in [32-key step][dim_blocks][16 key pairs][16 dims] 32-bit cells.
  std::vector<int64_t> k_at(num_seqs * kv_heads + 1, 0), v_at(num_seqs * kv_heads + 1, 0);
  for (int64_t i = 0; i < num_seqs * kv_heads; ++i) {
    const int64_t len = lens[i / kv_heads];
    k_at[i + 1] = k_at[i] + (len + 15) / 16 * 16 * dim / 2;
    v_at[i + 1] = v_at[i] + (len + 31) / 32 * 32 * dim / 2;
  }
  std::vector<uint32_t> k_packed(k_at.back()), v_packed(v_at.back());
  std::vector<int64_t> costs(num_seqs * kv_heads);
  for (int64_t i = 0; i < num_seqs * kv_heads; ++i) costs[i] = lens[i / kv_heads];
  parallel_by_cost_with_tiles(costs, [&](int64_t i) {
    const int64_t s = i / kv_heads, head = i % kv_heads, len = lens[s];
    const int32_t* table = tables + s * max_blocks;
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
      pack_k_block(k_ptr, table, block_size, slot_stride, head, dim, t0, len, k_packed.data() + k_at[i] + t0 * dim / 2);
    }
    for (int64_t t0 = 0; t0 < len; t0 += 32) {
      pack_v_step(v_ptr, table, block_size, slot_stride, head, dim, t0, std::min<int64_t>(32, len - t0),
                  v_packed.data() + v_at[i] + t0 * dim / 2);
    }
  });

  // Work items: (sequence, query head, block of 16 query rows), costing the keys the block sees.
  struct Item {
    int64_t s, head, r0;
  };
  std::vector<Item> items;
  costs.clear();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = starts[s + 1] - starts[s];
    for (int64_t head = 0; head < num_heads; ++head) {
      for (int64_t r0 = 0; r0 < n; r0 += 16) {
        items.push_back({s, head, r0});
        costs.push_back(lens[s] - n + std::min<int64_t>(n, r0 + 16));
      }
    }
  }
  const __m512 scale16 = _mm512_set1_ps(static_cast<float>(scale));
  parallel_by_cost_with_tiles(costs, [&](int64_t item) {
    const auto [s, head, r0] = items[item];
    const int64_t n = starts[s + 1] - starts[s], rows = std::min<int64_t>(16, n - r0);
    const int64_t first_pos = lens[s] - n + r0;  // the block's first row is this token of the context
    const int64_t keys = first_pos + rows;       // keys its last row sees
    const int64_t score_stride = (keys + 63) / 64 * 64, p_stride = (keys + 31) / 32 * 32;
    const int64_t kv = s * kv_heads + head / group;
    const uint32_t* kp = k_packed.data() + k_at[kv];
    const uint32_t* vp = v_packed.data() + v_at[kv];
    thread_local std::vector<float> scores, acc;
    thread_local std::vector<bf16> q_rows, p_rows;
    scores.resize(16 * score_stride);
    p_rows.resize(16 * p_stride);
    acc.resize(16 * dim);
    const bf16* a = q_ptr + (starts[s] - starts[0] + r0) * q_s0 + head * q_s1;
    int64_t a_stride = q_s0 * 2;
    if (rows < 16) {  // a tile load reads 16 rows: the last block's go through a zero-padded copy
      q_rows.assign(16 * dim, bf16(0.f));
      for (int64_t r = 0; r < rows; ++r) std::memcpy(q_rows.data() + r * dim, a + r * q_s0, dim * 2);
      a = q_rows.data();
      a_stride = dim * 2;
    }
    // scores = Q K^T, 64 keys (4 accumulators) at a time; with head size 64 the queries stay in tiles 4-5.
    if (k_steps == 2) {
      _tile_loadd(4, a, a_stride);
      _tile_loadd(5, a + 32, a_stride);
    }
    const int64_t key_blocks = (keys + 15) / 16;
    for (int64_t kb0 = 0; kb0 < key_blocks; kb0 += 4) {
      const int64_t count = std::min<int64_t>(4, key_blocks - kb0);
      zero_tiles();
      for (int64_t ks = 0; ks < k_steps; ++ks) {
        if (k_steps != 2) _tile_loadd(4, a + ks * 32, a_stride);
        accumulate_tiles(count, k_steps == 2 && ks == 1, kp + (kb0 * k_steps + ks) * 256, k_steps * 256);
      }
      store_tiles(count, scores.data() + kb0 * 16, score_stride);
    }
    // Softmax over each row's keys in fp32, as paged_decode_amx; P in bf16, zero past the row's keys.
    float denom[16];
    for (int64_t r = 0; r < 16; ++r) {
      bf16* p = p_rows.data() + r * p_stride;
      if (r >= rows) {
        std::fill(p, p + p_stride, bf16(0.f));
        continue;
      }
      float* row = scores.data() + r * score_stride;
      const int64_t len = first_pos + r + 1;
      for (int64_t k = 0; k < len; k += 16) {
        const __mmask16 valid = first_lanes(len - k);
        _mm512_mask_storeu_ps(row + k, valid, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, row + k), scale16));
      }
      denom[r] = exp_shifted_sum(row, len, max_of(row, len));
      for (int64_t k = 0; k < p_stride; k += 16) {
        const __mmask16 valid = first_lanes(len - k);
        store16(p + k, _mm512_maskz_loadu_ps(valid, row + k));
      }
    }
    // out = P V, 4 blocks of 16 dims at a time, over 32-key steps from key 0.
    for (int64_t b0 = 0; b0 < dim_blocks; b0 += 4) {
      const int64_t count = std::min<int64_t>(4, dim_blocks - b0);
      zero_tiles();
      for (int64_t t0 = 0; t0 < keys; t0 += 32) {
        _tile_loadd(4, p_rows.data() + t0, p_stride * 2);
        accumulate_tiles(count, false, vp + (t0 / 32 * dim_blocks + b0) * 256, 256);
      }
      store_tiles(count, acc.data() + b0 * 16, dim);
    }
    for (int64_t r = 0; r < rows; ++r) {
      bf16* dst = o_ptr + (starts[s] - starts[0] + r0 + r) * o_s0 + head * o_s1;
      const __m512 inv = _mm512_set1_ps(1.f / denom[r]);
      for (int64_t d = 0; d < dim; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * dim + d), inv));
    }
  });
}
#else
bool paged_prefill_supported(const torch::Tensor&, const torch::Tensor&) { return false; }
void paged_prefill_attention(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                             torch::Tensor, double) {
  TORCH_CHECK(false, "paged_prefill_attention needs AMX, which this build lacks");
}
#endif

#if PAGECLI_HAVE_BF16_DOT
// Sum of x[k] * w[k] for bf16 rows of length dim, in fp32 (vdpbf16ps, 32 products per step).
inline __m512 bf16_dot_step(__m512 acc, const c10::BFloat16* x, const c10::BFloat16* w, __mmask32 mask) {
  const __m512i xv = _mm512_maskz_loadu_epi16(mask, x);
  const __m512i wv = _mm512_maskz_loadu_epi16(mask, w);
  return _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)wv);
}

// Software prefetch of a contiguous stream, a fixed distance ahead of where it is read: each
// advance() asks for the next 64-byte line, one per line consumed, so the distance holds. A thread
// of the rows kernel reads its weight rows as one contiguous run; the hardware prefetcher alone, or
// prefetching each row's line of the next 4-row tile (a few KB ahead, in four streams), left a
// Zen 4 core at about half its read bandwidth: SmolLM2's 269 MB in 12 ms (22 GB/s) against 6.2 ms
// for a plain read (43.6 GB/s, 2 threads); 16 KB ahead on the one stream: 7.0 ms (38.5 GB/s).
struct StreamPrefetch {
  static constexpr int64_t kAheadBytes = 16384;
  const char* next;
  const char* end;
  StreamPrefetch(const void* begin, const void* stop)
      : next(static_cast<const char*>(begin) + kAheadBytes), end(static_cast<const char*>(stop)) {}
  inline void advance() {
    if (next < end) {
      _mm_prefetch(next, _MM_HINT_T0);
      next += 64;
    }
  }
};
#endif

// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for a few rows M: each weight row is read once for all
// M rows, four weight rows at a time, with the rows split across threads.
torch::Tensor linear_bf16_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#if PAGECLI_HAVE_BF16_DOT
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kBFloat16).contiguous();
    bp = b.data_ptr<c10::BFloat16>();
  }
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - full)) - 1);
  constexpr int64_t R = 4;  // weight rows per inner step
  auto store = [&](int64_t m, int64_t n, float v) {
    if (bp) v += static_cast<float>(bp[n]);
    yp[m * N + n] = static_cast<c10::BFloat16>(v);
  };
  // More rows: blocks of 4 x rows against the tile's 4 weight rows, 16 accumulators summed by one
  // transpose-add tree. The tile stays in L1 across the row blocks, so the weights are still read
  // from memory once (oneDNN's bf16 matmul, which does not prefetch, takes about twice as long).
  constexpr int64_t MB = 4;
  auto rows_blocks = [&](int64_t n0, int64_t rows, StreamPrefetch& ahead) {
    const c10::BFloat16* wr[R];
    for (int64_t r = 0; r < R; ++r) wr[r] = wp + (n0 + std::min(r, rows - 1)) * K;  // spare lanes repeat a row
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t m_rows = std::min(MB, M - m0);
      const c10::BFloat16* xr[MB];
      for (int64_t i = 0; i < MB; ++i) xr[i] = xp + (m0 + std::min(i, m_rows - 1)) * K;
      __m512 acc[MB * R];
      for (auto& a : acc) a = _mm512_setzero_ps();
      auto step = [&](int64_t k, __mmask32 mask) {
        __m512i wv[R];
        for (int64_t r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi16(mask, wr[r] + k);
        for (int64_t i = 0; i < MB; ++i) {
          const __m512i xv = _mm512_maskz_loadu_epi16(mask, xr[i] + k);
          for (int64_t r = 0; r < R; ++r) acc[i * R + r] = _mm512_dpbf16_ps(acc[i * R + r], (__m512bh)xv, (__m512bh)wv[r]);
        }
      };
      for (int64_t k = 0; k < full; k += 32) {
        if (m0 == 0) {
          for (int64_t r = 0; r < R; ++r) ahead.advance();
        }
        step(k, 0xFFFFFFFFu);
      }
      if (tail) step(full, tail);
      alignas(64) float sums[MB * R];
      _mm512_store_ps(sums, sum_lanes_16(acc));
      for (int64_t i = 0; i < m_rows; ++i) {
        for (int64_t r = 0; r < rows; ++r) store(m0 + i, n0 + r, sums[i * R + r]);
      }
    }
  };
  at::parallel_for(0, (N + R - 1) / R, 16, [&](int64_t begin, int64_t end) {
    // This thread's weight rows, [begin * R, end * R), lie in one contiguous run.
    StreamPrefetch ahead(wp + begin * R * K, wp + std::min(end * R, N) * K);
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t n0 = tile * R;
      const int64_t rows = std::min<int64_t>(R, N - n0);
      if (M > 2) {
        rows_blocks(n0, rows, ahead);
        continue;
      }
      for (int64_t m = 0; m < M; ++m) {
        const c10::BFloat16* xr = xp + m * K;
        __m512 acc[R] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t k = 0; k < full; k += 32) {
          for (int64_t r = 0; r < rows; ++r) {
            if (m == 0) ahead.advance();
            acc[r] = bf16_dot_step(acc[r], xr + k, wp + (n0 + r) * K + k, 0xFFFFFFFFu);
          }
        }
        if (tail) {
          for (int64_t r = 0; r < rows; ++r) acc[r] = bf16_dot_step(acc[r], xr + full, wp + (n0 + r) * K + full, tail);
        }
        for (int64_t r = 0; r < rows; ++r) store(m, n0 + r, _mm512_reduce_add_ps(acc[r]));
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear_bf16_rows needs AVX512-BF16, which this build lacks");
#endif
}

#if PAGECLI_HAVE_AMX
// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) on AMX tiles; K a multiple of 32, N of 16.
// The weights are the A operand just as they lie in memory (a tile: 16 weight rows x 32 k), so
// they are streamed once and never repacked; x goes once per call into the B operand's
// pair-interleaved layout (16 k pairs x 16 rows x 2). A tile product then gives 16 outputs for
// 16 rows of x. oneDNN's bf16 matmul (also on AMX here) takes about twice as long for up to 32
// rows, which fits it reordering the weights into its own layout on every call; for these rows
// the results are bit-identical to it (both sum over k in the same order, in fp32).
// Tiles: 0-3 accumulate 4 blocks of 16 rows of x, 4 holds the weights, 5-6 x (alternating).
torch::Tensor linear_bf16_amx(torch::Tensor x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(amx_granted(), "the kernel did not grant this process AMX tiles");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(w.is_contiguous() && w.size(1) % 32 == 0 && w.size(0) % 16 == 0,
              "w must be contiguous, its rows a multiple of 32 long and their number a multiple of 16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t k_steps = K / 32, m_blocks = (M + 15) / 16;
  // x^T, pair-interleaved: [k_steps, m_blocks, 16 k pairs, 16 rows] of 32-bit (2 x bf16) cells,
  // rows past M zero.
  auto packed = torch::empty({k_steps, m_blocks, 16, 16}, x.options().dtype(torch::kInt32));
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  uint32_t* pk = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  for (int64_t ks = 0; ks < k_steps; ++ks) {
    for (int64_t mb = 0; mb < m_blocks; ++mb) {
      uint32_t* tile = pk + (ks * m_blocks + mb) * 256;
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t m = mb * 16 + c;
        for (int64_t kp = 0; kp < 16; ++kp) tile[kp * 16 + c] = m < M ? x_pairs[m * (K / 2) + ks * 16 + kp] : 0u;
      }
    }
  }
  auto y = torch::empty({M, N}, x.options());
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const char* w_end = reinterpret_cast<const char*>(wp + N * K);
  constexpr int64_t kAhead = 4;  // k steps between a weight line's prefetch and its tile load
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    alignas(64) float out[16 * 16];  // [16 weight rows, 16 rows of x]
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * 16;
      const c10::BFloat16* a = wp + n0 * K;
      for (int64_t mb0 = 0; mb0 < m_blocks; mb0 += 4) {
        const int64_t mbs = std::min<int64_t>(4, m_blocks - mb0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < k_steps; ++ks) {
          if (mb0 == 0) {
            // The hardware prefetcher alone leaves a core well short of its read bandwidth on
            // 16 strided rows; fetch each row's line kAhead steps on (the next block's near the end).
            for (int64_t r = 0; r < 16; ++r) {
              const int64_t ahead = ks + kAhead;
              const c10::BFloat16* line = ahead < k_steps ? a + r * K + ahead * 32 : a + (16 + r) * K + (ahead - k_steps) * 32;
              if (reinterpret_cast<const char*>(line) < w_end) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
            }
          }
          _tile_loadd(4, a + ks * 32, K * 2);
          const uint32_t* xt = pk + (ks * m_blocks + mb0) * 256;
          _tile_loadd(5, xt, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (mbs > 1) {
            _tile_loadd(6, xt + 256, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (mbs > 2) {
            _tile_loadd(5, xt + 512, 64);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (mbs > 3) {
            _tile_loadd(6, xt + 768, 64);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        const __m512 bias16 = bp ? _mm512_loadu_ps(bp + n0) : _mm512_setzero_ps();
        for (int64_t j = 0; j < mbs; ++j) {
          switch (j) {  // tile numbers must be constants
            case 0: _tile_stored(0, out, 64); break;
            case 1: _tile_stored(1, out, 64); break;
            case 2: _tile_stored(2, out, 64); break;
            default: _tile_stored(3, out, 64); break;
          }
          const int64_t first = (mb0 + j) * 16, count = std::min<int64_t>(16, M - first);
          for (int64_t c = 0; c < count; ++c) {  // column c of out: row first + c of y
            store16(yp + (first + c) * N + n0, _mm512_add_ps(tile_column(out, c), bias16));
          }
        }
      }
    }
    _tile_release();
  });
  return y;
}
#endif

bool has_amx() {
#if PAGECLI_HAVE_AMX
  return amx_granted();
#else
  return false;
#endif
}

// Up to this many rows, the AVX512-BF16 rows kernel beats oneDNN's bf16 matmul, which costs about
// the same for 1 row as for 16 (docs/BENCHMARKS.md, "CPU kernels"): SmolLM2's weights for 1-4 rows
// take 11-14 ms with the kernel, 21-24 ms with oneDNN; at 8 rows they tie.
constexpr int64_t kRowsKernelMaxRows = 4;
// Up to this many rows, AMX tiles over the weights as they lie beat oneDNN (docs/BENCHMARKS.md).
constexpr int64_t kAmxMaxRows = 128;

// The bf16 product x [M, K] @ w[N, K]^T (+ bias) the engine uses, by shape and CPU: AMX tiles,
// else the rows kernel for a few rows, else at::linear (oneDNN; also every other dtype).
torch::Tensor native_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  const bool bf16 = x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 &&
                    w.is_contiguous();
#if PAGECLI_HAVE_AMX
  if (bf16 && x.size(0) <= kAmxMaxRows && w.size(1) % 32 == 0 && w.size(0) % 16 == 0 && amx_granted()) {
    return linear_bf16_amx(x, w, bias);
  }
#endif
  if (PAGECLI_HAVE_BF16_DOT && bf16 && x.size(0) <= kRowsKernelMaxRows) return linear_bf16_rows(x, w, bias);
  return at::linear(x, w, bias);
}

// ---- Elementwise steps of a decoder layer, fused so each is one pass and one call -----------------
// Each computes in fp32 and rounds where the PyTorch layers (pagecli/models/layers.py) round, so
// float32 results match them to rounding and bf16 ones round at the same points.

template <typename scalar_t>
inline scalar_t round_to(float x) { return static_cast<scalar_t>(x); }

// h += delta (when given, rounded to h's dtype), then returns weight * rms_norm(h).
template <typename scalar_t>
void add_rms_norm_impl(torch::Tensor& h, const torch::Tensor* delta, const torch::Tensor& weight, torch::Tensor& out,
                       double eps) {
  const int64_t rows = h.size(0), dim = h.size(1);
  scalar_t* hp = h.data_ptr<scalar_t>();
  const scalar_t* dp = delta ? delta->data_ptr<scalar_t>() : nullptr;
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* hr = hp + r * dim;
      const scalar_t* dr = dp ? dp + r * dim : nullptr;
      int64_t d = 0;
      float sum_sq = 0.f;
#if defined(__AVX512F__)
      __m512 sq = _mm512_setzero_ps();
      for (; d + 16 <= dim; d += 16) {
        __m512 v = load16(hr + d);
        if (dr) {
          v = round16<scalar_t>(_mm512_add_ps(v, load16(dr + d)));
          store16(hr + d, v);
        }
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      sum_sq = _mm512_reduce_add_ps(sq);
#endif
      for (; d < dim; ++d) {
        if (dr) hr[d] = round_to<scalar_t>(to_float(hr[d]) + to_float(dr[d]));
        const float v = to_float(hr[d]);
        sum_sq += v * v;
      }
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + static_cast<float>(eps));
      scalar_t* orow = op + r * dim;
      d = 0;
#if defined(__AVX512F__)
      const __m512 inv16 = _mm512_set1_ps(inv);
      for (; d + 16 <= dim; d += 16) {
        const __m512 normed = round16<scalar_t>(_mm512_mul_ps(load16(hr + d), inv16));
        store16(orow + d, _mm512_mul_ps(load16(wp + d), normed));
      }
#endif
      for (; d < dim; ++d) {
        const float normed = to_float(round_to<scalar_t>(to_float(hr[d]) * inv));
        orow[d] = round_to<scalar_t>(to_float(wp[d]) * normed);
      }
    }
  });
}

torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [rows, dim] tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1) && weight.scalar_type() == h.scalar_type(),
              "weight must be [dim] in h's dtype");
  const torch::Tensor* d = nullptr;
  torch::Tensor delta_c;
  if (delta.has_value() && delta->defined()) {
    delta_c = delta->contiguous();
    TORCH_CHECK(delta_c.sizes() == h.sizes() && delta_c.scalar_type() == h.scalar_type(), "delta must match h");
    d = &delta_c;
  }
  auto out = torch::empty_like(h);
  PAGECLI_DISPATCH(h.scalar_type(), "add_rms_norm", [&] { add_rms_norm_impl<scalar_t>(h, d, weight, out, eps); });
  return out;
}

// Rotary embedding in place on x [tokens, heads, head_dim] (rows may be strided views of the qkv
// output): the rotate-half layout, x * cos + rotate_half(x) * sin with fp32 tables.
template <typename scalar_t>
void rotary_impl(torch::Tensor& x, const int64_t* pos, const float* cos, const float* sin, int64_t table_dim) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  scalar_t* xp = x.data_ptr<scalar_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(dim);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * table_dim;
      const float* s = sin + pos[t] * table_dim;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* row = xp + t * s0 + h * s1;
        for (int64_t d = 0; d < dim; ++d) tmp[d] = to_float(row[d]);
        for (int64_t d = 0; d < half; ++d) {
          const float a = tmp[d] * c[d], b = -tmp[d + half] * s[d];
          row[d] = round_to<scalar_t>(a + b);
        }
        for (int64_t d = half; d < dim; ++d) {
          const float a = tmp[d] * c[d], b = tmp[d - half] * s[d];
          row[d] = round_to<scalar_t>(a + b);
        }
      }
    }
  });
}

void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with contiguous rows");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be contiguous int64, one per token");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == x.size(2),
              "cos and sin must be contiguous float32 [positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  PAGECLI_DISPATCH(x.scalar_type(), "rotary_", [&] {
    rotary_impl<scalar_t>(x, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1));
  });
}

// silu(gate) * up for gate_up [rows, 2 * inter] = [gate | up]; returns [rows, inter].
template <typename scalar_t>
void silu_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = out.size(0), inter = out.size(1);
  const scalar_t* gp = gate_up.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gp + r * 2 * inter;
      const scalar_t* u = g + inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= inter; i += 16) {
        const __m512 x = load16(g + i);
        const __m512 one = _mm512_set1_ps(1.f);
        const __m512 silu = round16<scalar_t>(_mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        store16(op + r * inter + i, _mm512_mul_ps(silu, load16(u + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float x = to_float(g[i]);
        const float silu = to_float(round_to<scalar_t>(x / (1.f + std::exp(-x))));
        op[r * inter + i] = round_to<scalar_t>(silu * to_float(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [rows, 2 * intermediate] tensor");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  PAGECLI_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] { silu_mul_impl<scalar_t>(gate_up, out); });
  return out;
}

bool has_bf16_linear() { return PAGECLI_HAVE_BF16_DOT; }

// ---- A whole decode step in one call ------------------------------------------------------------
// CausalLM.forward in Python makes about fifteen small calls per layer. For one chat stream that
// is a few ms of interpreter and dispatch per token, and the pauses let the second OpenMP thread
// go to sleep between products. DecodeStep runs the same layer, kernel for kernel and in the same
// order (so its results are bit-identical to the Python loop), for steps where every sequence
// decodes one token. Weights are held by reference, as CausalLM.use_cpu_ops found them.

// RMSNorm.forward of pagecli.models.layers, op for op (q/k norms of Qwen3).
torch::Tensor rms_norm_like_torch(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto x32 = x.to(torch::kFloat);
  x32 = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * x32.to(x.scalar_type());
}

class DecodeStep {
 public:
  // Per layer, in this order (None where the model has no such tensor): input norm, qkv weight, qkv
  // bias, q norm, k norm, o weight, o bias, post-attention norm, gate_up weight, gate_up bias, down
  // weight, down bias.
  using Layer = std::vector<c10::optional<torch::Tensor>>;

  DecodeStep(std::vector<Layer> layers, torch::Tensor final_norm, torch::Tensor cos, torch::Tensor sin,
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : layers_(std::move(layers)), final_norm_(std::move(final_norm)), cos_(std::move(cos)), sin_(std::move(sin)),
        num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    for (const auto& layer : layers_) {
      TORCH_CHECK(layer.size() == 12, "DecodeStep: each layer needs 12 entries");
      for (int i : {0, 1, 5, 7, 8, 10}) TORCH_CHECK(layer[i].has_value(), "DecodeStep: missing weight ", i);
    }
  }

  // h [rows, hidden] (the embeddings; used as the residual stream), positions [rows] int64,
  // kv_caches [layers, 2, blocks, block_size, kv_heads, head_dim], block_tables/seq_lens as for
  // paged_decode_attention, slots [rows] int64 (-1: do not store). Returns the final norm's output.
  torch::Tensor forward(torch::Tensor h, torch::Tensor positions, torch::Tensor kv_caches, torch::Tensor block_tables,
                        torch::Tensor seq_lens, torch::Tensor slots) const {
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [rows, hidden] tensor");
    TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == static_cast<int64_t>(layers_.size()) &&
                    kv_caches.is_contiguous() && kv_caches.scalar_type() == h.scalar_type(),
                "kv_caches must be contiguous [layers, 2, blocks, block_size, kv_heads, head_dim] in h's dtype");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == h.size(0),
                "slots must be contiguous int64, one per row");
    const int64_t rows = h.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    c10::optional<torch::Tensor> delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& w = layers_[i];
      auto x = add_rms_norm(h, delta, *w[0], eps_);
      auto qkv = native_linear(x, *w[1], w[2]);
      auto q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
      auto k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
      auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
      if (w[3].has_value()) {
        q = rms_norm_like_torch(q, *w[3], eps_);
        k = rms_norm_like_torch(k, *w[4], eps_);
      }
      rotary_(q, positions, cos_, sin_);
      rotary_(k, positions, cos_, sin_);
      auto k_cache = kv_caches.select(0, i).select(0, 0);
      auto v_cache = kv_caches.select(0, i).select(0, 1);
      store_rows(k, k_cache, slots);
      store_rows(v, v_cache, slots);
      auto attn = torch::empty({rows, num_heads_, head_dim_}, h.options());
      paged_decode_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, scale_);
      delta = native_linear(attn.view({rows, q_size}), *w[5], w[6]);
      x = add_rms_norm(h, delta, *w[7], eps_);
      auto gate_up = native_linear(x, *w[8], w[9]);
      delta = native_linear(silu_mul(gate_up), *w[10], w[11]);
    }
    return add_rms_norm(h, delta, final_norm_, eps_);
  }

 private:
  // cache slot slots[t] of [blocks, block_size, kv_heads, head_dim] = rows[t] (an index_copy_).
  void store_rows(const torch::Tensor& rows, torch::Tensor& cache, const torch::Tensor& slots) const {
    TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == head_dim_, "k/v rows must be contiguous per token");
    const int64_t row_bytes = num_kv_heads_ * head_dim_ * rows.element_size();
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t num_slots = cache.size(0) * cache.size(1);
    char* base = static_cast<char*>(cache.data_ptr());
    const char* src = static_cast<const char*>(rows.data_ptr());
    for (int64_t t = 0; t < rows.size(0); ++t) {
      if (sp[t] < 0) continue;
      TORCH_CHECK(sp[t] < num_slots, "slot out of range");
      std::memcpy(base + sp[t] * row_bytes, src + t * rows.stride(0) * rows.element_size(), row_bytes);
    }
  }

  std::vector<Layer> layers_;
  torch::Tensor final_norm_, cos_, sin_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention, one query token per sequence");
  m.def("paged_prefill_attention", &paged_prefill_attention, "Causal paged attention for prefilling sequences (AMX, bf16)");
  m.def("paged_prefill_supported", &paged_prefill_supported, "Whether paged_prefill_attention takes such query and cache");
  m.def("linear_bf16_rows", &linear_bf16_rows, "bf16 linear for a few rows (AVX512-BF16)");
  m.def("add_rms_norm", &add_rms_norm, "h += delta (optional), then weight * rms_norm(h)");
  m.def("rotary_", &rotary_, "Rotary embedding in place (rotate-half layout)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from a fused gate_up output");
  m.def("has_bf16_linear", &has_bf16_linear, "Whether linear_bf16_rows was built");
  m.def("linear", &native_linear, "x @ w^T (+ bias): AMX tiles, the bf16 rows kernel or at::linear, by shape");
  m.def("has_amx", &has_amx, "Whether linear_bf16_amx was built and the OS grants AMX tiles");
  m.def("pack_bf16_weights", &pagecli::pack_bf16_weights, "w [N, K] bf16 -> the panels linear_bf16_packed reads");
  m.def("linear_bf16_packed", &pagecli::linear_bf16_packed, "x @ w^T (+ bias) over pack_bf16_weights(w), any rows");
  m.def("has_packed_linear", &pagecli::has_packed_linear, "Whether pack_bf16_weights/linear_bf16_packed were built");
#if PAGECLI_HAVE_AMX
  m.def("linear_bf16_amx", &linear_bf16_amx, "bf16 linear on AMX tiles (K % 32 == 0, N % 16 == 0)");
#endif
  pybind11::class_<DecodeStep>(m, "DecodeStep")
      .def(pybind11::init<std::vector<DecodeStep::Layer>, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                          int64_t, double, double>())
      .def("forward", &DecodeStep::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "One decode step through every layer; returns the final norm's output");
}
