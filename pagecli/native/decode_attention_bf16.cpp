// Paged decode attention over bf16 caches with AVX512-BF16 dot products (vdpbf16ps), for CPUs that
// have them without AMX (Zen 4/5, Ice Lake and Cooper Lake servers): the K and V rows are used as
// they lie in the cache, never widened to fp32 in memory.

#include "attention_common.h"
#include "cpu_ops.h"

namespace pagecli {

#if PAGECLI_HAVE_BF16_DOT
namespace {

constexpr int64_t kAheadTokens = 32;  // how far ahead of its tile a token's K or V rows are fetched

// Scores of up to 16 K rows (D = 32 * CHUNKS bf16 each) for one query head q (CHUNKS vectors of 32
// bf16): out[i] = scale * q . k_i, each dot product a chain of vdpbf16ps over the row's 32-dim chunks
// (pairs of products summed in fp32), then the 16 chains summed lane-wise.
template <int CHUNKS>
inline void bf16_tile_scores(const __m512bh* q, const c10::BFloat16* const* rows, int64_t n, __m512 scale,
                             float* out) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) {
    acc[i] = _mm512_setzero_ps();
    if (i < n) {
      const __m512i* row = reinterpret_cast<const __m512i*>(rows[i]);
      for (int c = 0; c < CHUNKS; ++c) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row + c), q[c]);
    }
  }
  _mm512_mask_storeu_ps(out, first_lanes(n), _mm512_mul_ps(sum_lanes_16(acc), scale));
}

// acc += sum over the tile's tokens i < n of w[i] * v_i, two tokens per vdpbf16ps: the weights are
// rounded to bf16 (as the AMX kernel's P V does) and rows t, t+1 interleaved by 16-bit words, so
// acc's 2 * CHUNKS vectors hold the dims in interleaved order (see natural_dims).
template <int CHUNKS>
inline void bf16_tile_accumulate(float* acc, const float* w, const c10::BFloat16* const* rows, int64_t n) {
  alignas(64) uint32_t pairs[8];  // bf16(w[2p]) | bf16(w[2p + 1]) << 16
  _mm256_store_si256(reinterpret_cast<__m256i*>(pairs),
                     (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first_lanes(n), w)));
  __m512 o[2 * CHUNKS];
  for (int c = 0; c < 2 * CHUNKS; ++c) o[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t i = 0; i < n; i += 2) {
    const __m512i* even = reinterpret_cast<const __m512i*>(rows[i]);
    const __m512i* odd = i + 1 < n ? reinterpret_cast<const __m512i*>(rows[i + 1]) : nullptr;
    const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[i / 2]));
    for (int c = 0; c < CHUNKS; ++c) {
      const __m512i a = _mm512_loadu_si512(even + c);
      const __m512i b = odd ? _mm512_loadu_si512(odd + c) : _mm512_setzero_si512();
      o[2 * c] = _mm512_dpbf16_ps(o[2 * c], (__m512bh)_mm512_unpacklo_epi16(a, b), weight);
      o[2 * c + 1] = _mm512_dpbf16_ps(o[2 * c + 1], (__m512bh)_mm512_unpackhi_epi16(a, b), weight);
    }
  }
  for (int c = 0; c < 2 * CHUNKS; ++c) _mm512_storeu_ps(acc + 16 * c, o[c]);
}

