// Paged decode attention in 16-token tiles: over a quantized cache (int8 or fp8 rows with an fp16 scale
// each, kv_format.py) at every level (AVX2 code, see kv_quant.h), and over float caches (FloatRows) in
// builds without AVX-512, whose float path it is. One query token per sequence.

#include "attention_common.h"
#include "kv_quant.h"

namespace pagecli {
namespace {

constexpr int64_t kPrefetchTokens = 32;  // how far ahead of its tile a token's K or V rows are fetched

// As paged_decode_impl (decode_attention.cpp): tasks of sequences and kv heads, the group's query
// heads together, two passes over each context in 16-token tiles (scores, softmax in fp32, then the
// weighted sum of V), a shared prefix's tiles widened once for every sequence of a task. A tile's
// rows are widened to fp32 once for the group; each row's scale multiplies its score (K) or its
// weight (V), not each of its values (float rows have none). Every query row sees the same tiles in the same order with
// the same arithmetic whether a prefix is shared or not, so the results are bit-identical.
template <typename Rows, typename scalar_t>
void decode_tiled_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                           const torch::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads, max_blocks = block_tables.size(1);
  using Elem = typename Rows::Elem;
  const int64_t row_elems = Rows::row_elems(head_dim), slot_elems = kv_heads * row_elems;
  const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(Elem));
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const Elem* k_ptr = static_cast<const Elem*>(k_cache.data_ptr());
  const Elem* v_ptr = static_cast<const Elem*>(v_cache.data_ptr());
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const float fscale = static_cast<float>(scale);

