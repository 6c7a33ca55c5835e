// Paged decode attention on AVX512-BF16 dot products (vdpbf16ps), for CPUs that have them without
// AMX (Zen 4/5, Ice Lake and Cooper Lake servers), and for int8/fp8 caches on AMX machines too:
// bf16 K and V rows are used as they lie in the cache, never widened to fp32 in memory; fp8 rows
// (kv_quant.h) are widened 16 tokens at a time to bf16, which holds their values exactly; int8 rows
// take AVX512-VNNI's int16 products instead (decode_attention_int8.h). A quantized row's scale
// multiplies its score and its softmax weight.

#include "attention_common.h"
#include "cpu_ops.h"
#include "decode_attention_int8.h"
#include "decode_tiles.h"
#include "kv_quant.h"

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

// How the kernel reads a cache's rows (the skeleton below calls these; decode_attention_int8.h's
// Int8Cache is the third such policy). A policy names the cache element (Elem), what a tile's rows
// point at (Row), whether rows carry a scale, whether load() widens them into a buffer, and the
// query rows, dot products and packed tiles of its arithmetic.
struct Bf16Dots {
  using Row = c10::BFloat16;
  using Query = const c10::BFloat16*;

  template <int CHUNKS>
  class Queries {  // a task's query rows, where they lie
   public:
    void prepare(const c10::BFloat16* first, int64_t s0, int64_t s1, int64_t, int64_t) {
      first_ = first, s0_ = s0, s1_ = s1;
    }
    Query row(int64_t j, int64_t r) const { return first_ + j * s0_ + r * s1_; }

   private:
    const c10::BFloat16* first_ = nullptr;
    int64_t s0_ = 0, s1_ = 0;
  };

  template <int CHUNKS>
  static void tile_scores(Query q, const Row* const* rows, int64_t n, __m512 factor, float* out) {
    __m512bh qv[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const __m512i*>(q) + c);
    bf16_tile_scores<CHUNKS>(qv, rows, n, factor, out);
  }
  template <int CHUNKS>
  static void pack_k(const Row* const* rows, __m512i* kt) { pack_k_tile<CHUNKS>(rows, kt); }
  template <int CHUNKS>
  static void packed_scores(Query q, const __m512i* kt, __m512 factor, float* out) {
    bf16_packed_scores<CHUNKS>(q, kt, factor, out);
  }
  template <int CHUNKS>
  static void tile_accumulate(float* acc, const float* w, const Row* const* rows, int64_t n) {
    bf16_tile_accumulate<CHUNKS>(acc, w, rows, n);
  }
  template <int CHUNKS>
  static void pack_v(const Row* const* rows, __m512i* vp) { pack_v_tile<CHUNKS>(rows, vp); }
  template <int CHUNKS>
  static void packed_accumulate(float* acc, const float* w, const __m512i* vp) {
    bf16_packed_accumulate<CHUNKS>(acc, w, vp);
  }
};

struct Bf16Cache : Bf16Dots {
  using Elem = c10::BFloat16;
  static constexpr bool kScaled = false;
  static constexpr bool kWidens = false;
  static constexpr int64_t row_elems(int64_t dim) { return dim; }
  template <int CHUNKS>
  static const Row* load(const Elem* row, Row*, float&) { return row; }
};

// fp8 rows (head_dim bytes and an fp16 scale) widened to bf16 at `slot`, exactly: e4m3 values (/ 256,
// as kv_quant.h's widen16) have 3 mantissa bits and exponents well inside bf16's range. (So would
// int8 values be, but Int8Cache's integer products cost less than widening.)
struct Fp8Cache : Bf16Dots {
  using Elem = uint8_t;
  static constexpr bool kScaled = true;
  static constexpr bool kWidens = true;
  static constexpr int64_t row_elems(int64_t dim) { return dim + kKvScaleBytes; }