// Tiles of a prefix several sequences (or a prompt's rows) share are packed once and then used by
// each of them, with the same operations on the same operands in the same order as the two kernels
// above, so a row's results do not depend on whether its tiles were shared.
//
// K: kt[16 * c + w] holds, for each of the 16 keys (lanes), word w (dims 2w, 2w + 1) of the key's
// c-th 32-dim chunk: the tile transposed, 16 x 16 32-bit words per chunk.
template <int CHUNKS>
inline void pack_k_tile(const c10::BFloat16* const* rows, __m512i* kt) {
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

// bf16_tile_scores over a packed tile of 16 keys: lane partial w is the same vdpbf16ps chain over the
// chunks, for all 16 keys at once, and the partials are summed in sum_lanes_16's order.
template <int CHUNKS>
inline void bf16_packed_scores(const c10::BFloat16* q, const __m512i* kt, __m512 scale, float* out) {
  const int32_t* words = reinterpret_cast<const int32_t*>(q);
  __m512 p[16];
  for (int w = 0; w < 16; ++w) {
    p[w] = _mm512_setzero_ps();
    for (int c = 0; c < CHUNKS; ++c) {
      p[w] = _mm512_dpbf16_ps(p[w], (__m512bh)kt[16 * c + w], (__m512bh)_mm512_set1_epi32(words[16 * c + w]));
    }
  }
  __m512 block[4];
  for (int b = 0; b < 4; ++b) {
    block[b] = _mm512_add_ps(_mm512_add_ps(p[4 * b], p[4 * b + 2]), _mm512_add_ps(p[4 * b + 1], p[4 * b + 3]));
  }
  const __m512 sums = _mm512_add_ps(_mm512_add_ps(block[0], block[1]), _mm512_add_ps(block[2], block[3]));
  _mm512_storeu_ps(out, _mm512_mul_ps(sums, scale));
}

// V: vp[(j * CHUNKS + c) * 2 + half] is what bf16_tile_accumulate multiplies for tokens 2j, 2j+1.
template <int CHUNKS>
inline void pack_v_tile(const c10::BFloat16* const* rows, __m512i* vp) {
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

// bf16_tile_accumulate over a packed tile of 16 tokens.
template <int CHUNKS>
inline void bf16_packed_accumulate(float* acc, const float* w, const __m512i* vp) {
  alignas(64) uint32_t pairs[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w)));
  __m512 o[2 * CHUNKS];
  for (int c = 0; c < 2 * CHUNKS; ++c) o[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int j = 0; j < 8; ++j) {
    const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[j]));
    for (int c = 0; c < 2 * CHUNKS; ++c) o[c] = _mm512_dpbf16_ps(o[c], (__m512bh)vp[j * 2 * CHUNKS + c], weight);
  }
  for (int c = 0; c < 2 * CHUNKS; ++c) _mm512_storeu_ps(acc + 16 * c, o[c]);
}

// bf16_tile_accumulate's sums in dim order: per 32 dims, the interleaving put dims 8L..8L+3 of each
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

