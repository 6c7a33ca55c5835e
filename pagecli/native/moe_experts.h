// A mixture of experts' MLP in C++ (moe_experts.cpp): SparseMoE.forward of pagecli.models.moe, op for op,
// for the one-call decode step (decode_step.h).

#pragma once

#include <torch/types.h>

#include "gemm_bf16.h"

#include <memory>
#include <vector>

namespace pagecli {

// One layer's router and experts, as pagecli.models.weight_forms placed them: the router a packed product
// (panels) or its row-layout weight, each expert's gate_up and down products packed (int8, int4, a GGUF
// file's blocks, panels). forward() is SparseMoE.forward with the same kernels in the same order: the
// router's softmax in float32, the top k, renormalised where norm_topk_prob; a lone row adds its k experts
// in expert order; several rows are grouped by expert (a stable sort of the (row, expert) pairs) so each
// chosen expert runs once on its group and one that no row chose is never read.
class MoeExperts {
 public:
  MoeExperts(std::shared_ptr<PackedProduct> router, c10::optional<torch::Tensor> router_weight,
             std::vector<std::shared_ptr<PackedProduct>> gate_up, std::vector<std::shared_ptr<PackedProduct>> down,
             int64_t top_k, bool norm_topk_prob);

  // x [rows, hidden] -> [rows, hidden] in x's dtype.
  torch::Tensor forward(const torch::Tensor& x) const;

 private:
  // One expert's gated MLP (GatedMLP.forward with the native SiLU): down(silu(gate) * up).
  torch::Tensor expert(size_t e, const torch::Tensor& x) const;

  std::shared_ptr<PackedProduct> router_;
  c10::optional<torch::Tensor> router_weight_;
  std::vector<std::shared_ptr<PackedProduct>> gate_up_, down_;
  int64_t top_k_;
  bool norm_topk_prob_;
};

}  // namespace pagecli
