// A whole decode step in one call: the layer loop of CausalLM.forward in C++ (decode_step.cpp).

#pragma once

#include <torch/types.h>

#include "gemm_bf16.h"
#include "lora_add.h"
#include "moe_experts.h"

#include <memory>
#include <vector>

namespace pagecli {

// A step's adapter rows: the loaded adapters' stacks, each row's slot (-1: the base) and scale.
struct LoraRows {
  const LoraStacks& stacks;
  const torch::Tensor& row_slot;
  const torch::Tensor& row_scale;
  void add(size_t layer, int which, const torch::Tensor& x, const torch::Tensor& out) const {
    stacks.add(static_cast<int64_t>(layer), which, x, out, row_slot, row_scale);
  }
};

// ---- A whole decode step in one call ------------------------------------------------------------
// CausalLM.forward in Python makes about fifteen small calls per layer. For one chat stream that
// is a few ms of interpreter and dispatch per token, and the pauses let the second OpenMP thread
// go to sleep between products. DecodeStep runs the same layer, kernel for kernel and in the same
// order (so its results are bit-identical to the Python loop), for steps where every sequence
// decodes one token. Weights are held by reference, as pagecli.models.weight_forms placed them.
class DecodeStep {
 public:
  // Per layer, in this order (None where the model has no such tensor): input norm, qkv weight, qkv
  // bias, q norm, k norm, o weight, o bias, post-attention norm, gate_up weight, gate_up bias, down
  // weight, down bias.
  using Layer = std::vector<c10::optional<torch::Tensor>>;
  // Per layer, the four products (qkv, o, gate_up, down) packed at load (PackedLinear,
  // PackedLinearInt8 with --quantize int8, F32PanelLinear for float32 models at the avx2 level);
  // their weights and biases in Layer are then None. A null product, or an empty list: that product
  // by native_linear over Layer's weights.
  using PackedLayer = std::vector<std::shared_ptr<PackedProduct>>;

  // team: run steps of up to kTeamRows rows in one parallel region where the products allow
  // (forward_team below; pagecli.models.weight_plan.decode_team_wanted, PAGECLI_DECODE_TEAM).
  // moe: empty, or per layer its mixture of experts in place of the gated MLP (null: a dense layer,
  // whose gate_up and down are in Layer/PackedLayer; a mixture's are not); a step with experts runs
  // kernel by kernel (run), not as a team. qk_norm_whole: the q/k norms (Layer entries 3, 4) are over
  // the whole q and k projections before they are split into heads (OLMoE), else over each head.
  DecodeStep(std::vector<Layer> layers, std::vector<PackedLayer> packed, torch::Tensor final_norm, torch::Tensor cos,
             torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
             bool team, std::vector<std::shared_ptr<MoeExperts>> moe = {}, bool qk_norm_whole = false);

  // h [rows, hidden] (the embeddings; used as the residual stream), positions [rows] int64,
  // kv_caches [layers, 2, blocks, block_size, kv_heads, head_dim] in h's dtype, or int8/fp8
  // [..., head_dim + 2] (kv_format.py: stored by store_kv_quantized), block_tables/seq_lens as for
  // paged_decode_attention, slots [rows] int64 (-1: do not store). Returns the final norm's output.
  torch::Tensor forward(torch::Tensor h, torch::Tensor positions, torch::Tensor kv_caches, torch::Tensor block_tables,
                        torch::Tensor seq_lens, torch::Tensor slots) const;

  // forward() with LoRA adapter rows: after each product, the rows of row_slot >= 0 gain their adapter's
  // low-rank product from `lora` (lora_add.h), as the Python layer loop adds them (h in the stacks' dtype:
  // float32, bf16 or fp16).
  torch::Tensor forward_lora(torch::Tensor h, torch::Tensor positions, torch::Tensor kv_caches,
                             torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor slots,
                             std::shared_ptr<LoraStacks> lora, torch::Tensor row_slot, torch::Tensor row_scale) const;

  // Whether forward() runs a step of `rows` rows as one team (forward_team below), given h in the
  // products' dtype (bf16 with the packed GEMM; float32 on F32PanelLinear and the AVX2 quantized products).
  bool runs_as_team(int64_t rows) const { return team_ready_ && rows <= kTeamRows; }

 private:
  // Product `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`, as the Python layer runs it.
  torch::Tensor product(size_t layer, int which, const torch::Tensor& x) const;

  // forward() for up to kTeamRows rows when every product runs_into(): the same kernels in the same
  // order, in one parallel region (run_team, work_share.h) over buffers made once per call. The
  // products and attention share out their units among the team; norms, rotary, the cache stores
  // and SiLU run on rank 0 while the others wait at a barrier. For one stream this takes the ~150
  // forks and joins and the ~25 tensor allocations and dispatches per layer out of every token.
  torch::Tensor forward_team(torch::Tensor& h, const torch::Tensor& positions, const torch::Tensor& kv_caches,
                             const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                             const torch::Tensor& slots, const struct LoraRows* lora) const;
  torch::Tensor run(torch::Tensor h, const torch::Tensor& positions, const torch::Tensor& kv_caches,
                    const torch::Tensor& block_tables, const torch::Tensor& seq_lens, const torch::Tensor& slots,
                    const struct LoraRows* lora) const;
  static constexpr int64_t kTeamRows = 8;
  bool team_ready_ = false;  // every layer packed, every product runs_into() team_dtype_
  at::ScalarType team_dtype_ = at::kBFloat16;  // the products' into_dtype(): bf16, or float32 at the avx2 level

  // cache slot slots[t] of [blocks, block_size, kv_heads, head_dim] = rows[t] (an index_copy_).
  void store_rows(const torch::Tensor& rows, torch::Tensor& cache, const torch::Tensor& slots) const;

  // Layer i's mixture of experts, or null (a dense layer).
  const MoeExperts* experts(size_t i) const { return moe_.empty() ? nullptr : moe_[i].get(); }

  std::vector<Layer> layers_;
  std::vector<PackedLayer> packed_;
  std::vector<std::shared_ptr<MoeExperts>> moe_;
  bool qk_norm_whole_ = false;
  torch::Tensor final_norm_, cos_, sin_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace pagecli
