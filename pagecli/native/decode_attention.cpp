// Paged decode attention: one query token per sequence over its paged context, on AVX-512 (any
// float dtype) or AMX tiles (bf16), with a shared prompt prefix widened or multiplied once; int8 and
// fp8 caches, and float caches in builds without AVX-512 (the avx2 level), go to decode_attention_tiled.cpp.

#include "attention_common.h"
#include "cpu_ops.h"
#include "kv_quant.h"

namespace pagecli {
namespace {

constexpr int64_t kAheadTokens = 32;  // how far ahead of its tile paged_decode_impl fetches a token's rows

// One query token per sequence, the `group` query heads of a kv head together: scores for the
// whole context (two passes: softmax in fp32, then the weighted sum of V), reading K and V
// straight from the blocks named by the block table.
//
// When sequences start with the same blocks (a shared system prompt, the candidates of a forked
// request: DecodeTasks), a task takes one kv head for a run of them and widens each tile of their
// shared prefix once for all of them, instead of once per sequence. Every query row still sees the same tiles in the same order, with
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

  const DecodeTasks tasks(tables, max_blocks, lens, num_seqs, block_size, kv_heads, CHUNKS > 0 ? 16 : 0,
                          work_threads(), false);
  const int64_t heads_per_task = tasks.heads_per_task;
  tasks.run_for_each([&](SharedWork::Cursor& cursor) {
    const int64_t width = heads_per_task * group;  // query heads of one sequence in a task
    std::vector<float> q_buf;
    TaskScratch scratch;
    int64_t tile_slots[16];
    const scalar_t* tile_rows[16];
    alignas(64) float tile_buf[16 * 16 * (CHUNKS > 0 ? CHUNKS : 1)];
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
      // Both passes walk each context the same way: in tiles of 16 tokens from its start when the
      // head size has a vector version (visit(j, h, n, start) with tile_rows[i] = token start+i's
      // row of kv head h0+h), else token by token (visit(j, h, t, row)). The shared tiles are read
      // once for the task's sequences (through the first one's block table).
      auto for_each_tile = [&](const scalar_t* cache, auto&& visit) {
        auto load_tile = [&](const int32_t* table, int64_t start, int64_t n, int64_t h) {
          slots_of_tokens(table, block_size, start, n, tile_slots);
          for (int64_t i = 0; i < n; ++i) tile_rows[i] = cache + tile_slots[i] * slot_stride + (h0 + h) * head_dim;
        };
        const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(scalar_t));
        auto prefetch = [&](const int32_t* table, int64_t len, int64_t start, int64_t heads) {
          const int64_t ahead = start + kAheadTokens;
          if (ahead < len) {
            prefetch_tokens(cache, table, block_size, kv_heads, row_bytes, h0, heads, ahead,
                            std::min<int64_t>(16, len - ahead));
          }
        };
        for (int64_t start = 0; start < shared; start += 16) {
          prefetch(tables + s_begin * max_blocks, shared, start, 1);
          load_tile(tables + s_begin * max_blocks, start, 16, 0);
          for (int64_t j = 0; j < seqs; ++j) visit(j, 0, 16, start, j == 0);
        }
        for (int64_t j = 0; j < seqs; ++j) {
          const int64_t len = lens[s_begin + j];
          for (int64_t start = shared; start < len; start += 16) {
            const int64_t n = std::min<int64_t>(16, len - start);
            prefetch(tables + (s_begin + j) * max_blocks, len, start, heads_per_task);
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
      auto scores_of = [&](int64_t j, int64_t h) { return scratch.scores_of(j, h * group); };
      auto acc_of = [&](int64_t j, int64_t h) { return scratch.acc_of(j, h * group); };
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
          float* row = scratch.scores_of(j, r);
          scratch.denom[j * width + r] = exp_shifted_sum(row, len, max_of(row, len));
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
          const float* a = scratch.acc_of(j, r);
          const float inv = 1.f / scratch.denom[j * width + r];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
        }
      }
    }
  });
}

