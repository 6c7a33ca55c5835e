// Entry points of pagecli's CPU kernels, one file per concern beside this one (decode_attention.cpp,
// prefill_attention.cpp, linear.cpp, elementwise.cpp; the packed GEMM in gemm_bf16.h, DecodeStep in
// decode_step.h), bound into one Python module by bindings.cpp.
//
// Layouts (see pagecli/attention): cache [num_blocks, block_size, kv_heads, head_dim];
// block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32.

#pragma once

#include <torch/types.h>

#include "simd.h"

namespace pagecli {

// decode_attention.cpp: one query token per sequence, query and out [num_seqs, heads, head_dim];
// the caches in the query's dtype, or int8/fp8 (kv_format.py, decode_attention_tiled.cpp).
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
// How paged_decode_attention splits a step into tasks: (first kv head, first sequence, end sequence,
// shared prefix tokens) per task, for a kernel whose shared prefix is a multiple of share_unit
// tokens (0: none) and that widens every head of a prefix at once or not (the AMX kernel does).
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> decode_task_split(torch::Tensor block_tables, torch::Tensor seq_lens,
                                                                             int64_t block_size, int64_t kv_heads,
                                                                             int64_t share_unit, int64_t threads,
                                                                             bool heads_together);

// decode_attention_bf16.cpp: whether paged_decode_attention runs such query and cache on AVX512-BF16
// dot products (a bf16 query over a bf16 or fp8 cache, or an int8 one where the build has
// AVX512-VNNI; head sizes of 32-256 by 32; a build with AVX512-BF16). The engine then runs prompts
// through it too, a row per token (attention/cpu_backend.py).
bool paged_decode_bf16_supported(const torch::Tensor& query, const torch::Tensor& k_cache);

// kv_quant.cpp: rows [num_tokens, kv_heads, head_dim] (float32/bf16/fp16) into slots [num_tokens] int64
// (-1: skip) of an int8 or fp8 cache [num_blocks, block_size, kv_heads, head_dim + 2], as
// kv_format.quantize_rows writes them.
void store_kv_quantized(torch::Tensor rows, torch::Tensor cache, torch::Tensor slots);

// prefill_attention.cpp: causal attention of prefilling sequences' new tokens (AMX, bf16 caches;
// false from paged_prefill_supported for any other cache, quantized ones included).
bool paged_prefill_supported(const torch::Tensor& query, const torch::Tensor& k_cache);
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start,
                             double scale);

// linear.cpp: products over row-layout weights w [N, K].
torch::Tensor linear_bf16_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
#if PAGECLI_HAVE_AMX
torch::Tensor linear_bf16_amx(torch::Tensor x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
#endif
bool has_amx();
bool has_bf16_linear();
torch::Tensor native_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);

// elementwise.cpp: fused elementwise steps of a decoder layer.
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
// The same two into tensors the caller made and checked (contiguous, matching shapes and dtype):
// h += delta (when not null), out = weight * rms_norm(h); out [rows, inter] = silu(gate) * up.
void add_rms_norm_into(torch::Tensor& h, const torch::Tensor* delta, const torch::Tensor& weight, torch::Tensor& out,
                       double eps);
void silu_mul_into(const torch::Tensor& gate_up, torch::Tensor& out);

// greedy.cpp: per row of logits [rows, vocab], the first index of its largest value (torch.max's).
std::vector<int64_t> greedy_tokens(const torch::Tensor& logits);

// sampling.cpp: per row of logits [rows, vocab], one token drawn after temperature, top-k (0: off), top-p
// (1: off) and min-p (0: off), its uniform numbers from the row's 64-bit random word; -1 where no token
// can be drawn (every logit -inf or NaN). engine/sampler.py states what each filter keeps.
std::vector<int64_t> sample_rows(const torch::Tensor& logits, const std::vector<double>& temperature,
                                 const std::vector<int64_t>& top_k, const std::vector<double>& top_p,
                                 const std::vector<double>& min_p, const std::vector<uint64_t>& random);

}  // namespace pagecli
