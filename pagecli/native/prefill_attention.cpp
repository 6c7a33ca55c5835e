// Paged prefill attention: causal attention for the new tokens of prefilling sequences over their
// paged prefix, on AMX tiles for bf16 caches (elsewhere the caller uses PyTorch's attention).

#include "attention_common.h"
#include "cpu_ops.h"

namespace pagecli {

#if PAGECLI_HAVE_AMX
// Runs work(i) for items [0, costs.size()) on the thread pool in runs of about equal cost, each
// thread's tile registers configured for the AMX kernels.
template <typename Work>
void parallel_by_cost_with_tiles(const std::vector<int64_t>& costs, const Work& work) {
  parallel_for_by_cost(costs, [&](SharedWork::Cursor& cursor) {
    load_tile_config();
    for (int64_t i; (i = cursor.next()) >= 0;) work(i);
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

}  // namespace pagecli