  const DecodeTasks tasks(tables, max_blocks, lens, num_seqs, block_size, kv_heads, 16, work_threads(), false);
  const int64_t heads_per_task = tasks.heads_per_task;
  tasks.run_for_each([&](SharedWork::Cursor& cursor) {
    const int64_t width = heads_per_task * group;  // query heads of one sequence in a task
    std::vector<float> q_buf;
    TaskScratch scratch;
    std::vector<float> tile(16 * head_dim, 0.f);  // [16 tokens][head_dim], widened, before scaling
    const Elem* tile_rows[16];
    const float* widened[16];  // the tile's rows as fp32: in tile, or (float32) in the cache
    int64_t tile_slots[16];
    float tile_scales[16], weights[16];
    for (int64_t task; (task = cursor.next()) >= 0;) {
      const auto [h0, s_begin, s_end, shared] = tasks.at(task);
      const int64_t seqs = s_end - s_begin;
      q_buf.resize(seqs * width * head_dim);
      scratch.reset(lens + s_begin, seqs, width, head_dim);
      for (int64_t j = 0; j < seqs; ++j) {
        for (int64_t r = 0; r < width; ++r) {
          const scalar_t* src = q_ptr + (s_begin + j) * q_s0 + (h0 * group + r) * q_s1;
          float* dst = q_buf.data() + (j * width + r) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * fscale;
        }
      }
      // The task's heads of tokens [start, start + n), fetched ahead of their tile.
      auto prefetch = [&](const Elem* cache, const int32_t* table, int64_t start, int64_t n) {
        prefetch_tokens(cache, table, block_size, kv_heads, row_bytes, h0, heads_per_task, start, n);
      };
      // Widens each tile of each context once and hands it to visit(j, h, n, start): tokens
      // [start, start + n) of kv head h0 + h, for sequence j of the task. The shared tiles are read
      // once for the task's sequences (through the first one's block table).
      auto for_each_tile = [&](const Elem* cache, auto&& visit) {
        auto widen = [&](int64_t n, int64_t h) {  // tokens at tile_slots, kv head h0 + h
          for (int64_t i = 0; i < n; ++i) tile_rows[i] = cache + tile_slots[i] * slot_elems + (h0 + h) * row_elems;
          Rows::widen(tile_rows, n, head_dim, tile.data(), tile_scales, widened);
        };
        const int32_t* first_table = tables + s_begin * max_blocks;
        for (int64_t start = 0; start < shared; start += 16) {
          const int64_t ahead = start + kPrefetchTokens;
          if (ahead < shared) prefetch(cache, first_table, ahead, std::min<int64_t>(16, shared - ahead));
          slots_of_tokens(first_table, block_size, start, 16, tile_slots);
          widen(16, 0);
          for (int64_t j = 0; j < seqs; ++j) visit(j, 0, 16, start);
        }
        for (int64_t j = 0; j < seqs; ++j) {
          const int32_t* table = tables + (s_begin + j) * max_blocks;
          const int64_t len = lens[s_begin + j];
          for (int64_t start = shared; start < len; start += 16) {
            const int64_t n = std::min<int64_t>(16, len - start), ahead = start + kPrefetchTokens;
            if (ahead < len) prefetch(cache, table, ahead, std::min<int64_t>(16, len - ahead));
            slots_of_tokens(table, block_size, start, n, tile_slots);
            for (int64_t h = 0; h < heads_per_task; ++h) {
              widen(n, h);
              visit(j, h, n, start);
            }
          }
        }
      };
      auto q_of = [&](int64_t j, int64_t h) { return q_buf.data() + (j * width + h * group) * head_dim; };
      auto scores_of = [&](int64_t j, int64_t h) { return scratch.scores_of(j, h * group); };
      auto acc_of = [&](int64_t j, int64_t h) { return scratch.acc_of(j, h * group); };
      for_each_tile(k_ptr, [&](int64_t j, int64_t h, int64_t n, int64_t start) {
        const int64_t len = lens[s_begin + j];
        for (int64_t g = 0; g < group; ++g) {
          quantized_tile_scores(q_of(j, h) + g * head_dim, n, widened, Rows::kScaled ? tile_scales : nullptr, head_dim,
                                scores_of(j, h) + g * len + start);
        }
      });
      for (int64_t j = 0; j < seqs; ++j) {
        const int64_t len = lens[s_begin + j];
        for (int64_t r = 0; r < width; ++r) scratch.denom[j * width + r] = softmax_numerators(scratch.scores_of(j, r), len);
      }
      for_each_tile(v_ptr, [&](int64_t j, int64_t h, int64_t n, int64_t start) {
        const int64_t len = lens[s_begin + j];
        for (int64_t g = 0; g < group; ++g) {
          const float* w = scores_of(j, h) + g * len + start;
          if constexpr (Rows::kScaled) {
            for (int64_t i = 0; i < n; ++i) weights[i] = w[i] * tile_scales[i];
            w = weights;
          }
          quantized_tile_accumulate(acc_of(j, h) + g * head_dim, w, n, widened, head_dim);
        }
      });
      for (int64_t j = 0; j < seqs; ++j) {
        for (int64_t r = 0; r < width; ++r) {
          scalar_t* dst = o_ptr + (s_begin + j) * o_s0 + (h0 * group + r) * o_s1;
          const float* a = scratch.acc_of(j, r);
          const float inv = 1.f / scratch.denom[j * width + r];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
        }
      }
    }
  });
}

}  // namespace

void paged_decode_quantized(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, double scale) {
  const bool int8 = kv_quant_of(k_cache.scalar_type()) == KvQuant::kInt8;
  PAGECLI_DISPATCH(query.scalar_type(), "paged_decode_quantized", [&] {
    if (int8) {
      decode_tiled_impl<QuantizedRows<KvQuant::kInt8>, scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                                                 scale);
    } else {
      decode_tiled_impl<QuantizedRows<KvQuant::kFp8>, scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                                                scale);
    }
  });
}

void paged_decode_float_tiled(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.size(2) % 16 == 0, "the tiled float decode kernel needs head_dim a multiple of 16");
  PAGECLI_DISPATCH(query.scalar_type(), "paged_decode_float_tiled", [&] {
    decode_tiled_impl<FloatRows<scalar_t>, scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}

}  // namespace pagecli
