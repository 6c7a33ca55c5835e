// MoeExperts (moe_experts.h): SparseMoE.forward of pagecli.models.moe in C++, tensor op for tensor op, so
// the one-call decode step gives the Python layer loop's bits.

#include "moe_experts.h"

#include "cpu_ops.h"

#include <algorithm>
#include <numeric>

namespace pagecli {

MoeExperts::MoeExperts(std::shared_ptr<PackedProduct> router, c10::optional<torch::Tensor> router_weight,
                       std::vector<std::shared_ptr<PackedProduct>> gate_up,
                       std::vector<std::shared_ptr<PackedProduct>> down, int64_t top_k, bool norm_topk_prob)
    : router_(std::move(router)), router_weight_(std::move(router_weight)), gate_up_(std::move(gate_up)),
      down_(std::move(down)), top_k_(top_k), norm_topk_prob_(norm_topk_prob) {
  TORCH_CHECK(router_ || router_weight_.has_value(), "MoeExperts: a router product or weight");
  TORCH_CHECK(!gate_up_.empty() && gate_up_.size() == down_.size(), "MoeExperts: gate_up and down for every expert");
  for (size_t e = 0; e < gate_up_.size(); ++e) {
    TORCH_CHECK(gate_up_[e] && down_[e], "MoeExperts: expert ", e, " needs packed products");
  }
  TORCH_CHECK(top_k_ >= 1 && top_k_ <= static_cast<int64_t>(gate_up_.size()), "MoeExperts: top_k out of range");
}

torch::Tensor MoeExperts::expert(size_t e, const torch::Tensor& x) const {
  return down_[e]->forward(silu_mul(gate_up_[e]->forward(x)));
}

torch::Tensor MoeExperts::forward(const torch::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2, "MoeExperts: x must be [rows, hidden]");
  // route(): softmax over every expert in float32, the top k, renormalised, in x's dtype.
  const auto logits = router_ ? router_->forward(x) : native_linear(x, *router_weight_, c10::nullopt);
  const auto probs = at::softmax(logits.to(at::kFloat), -1);
  auto [weights, chosen] = at::topk(probs, top_k_, -1);
  if (norm_topk_prob_) weights = weights / weights.sum(-1, /*keepdim=*/true);
  weights = weights.to(x.scalar_type());
  if (x.size(0) == 1) {  // _one_token: the k experts on the one row, added in expert order
    const auto picked = chosen.contiguous();
    const int64_t* ids = picked.data_ptr<int64_t>();
    std::vector<int64_t> slots(top_k_);
    std::iota(slots.begin(), slots.end(), 0);
    std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    torch::Tensor out;
    for (const int64_t slot : slots) {
      auto y = expert(static_cast<size_t>(ids[slot]), x) * weights.narrow(1, slot, 1);
      if (out.defined()) out.add_(y); else out = y;
    }
    return out;
  }
  const auto pairs = chosen.flatten();  // pair p is row p / top_k's choice
  const auto order = at::argsort(pairs, /*stable=*/true);  // the pairs grouped by expert
  const auto counts = at::bincount(pairs, {}, static_cast<int64_t>(gate_up_.size())).contiguous();
  const auto tokens = at::div(order, top_k_, "floor");
  const auto rows = x.index({tokens});  // [pairs, hidden], each expert's group contiguous
  std::vector<torch::Tensor> outputs;
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t start = 0;
  for (size_t e = 0; e < gate_up_.size(); ++e) {
    if (count[e] == 0) continue;  // an expert no row chose is never read
    outputs.push_back(expert(e, rows.narrow(0, start, count[e])));
    start += count[e];
  }
  const auto grouped = at::cat(outputs) * weights.flatten().index({order}).unsqueeze(1);
  return at::zeros_like(x).index_add_(0, tokens, grouped);
}

}  // namespace pagecli
