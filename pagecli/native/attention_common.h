// What the paged attention kernels share: per-row dot products and softmax steps, widened K/V
// tiles, cache slots from block tables, the split of a step into tasks of about equal cost, the
// input checks, and (AMX) the prefetch and V packing both decode and prefill use.
//
// Layouts (see pagecli/attention): cache [num_blocks, block_size, kv_heads, head_dim];
// block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32.

#pragma once

#include "simd.h"
#include "work_share.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace pagecli {


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

// Widens up to 16 cache rows (rows[i]: token i's row of one kv head) to fp32 in buf, D floats apart.
template <int CHUNKS, typename scalar_t>
inline void widen_tile(const scalar_t* const* rows, int64_t n, float* buf) {
  constexpr int D = CHUNKS * 16;
  for (int64_t i = 0; i < n; ++i) {
    for (int c = 0; c < CHUNKS; ++c) _mm512_store_ps(buf + i * D + 16 * c, load16(rows[i] + 16 * c));
  }
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


// The cache slot of token t of a sequence, from its block table.
inline int64_t slot_of(const int32_t* table, int64_t block_size, int64_t t) {
  return static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
}

// Asks for the rows of kv heads [h0, h0 + heads) of tokens [t0, t0 + count) of a paged context
// (rows of row_bytes bytes, kv_heads of them per cache slot) to be brought into L2. A context's
// blocks lie scattered over the pool, where the hardware prefetcher does not follow them. Into L2,
// not L1 (prefetcht1, not t0), measured on a Zen 4: decode attention over 64 contexts of
// 2,000-4,000 tokens took 15-16 ms per layer with t0 and 8-9 with t1 (bf16 cache; int8 10-11.5
// against 6.5-7), likely because a core has few L1 miss buffers and t0 waits on them.
inline void prefetch_tokens(const void* cache, const int32_t* table, int64_t block_size, int64_t kv_heads,
                            int64_t row_bytes, int64_t h0, int64_t heads, int64_t t0, int64_t count) {
  const char* base = static_cast<const char*>(cache);
  int64_t block = t0 / block_size, offset = t0 % block_size;
  for (int64_t t = 0; t < count; ++t) {
    const int64_t slot = static_cast<int64_t>(table[block]) * block_size + offset;
    if (++offset == block_size) offset = 0, ++block;
    const uintptr_t first = reinterpret_cast<uintptr_t>(base + (slot * kv_heads + h0) * row_bytes);
    const uintptr_t last = first + heads * row_bytes - 1;
    for (uintptr_t line = first & ~uintptr_t{63}; line <= last; line += 64) {
      // As an asm statement: GCC 12 at -O3 vectorizes this loop and drops _mm_prefetch from it.
      asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(line)));
    }
  }
}

// The cache slots of tokens [start, start + n) of a context (one division, not one per token).
inline void slots_of_tokens(const int32_t* table, int64_t block_size, int64_t start, int64_t n, int64_t* slots) {
  int64_t block = start / block_size, offset = start % block_size;
  for (int64_t i = 0; i < n; ++i) {
    slots[i] = static_cast<int64_t>(table[block]) * block_size + offset;
    if (++offset == block_size) offset = 0, ++block;
  }
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
inline std::vector<int64_t> balanced_runs(const std::vector<int64_t>& costs, int64_t parts) {
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

// parallel_shared (work_share.h) over items [0, costs.size()), each thread's own share chosen by
// cost, not by count: sequences and prompts of unequal lengths would leave one thread waiting on the
// other. fn(cursor) runs once per thread and takes items with cursor.next() until it returns -1.
template <typename Fn>
void parallel_for_by_cost(const std::vector<int64_t>& costs, const Fn& fn) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(work_threads(), costs.size()));
  parallel_shared(balanced_runs(costs, parts), fn);
}