#if PAGECLI_HAVE_AMX

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
  const DecodeTasks tasks(tables, max_blocks, lens, num_seqs, block_size, kv_heads, 32, work_threads(), true);
  // With blocks of a multiple of 16 tokens, a 16-token tile lies in one block: tile loads read its
  // K rows in place (rows past the context are read but their scores dropped).
  const bool k_in_place = block_size % 16 == 0;
  constexpr int64_t kPrefetchTokens = 64;  // how far ahead of its tile load a K or V row is fetched
  tasks.run_for_each([&](SharedWork::Cursor& cursor) {
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
    for (int64_t task; (task = cursor.next()) >= 0;) {
      const auto [h0, s_begin, s_end, shared] = tasks.at(task);
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
#if PAGECLI_HAVE_BF16_DOT
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (paged_decode_bf16_supported(query, k_cache)) {
      return paged_decode_bf16(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
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

}  // namespace

// The inputs both paged-attention entry points take: query and out [tokens, heads, head_dim] with
// contiguous rows, K/V caches [num_blocks, block_size, kv_heads, head_dim] of their dtype (or
// quantized, [..., head_dim + 2] int8/uint8: kv_quant.h), and int32 block tables and lengths for
// num_seqs sequences.
void check_paged_inputs(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                        int64_t num_seqs) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out rows must be contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  if (is_quantized_kv(k_cache.scalar_type())) {  // rows of head_dim bytes and an fp16 scale (kv_quant.h)
    TORCH_CHECK(k_cache.size(3) == query.size(2) + kKvScaleBytes && query.size(2) % 16 == 0,
                "a quantized cache's rows must be head_dim + 2 bytes, head_dim a multiple of 16");
    TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
                "k_cache and v_cache must share a format, query and out a dtype");
  } else {
    TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim of query and cache differ");
    TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                    out.scalar_type() == query.scalar_type(),
                "query, out and cache must share a dtype");
  }
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) >= num_seqs,
              "block_tables must be contiguous int32 with a row per sequence");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() && seq_lens.size(0) >= num_seqs,
              "seq_lens must be contiguous int32 with an entry per sequence");
}

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  check_paged_inputs(out, query, k_cache, v_cache, block_tables, seq_lens, query.size(0));
  if (is_quantized_kv(k_cache.scalar_type())) {
#if PAGECLI_HAVE_BF16_DOT
    if (paged_decode_bf16_supported(query, k_cache)) {
      return paged_decode_bf16(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
    }
#endif
    return paged_decode_quantized(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  }
#if !defined(__AVX512F__)
  // Without AVX-512, float caches take the quantized kernel's AVX2 tiles (head sizes of 16s).
  if (query.size(2) % 16 == 0) return paged_decode_float_tiled(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
#endif
  PAGECLI_DISPATCH(query.scalar_type(), "paged_decode_attention", [&] {
    paged_decode_for_dim<scalar_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}

std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> decode_task_split(torch::Tensor block_tables, torch::Tensor seq_lens,
                                                                             int64_t block_size, int64_t kv_heads,
                                                                             int64_t share_unit, int64_t threads,
                                                                             bool heads_together) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous int32 [seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() &&
                  seq_lens.size(0) == block_tables.size(0),
              "seq_lens must be contiguous int32 with an entry per sequence");
  const DecodeTasks tasks(block_tables.data_ptr<int32_t>(), block_tables.size(1), seq_lens.data_ptr<int32_t>(),
                          seq_lens.size(0), block_size, kv_heads, share_unit, threads, heads_together);
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> split;
  for (int64_t task = 0; task < static_cast<int64_t>(tasks.costs.size()); ++task) {
    const auto t = tasks.at(task);
    split.emplace_back(t.h0, t.s_begin, t.s_end, t.shared);
  }
  return split;
}

}  // namespace pagecli