  template <int CHUNKS>
  static const Row* load(const Elem* row, Row* slot, float& scale) {
    for (int c = 0; c < CHUNKS; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c));
      const __m512i half_bits = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                                                 _mm512_set1_epi16(static_cast<int16_t>(0xBF80)));
      const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half_bits));
      const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half_bits, 1));
      _mm512_storeu_si512(reinterpret_cast<__m512i*>(slot + 32 * c), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    scale = row_scale<KvQuant::kFp8>(row, 32 * CHUNKS);
    return slot;
  }
};

// The tasks and passes of paged_decode_impl (decode_attention.cpp): a task is a run of sequences and
// kv heads; scores of each context in 16-token tiles, softmax in fp32, then the weighted sum of V in
// the same tiles. A shared prefix's tiles are visited for all of a task's sequences in turn while
// they are in L1. Every query row sees the same tiles with the same arithmetic whatever its batch or
// task, so the results do not depend on either. Cache: Bf16Cache, Fp8Cache or Int8Cache.
template <int CHUNKS, typename Cache>
void decode_bf16_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                      double scale) {
  using bf16 = c10::BFloat16;
  using Elem = typename Cache::Elem;
  using Row = typename Cache::Row;
  constexpr int64_t D = 32 * CHUNKS;
  constexpr int64_t row_elems = Cache::row_elems(D);
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads, max_blocks = block_tables.size(1);
  const bf16* q_ptr = query.data_ptr<bf16>();
  const Elem* k_ptr = static_cast<const Elem*>(k_cache.data_ptr());
  const Elem* v_ptr = static_cast<const Elem*>(v_cache.data_ptr());
  bf16* o_ptr = out.data_ptr<bf16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t slot_stride = kv_heads * row_elems;
  const __m512 scale16 = _mm512_set1_ps(static_cast<float>(scale));

  const DecodeTasks tasks(tables, max_blocks, lens, num_seqs, block_size, kv_heads, 16, work_threads(), false);
  const int64_t heads_per_task = tasks.heads_per_task;
  tasks.run_for_each([&](SharedWork::Cursor& cursor) {
    const int64_t width = heads_per_task * group;  // query heads of one sequence in a task
    TaskScratch scratch;
    int64_t tile_slots[16];
    const Row* tile_rows[16];
    alignas(64) Row widened[Cache::kWidens ? 16 * D : 1];  // a tile's rows, where load() widens them
    alignas(64) float row_scales[16];  // and each row's scale, where rows have one
    typename Cache::template Queries<CHUNKS> queries;
    std::vector<__m512i> packed(16 * CHUNKS);  // a shared tile, packed: pack_k_tile's or pack_v_tile's layout
    for (int64_t task; (task = cursor.next()) >= 0;) {
      const auto [h0, s_begin, s_end, shared] = tasks.at(task);
      const int64_t seqs = s_end - s_begin;
      scratch.reset(lens + s_begin, seqs, width, D);
      queries.prepare(q_ptr + s_begin * q_s0 + h0 * group * q_s1, q_s0, q_s1, seqs, width);
      // visit(j, h, n, start, is_packed) for every tile of every context: tokens [start, start + n)
      // of kv head h0 + h of sequence j, their rows at tile_rows. The shared tiles come first, each
      // packed once (is_packed) for all of the task's sequences (through the first one's block table).
      auto for_each_tile = [&](const Elem* cache, auto&& visit) {
        auto load_tile = [&](const int32_t* table, int64_t start, int64_t n, int64_t h) {
          slots_of_tokens(table, block_size, start, n, tile_slots);
          for (int64_t i = 0; i < n; ++i) {
            const Elem* row = cache + tile_slots[i] * slot_stride + (h0 + h) * row_elems;
            tile_rows[i] = Cache::template load<CHUNKS>(row, widened + (Cache::kWidens ? i * D : 0), row_scales[i]);
          }
        };
        auto prefetch = [&](const int32_t* table, int64_t len, int64_t start, int64_t heads) {
          const int64_t ahead = start + kAheadTokens;
          if (ahead < len) {
            prefetch_tokens(cache, table, block_size, kv_heads, row_elems * sizeof(Elem), h0, heads, ahead,
                            std::min<int64_t>(16, len - ahead));
          }
        };
        const int32_t* first_table = tables + s_begin * max_blocks;
        for (int64_t start = 0; start < shared; start += 16) {
          prefetch(first_table, shared, start, 1);
          load_tile(first_table, start, 16, 0);
          if (cache == k_ptr) {
            Cache::template pack_k<CHUNKS>(tile_rows, packed.data());
          } else {
            Cache::template pack_v<CHUNKS>(tile_rows, packed.data());
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
        const __m512 factor = Cache::kScaled ? _mm512_mul_ps(scale16, _mm512_maskz_loadu_ps(first_lanes(n), row_scales))
                                             : scale16;
        for (int64_t g = 0; g < group; ++g) {
          const auto q = queries.row(j, h * group + g);
          if (is_packed) {
            Cache::template packed_scores<CHUNKS>(q, packed.data(), factor, rows_scores + g * len);
          } else {
            Cache::template tile_scores<CHUNKS>(q, tile_rows, n, factor, rows_scores + g * len);
          }
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
          alignas(64) float scaled[16];
          if constexpr (Cache::kScaled) {
            const __mmask16 valid = first_lanes(n);
            _mm512_store_ps(scaled, _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, weights),
                                                  _mm512_maskz_loadu_ps(valid, row_scales)));
            weights = scaled;
          }
          if (is_packed) {
            Cache::template packed_accumulate<CHUNKS>(sums, weights, packed.data());
          } else {
            Cache::template tile_accumulate<CHUNKS>(sums, weights, tile_rows, n);
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
  const auto cache = k_cache.scalar_type();
  const bool readable = cache == torch::kBFloat16 ||  // int8 needs VNNI's int16 products (Int8Cache)
                        (is_quantized_kv(cache) && (kv_quant_of(cache) == KvQuant::kFp8 || PAGECLI_HAVE_INT16_DOT));
  return query.scalar_type() == torch::kBFloat16 && readable && dim % 32 == 0 && dim <= 256;
}

namespace {
template <typename Cache>
void decode_bf16_for_dim(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                         const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                         double scale) {
  switch (query.size(2) / 32) {
    case 1: return decode_bf16_impl<1, Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 2: return decode_bf16_impl<2, Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 3: return decode_bf16_impl<3, Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 4: return decode_bf16_impl<4, Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 5: return decode_bf16_impl<5, Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 6: return decode_bf16_impl<6, Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    case 7: return decode_bf16_impl<7, Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    default: return decode_bf16_impl<8, Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  }
}
}  // namespace

void paged_decode_bf16(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                       double scale) {
  TORCH_CHECK(paged_decode_bf16_supported(query, k_cache),
              "paged_decode_bf16 needs a bf16 query, a bf16/int8/fp8 cache and a head size of 32-256 by 32");
  if (!is_quantized_kv(k_cache.scalar_type())) {
    return decode_bf16_for_dim<Bf16Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  }
  if (kv_quant_of(k_cache.scalar_type()) == KvQuant::kFp8) {
    return decode_bf16_for_dim<Fp8Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  }
#if PAGECLI_HAVE_INT16_DOT
  return decode_bf16_for_dim<Int8Cache>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
#else
  TORCH_CHECK(false, "paged_decode_bf16 reads int8 caches on AVX512-VNNI, which this build lacks");
#endif
}
#else
bool paged_decode_bf16_supported(const torch::Tensor&, const torch::Tensor&) { return false; }
void paged_decode_bf16(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&, const torch::Tensor&, double) {
  TORCH_CHECK(false, "paged_decode_bf16 needs AVX512-BF16, which this build lacks");
}
#endif

}  // namespace pagecli