// Where a step's sequences split into groups that share a prefix: before sequence s when it does
// not start with the same block as s - 1, or when the two share fewer full blocks than either shares
// with its other neighbour. The candidates of one forked request (parallel sampling, beams) lie next
// to each other and share their whole prompt, the next request only a system prompt before it; a
// batch of different prompts behind one system prompt stays one group. Group g is sequences
// [bounds[g], bounds[g + 1]).
inline std::vector<int64_t> prefix_group_bounds(const int32_t* tables, int64_t max_blocks, const int32_t* lens,
                                                int64_t seqs, int64_t block_size) {
  std::vector<int64_t> common(seqs + 1, 0);  // common[s]: full blocks s - 1 and s share from their start
  for (int64_t s = 1; s < seqs; ++s) {
    const int64_t full = std::min(lens[s - 1], lens[s]) / block_size;
    const int32_t* a = tables + (s - 1) * max_blocks;
    const int32_t* b = tables + s * max_blocks;
    while (common[s] < full && a[common[s]] == b[common[s]]) ++common[s];
  }
  std::vector<int64_t> bounds{0};
  for (int64_t s = 1; s < seqs; ++s) {
    const bool cut = common[s] == 0 || (s > 1 && common[s] < common[s - 1]) || common[s] < common[s + 1];
    if (cut) bounds.push_back(s);
  }
  bounds.push_back(seqs);
  return bounds;
}

// What a task of the two-pass decode kernels keeps per query head (r < width) of each of its
// sequences (j): the scores over its context, a contiguous row of len_j floats (so the softmax
// passes are vectorized), the softmax denominator, and the weighted sum of V (dim floats). Kept
// from task to task of a thread.
struct TaskScratch {
  std::vector<float> acc, scores, denom;
  std::vector<int64_t> offset;  // sequence j's [width][len_j] scores start at offset[j]
  const int32_t* lens = nullptr;
  int64_t width = 0, dim = 0;

  void reset(const int32_t* task_lens, int64_t seqs, int64_t heads, int64_t head_dim) {
    lens = task_lens, width = heads, dim = head_dim;
    acc.assign(seqs * width * dim, 0.f);
    denom.resize(seqs * width);
    offset.resize(seqs + 1);
    offset[0] = 0;
    for (int64_t j = 0; j < seqs; ++j) offset[j + 1] = offset[j] + width * lens[j];
    scores.resize(offset[seqs]);
  }
  float* scores_of(int64_t j, int64_t r) { return scores.data() + offset[j] + r * lens[j]; }
  float* acc_of(int64_t j, int64_t r) { return acc.data() + (j * width + r) * dim; }
};

// How the decode-attention kernels split a step into tasks. A task is a run of sequences
// [s_begin, s_end), the kv heads [h0, h0 + heads_per_task), and the tokens [0, shared) the run's
// sequences all hold in the same blocks (a multiple of `share_unit` tokens; share_unit 0 shares
// nothing), whose tiles the kernel reads once for the run:
//  - with sequences enough to keep every thread busy (at least 2 per thread), all kv heads per task,
//    so a task reads whole cache rows (every head of a token) and each block's lines are fetched
//    once: one sequence per task, or with shared prefixes runs of sequences when the kernel can
//    widen the prefix of every head at once (`heads_together`, the AMX kernel);
//  - otherwise one kv head per task (a single long chat).
// With shared prefixes, each prefix group (prefix_group_bounds) is a run, or, when there are fewer
// groups than the threads want runs (one system prompt for the whole batch), is cut into runs in
// proportion to its length: `threads` runs in all with whole rows, else about 2 * threads / kv_heads.
// Runs are cut by context length, not by count, and run_for_each hands the threads tasks of about
// equal total length (a batch of prompts of 39 to 596 tokens, split by count, kept one thread
// waiting on the other).
struct DecodeTasks {
  struct Task {
    int64_t h0, s_begin, s_end, shared;
  };
  int64_t heads_per_task, head_tasks;
  std::vector<int64_t> run_bounds;  // run r is sequences [run_bounds[r], run_bounds[r + 1])
  std::vector<int64_t> run_shared;  // run r's shared prefix tokens
  std::vector<int64_t> costs;       // per task: the context tokens it reads