// The tasks and passes of paged_decode_impl (decode_attention.cpp): a task is a run of sequences and
// kv heads; scores of each context in 16-token tiles, softmax in fp32, then the weighted sum of V in
// the same tiles. A shared prefix's tiles are visited for all of a task's sequences in turn while
// they are in L1. Every query row sees the same tiles with the same arithmetic whatever its batch or
// task, so the results do not depend on either.
template <int CHUNKS>
void decode_bf16_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                      double scale) {
  using bf16 = c10::BFloat16;
  constexpr int64_t D = 32 * CHUNKS;
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads, max_blocks = block_tables.size(1);
  const bf16* q_ptr = query.data_ptr<bf16>();
  const bf16* k_ptr = k_cache.data_ptr<bf16>();
  const bf16* v_ptr = v_cache.data_ptr<bf16>();
  bf16* o_ptr = out.data_ptr<bf16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t slot_stride = kv_heads * D;
  const __m512 scale16 = _mm512_set1_ps(static_cast<float>(scale));

  const DecodeTasks tasks(tables, max_blocks, lens, num_seqs, block_size, kv_heads, 16, at::get_num_threads(), false);
  const int64_t heads_per_task = tasks.heads_per_task;
  tasks.run_for_each([&](int64_t begin, int64_t end) {
    const int64_t width = heads_per_task * group;  // query heads of one sequence in a task
    TaskScratch scratch;
    int64_t tile_slots[16];
    const bf16* tile_rows[16];
    std::vector<__m512i> packed(16 * CHUNKS);  // a shared tile, packed: pack_k_tile's or pack_v_tile's layout
    for (int64_t task = begin; task < end; ++task) {
      const auto [h0, s_begin, s_end, shared] = tasks.at(task);
      const int64_t seqs = s_end - s_begin;
      scratch.reset(lens + s_begin, seqs, width, D);
      // visit(j, h, n, start, is_packed) for every tile of every context: tokens [start, start + n)
      // of kv head h0 + h of sequence j, their rows at tile_rows. The shared tiles come first, each
      // packed once (is_packed) for all of the task's sequences (through the first one's block table).
      auto for_each_tile = [&](const bf16* cache, auto&& visit) {
        auto load_tile = [&](const int32_t* table, int64_t start, int64_t n, int64_t h) {
          slots_of_tokens(table, block_size, start, n, tile_slots);
          for (int64_t i = 0; i < n; ++i) tile_rows[i] = cache + tile_slots[i] * slot_stride + (h0 + h) * D;
        };
        auto prefetch = [&](const int32_t* table, int64_t len, int64_t start, int64_t heads) {
          const int64_t ahead = start + kAheadTokens;
          if (ahead < len) {
            prefetch_tokens(cache, table, block_size, kv_heads, D * 2, h0, heads, ahead, std::min<int64_t>(16, len - ahead));
          }
        };
        const int32_t* first_table = tables + s_begin * max_blocks;
        for (int64_t start = 0; start < shared; start += 16) {
          prefetch(first_table, shared, start, 1);
          load_tile(first_table, start, 16, 0);
          if (cache == k_ptr) {
            pack_k_tile<CHUNKS>(tile_rows, packed.data());
          } else {
            pack_v_tile<CHUNKS>(tile_rows, packed.data());
          }
          for (int64_t j = 0; j < seqs; ++j) visit(j, 0, 16, start, true);
        }
        for (int64_t j = 0; j < seqs; ++j) {
          const int32_t* table = tables + (s_begin + j) * max_blocks;
          const int64_t len = lens[s_begin + j];
          for (int64_t start = shared; start < len; start += 16) {
            const int64_t n = std::min<int64_t>(16, len - start);
            prefetch(table, len, start, heads_per_task);
            for (int64_t h = 0; h < heads_per_task; ++h) {
              load_tile(table, start, n, h);
              visit(j, h, n, start, false);
            }
          }
        }
      };
      for_each_tile(k_ptr, [&](int64_t j, int64_t h, int64_t n, int64_t start, bool is_packed) {
        const int64_t len = lens[s_begin + j];
        float* rows_scores = scratch.scores_of(j, h * group) + start;
        for (int64_t g = 0; g < group; ++g) {
          const bf16* q_row = q_ptr + (s_begin + j) * q_s0 + ((h0 + h) * group + g) * q_s1;
          if (is_packed) {
            bf16_packed_scores<CHUNKS>(q_row, packed.data(), scale16, rows_scores + g * len);
            continue;
          }
          const __m512i* q = reinterpret_cast<const __m512i*>(q_row);
          __m512bh qv[CHUNKS];
          for (int c = 0; c < CHUNKS; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + c);
          bf16_tile_scores<CHUNKS>(qv, tile_rows, n, scale16, rows_scores + g * len);
        }
      });
      for (int64_t j = 0; j < seqs; ++j) {
        const int64_t len = lens[s_begin + j];
        for (int64_t r = 0; r < width; ++r) {
          float* row = scratch.scores_of(j, r);
          scratch.denom[j * width + r] = exp_shifted_sum(row, len, max_of(row, len));
        }
      }
      for_each_tile(v_ptr, [&](int64_t j, int64_t h, int64_t n, int64_t start, bool is_packed) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = h * group + g;
          float* sums = scratch.acc_of(j, r);
          const float* weights = scratch.scores_of(j, r) + start;
          if (is_packed) {
            bf16_packed_accumulate<CHUNKS>(sums, weights, packed.data());
          } else {
            bf16_tile_accumulate<CHUNKS>(sums, weights, tile_rows, n);
          }
        }
      });
      for (int64_t j = 0; j < seqs; ++j) {
        for (int64_t r = 0; r < width; ++r) {
          natural_dims(scratch.acc_of(j, r), 1.f / scratch.denom[j * width + r],
                       o_ptr + (s_begin + j) * o_s0 + (h0 * group + r) * o_s1, D);
        }
      }
    }
  });
}

}  // namespace

bool paged_decode_bf16_supported(const torch::Tensor& query, const torch::Tensor& k_cache) {
  const int64_t dim = query.size(2);
  return query.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16 && dim % 32 == 0 &&
         dim <= 256;
}

void paged_decode_bf16(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                       double scale) {
  TORCH_CHECK(paged_decode_bf16_supported(query, k_cache), "paged_decode_bf16 needs bf16 and a head size of 32-256 by 32");
  switch (query.size(2) / 32) {
    case 1: return decode_bf16_impl<1>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 2: return decode_bf16_impl<2>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 3: return decode_bf16_impl<3>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 4: return decode_bf16_impl<4>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 5: return decode_bf16_impl<5>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 6: return decode_bf16_impl<6>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 7: return decode_bf16_impl<7>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    default: return decode_bf16_impl<8>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  }
}
#else
bool paged_decode_bf16_supported(const torch::Tensor&, const torch::Tensor&) { return false; }
void paged_decode_bf16(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&, const torch::Tensor&, double) {
  TORCH_CHECK(false, "paged_decode_bf16 needs AVX512-BF16, which this build lacks");
}
#endif

}  // namespace pagecli