  DecodeTasks(const int32_t* tables, int64_t max_blocks, const int32_t* lens, int64_t seqs, int64_t block_size,
              int64_t kv_heads, int64_t share_unit, int64_t threads, bool heads_together) {
    auto shared_of = [&](int64_t begin, int64_t end) -> int64_t {
      if (share_unit == 0) return 0;
      const int64_t tokens = shared_prefix_tokens(tables + begin * max_blocks, max_blocks, lens + begin, end - begin,
                                                  block_size);
      return tokens / share_unit * share_unit;
    };
    const std::vector<int64_t> groups = share_unit > 0 ? prefix_group_bounds(tables, max_blocks, lens, seqs, block_size)
                                                       : std::vector<int64_t>{0, seqs};
    const int64_t num_groups = static_cast<int64_t>(groups.size()) - 1;
    std::vector<int64_t> group_shared(num_groups);
    bool any_shared = false;
    for (int64_t g = 0; g < num_groups; ++g) {
      group_shared[g] = shared_of(groups[g], groups[g + 1]);
      any_shared = any_shared || group_shared[g] > 0;
    }
    const bool many = seqs >= 2 * threads;
    const bool whole_rows = many && (!any_shared || heads_together);
    heads_per_task = whole_rows ? kv_heads : 1;
    head_tasks = kv_heads / heads_per_task;
    const int64_t wanted = whole_rows ? threads : std::max<int64_t>(1, (2 * threads + kv_heads - 1) / kv_heads);
    int64_t total = 0;
    for (int64_t s = 0; s < seqs; ++s) total += lens[s];
    run_bounds.push_back(0);
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t begin = groups[g], end = groups[g + 1];
      const std::vector<int64_t> seq_costs(lens + begin, lens + end);
      int64_t runs = end - begin;  // without a shared prefix, a run per sequence
      if (group_shared[g] > 0) {
        int64_t tokens = 0;
        for (const int64_t c : seq_costs) tokens += c;
        runs = std::clamp<int64_t>((wanted * tokens + total / 2) / std::max<int64_t>(total, 1), 1, end - begin);
      }
      const std::vector<int64_t> bounds = balanced_runs(seq_costs, runs);
      for (int64_t r = 1; r <= runs; ++r) run_bounds.push_back(begin + bounds[r]);
    }
    const int64_t num_runs = static_cast<int64_t>(run_bounds.size()) - 1;
    for (int64_t r = 0; r < num_runs; ++r) {
      int64_t tokens = 0;
      for (int64_t s = run_bounds[r]; s < run_bounds[r + 1]; ++s) tokens += lens[s];
      run_shared.push_back(any_shared ? shared_of(run_bounds[r], run_bounds[r + 1]) : 0);
      costs.insert(costs.end(), head_tasks, tokens);
    }
  }

  Task at(int64_t task) const {
    const int64_t run = task / head_tasks;
    return {task % head_tasks * heads_per_task, run_bounds[run], run_bounds[run + 1], run_shared[run]};
  }
  // fn(cursor) once per thread, taking task numbers with cursor.next() (parallel_for_by_cost).
  template <typename Fn>
  void run_for_each(const Fn& fn) const { parallel_for_by_cost(costs, fn); }
};

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
#endif

// The inputs both paged-attention entry points take: query and out [tokens, heads, head_dim] with
// contiguous rows, K/V caches [num_blocks, block_size, kv_heads, head_dim] of their dtype (or
// quantized, [..., head_dim + 2] int8/uint8: kv_quant.h), and int32 block tables and lengths for
// num_seqs sequences.
void check_paged_inputs(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                        int64_t num_seqs);

// Decode attention over a bf16, int8 or fp8 cache on AVX512-BF16 / VNNI dot products
// (decode_attention_bf16.cpp), where paged_decode_bf16_supported (cpu_ops.h) says so.
void paged_decode_bf16(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                       double scale);

}  // namespace pagecli
