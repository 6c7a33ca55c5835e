// DecodeStep (decode_step.h): every layer of a decode-only step, kernel for kernel as the Python
// layer loop runs them.

#include "decode_step.h"

#include "cpu_ops.h"
#include "kv_quant.h"

#include <algorithm>
#include <cstring>

namespace pagecli {
namespace {

// RMSNorm.forward of pagecli.models.layers, op for op (q/k norms of Qwen3).
torch::Tensor rms_norm_like_torch(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto x32 = x.to(torch::kFloat);
  x32 = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * x32.to(x.scalar_type());
}

}  // namespace

DecodeStep::DecodeStep(std::vector<Layer> layers, std::vector<PackedLayer> packed, torch::Tensor final_norm, torch::Tensor cos,
                       torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                       bool team, std::vector<std::shared_ptr<MoeExperts>> moe, bool qk_norm_whole)
    : layers_(std::move(layers)), packed_(std::move(packed)), moe_(std::move(moe)), qk_norm_whole_(qk_norm_whole),
      final_norm_(std::move(final_norm)), cos_(std::move(cos)), sin_(std::move(sin)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
  TORCH_CHECK(packed_.empty() || packed_.size() == layers_.size(), "DecodeStep: packed products for every layer or none");
  TORCH_CHECK(moe_.empty() || moe_.size() == layers_.size(), "DecodeStep: a mixture of experts (or none) for every layer");
  const bool any_experts = std::any_of(moe_.begin(), moe_.end(), [](const auto& m) { return m != nullptr; });
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& layer = layers_[l];
    TORCH_CHECK(layer.size() == 12, "DecodeStep: each layer needs 12 entries");
    for (int i : {0, 7}) TORCH_CHECK(layer[i].has_value(), "DecodeStep: missing weight ", i);
    TORCH_CHECK(packed_.empty() || packed_[l].size() == 4, "DecodeStep: each packed layer needs its 4 entries");
    static constexpr int kWeight[] = {1, 5, 8, 10};
    for (int which = 0; which < (experts(l) ? 2 : 4); ++which) {  // a mixture of experts has no gate_up, down
      TORCH_CHECK((!packed_.empty() && packed_[l][which]) || layer[kWeight[which]].has_value(),
                  "DecodeStep: layer ", l, " has neither a packed product nor a weight for product ", which);
    }
  }
  team_ready_ = team && !packed_.empty() && !any_experts && !qk_norm_whole_;
  if (team_ready_) team_dtype_ = packed_[0][0] ? packed_[0][0]->into_dtype() : at::kBFloat16;
  for (const auto& layer : packed_) {  // every product into memory of one dtype: bf16, or float32 (avx2 level)
    for (const auto& p : layer) team_ready_ = team_ready_ && p && p->runs_into() && p->into_dtype() == team_dtype_;
  }
  if (team_ready_) {  // forward_team sizes its buffers from these
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_, hidden = final_norm_.numel();
    const int64_t inter2 = packed_[0][2]->out_features();
    for (const auto& layer : packed_) {
      const int64_t n[] = {q_size + 2 * kv_size, hidden, inter2, hidden};
      for (int which = 0; which < 4; ++which) {
        TORCH_CHECK(layer[which]->out_features() == n[which], "DecodeStep: a product's shape differs from the model's");
      }
    }
  }
}

torch::Tensor DecodeStep::forward(torch::Tensor h, torch::Tensor positions, torch::Tensor kv_caches, torch::Tensor block_tables,
                                  torch::Tensor seq_lens, torch::Tensor slots) const {
  return run(std::move(h), positions, kv_caches, block_tables, seq_lens, slots, nullptr);
}

torch::Tensor DecodeStep::forward_lora(torch::Tensor h, torch::Tensor positions, torch::Tensor kv_caches,
                                       torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor slots,
                                       std::shared_ptr<LoraStacks> lora, torch::Tensor row_slot,
                                       torch::Tensor row_scale) const {
  TORCH_CHECK(lora && lora->num_layers() == static_cast<int64_t>(layers_.size()),
              "forward_lora: stacks for every layer of the model");
  // Checked here, not in a team's lora_add_ (an error thrown inside the parallel region cannot reach the caller).
  TORCH_CHECK(!lora->dtype() || *lora->dtype() == h.scalar_type(), "forward_lora: rows in the stacks' dtype");
  const LoraRows rows{*lora, row_slot, row_scale};
  return run(std::move(h), positions, kv_caches, block_tables, seq_lens, slots, &rows);
}

torch::Tensor DecodeStep::run(torch::Tensor h, const torch::Tensor& positions, const torch::Tensor& kv_caches,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const torch::Tensor& slots, const LoraRows* lora) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [rows, hidden] tensor");
  const bool quantized = is_quantized_kv(kv_caches.scalar_type());
  TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == static_cast<int64_t>(layers_.size()) &&
                  kv_caches.is_contiguous() && (quantized || kv_caches.scalar_type() == h.scalar_type()),
              "kv_caches must be contiguous [layers, 2, blocks, block_size, kv_heads, head_dim] in h's dtype, "
              "or int8/uint8 [..., head_dim + 2]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == h.size(0),
              "slots must be contiguous int64, one per row");
  const int64_t rows = h.size(0);
  if (runs_as_team(rows) && h.scalar_type() == team_dtype_) {
    return forward_team(h, positions, kv_caches, block_tables, seq_lens, slots, lora);
  }
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  c10::optional<torch::Tensor> delta;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& w = layers_[i];
    auto x = add_rms_norm(h, delta, *w[0], eps_);
    auto qkv = product(i, 0, x);
    if (lora) lora->add(i, 0, x, qkv);
    auto q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
    auto k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
    if (w[3].has_value() && qk_norm_whole_) {  // OLMoE: over the whole projections, then split into heads
      q = rms_norm_like_torch(qkv.narrow(1, 0, q_size), *w[3], eps_).view({rows, num_heads_, head_dim_});
      k = rms_norm_like_torch(qkv.narrow(1, q_size, kv_size), *w[4], eps_).view({rows, num_kv_heads_, head_dim_});
    } else if (w[3].has_value()) {
      q = rms_norm_like_torch(q, *w[3], eps_);
      k = rms_norm_like_torch(k, *w[4], eps_);
    }
    rotary_(q, positions, cos_, sin_);
    rotary_(k, positions, cos_, sin_);
    auto k_cache = kv_caches.select(0, i).select(0, 0);
    auto v_cache = kv_caches.select(0, i).select(0, 1);
    if (quantized) {
      store_kv_quantized(k, k_cache, slots);
      store_kv_quantized(v, v_cache, slots);
    } else {
      store_rows(k, k_cache, slots);
      store_rows(v, v_cache, slots);
    }
    auto attn = torch::empty({rows, num_heads_, head_dim_}, h.options());
    paged_decode_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, scale_);
    delta = product(i, 1, attn.view({rows, q_size}));
    if (lora) lora->add(i, 1, attn.view({rows, q_size}), *delta);
    x = add_rms_norm(h, delta, *w[7], eps_);
    if (const MoeExperts* moe = experts(i)) {  // adapters of a mixture of experts target attention only
      delta = moe->forward(x);
      continue;
    }
    auto gate_up = product(i, 2, x);
    if (lora) lora->add(i, 2, x, gate_up);
    auto act = silu_mul(gate_up);
    delta = product(i, 3, act);
    if (lora) lora->add(i, 3, act, *delta);
  }
  return add_rms_norm(h, delta, final_norm_, eps_);
}


torch::Tensor DecodeStep::forward_team(torch::Tensor& h, const torch::Tensor& positions, const torch::Tensor& kv_caches,
                                       const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                       const torch::Tensor& slots, const LoraRows* lora) const {
  const int64_t rows = h.size(0), hidden = h.size(1);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const int64_t inter = packed_[0][2]->out_features() / 2;
  const bool quantized = is_quantized_kv(kv_caches.scalar_type());
  // Everything a layer writes, made once: x (a norm's output), qkv, attn, delta (what attention or
  // the MLP adds to h), gate_up, act (silu(gate) * up).
  auto x = torch::empty({rows, hidden}, h.options());
  auto qkv = torch::empty({rows, q_size + 2 * kv_size}, h.options());
  auto attn = torch::empty({rows, q_size}, h.options());
  auto delta = torch::empty({rows, hidden}, h.options());
  auto gate_up = torch::empty({rows, 2 * inter}, h.options());
  auto act = torch::empty({rows, inter}, h.options());
  auto out = torch::empty({rows, hidden}, h.options());
  auto q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
  auto k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
  auto attn3 = attn.view({rows, num_heads_, head_dim_});
  std::vector<torch::Tensor> k_caches, v_caches;
  for (int64_t i = 0; i < kv_caches.size(0); ++i) {
    auto layer = kv_caches.select(0, i);
    k_caches.push_back(layer.select(0, 0));
    v_caches.push_back(layer.select(0, 1));
  }
  run_team([&](Team& team, int64_t rank) {
    auto on_rank0 = [&](auto&& step) {  // a step of the layer that one thread does, the team then in step
      if (rank == 0) step();
      team.barrier();
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& w = layers_[i];
      const PackedLayer& p = packed_[i];
      on_rank0([&] { add_rms_norm_into(h, i == 0 ? nullptr : &delta, *w[0], x, eps_); });
      p[0]->forward_into(x, qkv);
      if (lora) lora->add(i, 0, x, qkv);  // every member: the adds share their work like a product's
      on_rank0([&] {
        if (w[3].has_value()) {  // Qwen3's q/k norms, as the Python layer computes them, into qkv
          q.copy_(rms_norm_like_torch(q, *w[3], eps_));
          k.copy_(rms_norm_like_torch(k, *w[4], eps_));
        }
        rotary_(q, positions, cos_, sin_);
        rotary_(k, positions, cos_, sin_);
        if (quantized) {
          store_kv_quantized(k, k_caches[i], slots);
          store_kv_quantized(v, v_caches[i], slots);
        } else {
          store_rows(k, k_caches[i], slots);
          store_rows(v, v_caches[i], slots);
        }
      });
      paged_decode_attention(attn3, q, k_caches[i], v_caches[i], block_tables, seq_lens, scale_);
      p[1]->forward_into(attn, delta);
      if (lora) lora->add(i, 1, attn, delta);
      on_rank0([&] { add_rms_norm_into(h, &delta, *w[7], x, eps_); });
      p[2]->forward_into(x, gate_up);
      if (lora) lora->add(i, 2, x, gate_up);
      on_rank0([&] { silu_mul_into(gate_up, act); });
      p[3]->forward_into(act, delta);
      if (lora) lora->add(i, 3, act, delta);
    }
    on_rank0([&] { add_rms_norm_into(h, &delta, final_norm_, out, eps_); });
  });
  return out;
}

torch::Tensor DecodeStep::product(size_t layer, int which, const torch::Tensor& x) const {
  if (!packed_.empty() && packed_[layer][which]) return packed_[layer][which]->forward(x);
  static constexpr int kWeight[] = {1, 5, 8, 10};
  const Layer& w = layers_[layer];
  return native_linear(x, *w[kWeight[which]], w[kWeight[which] + 1]);
}

void DecodeStep::store_rows(const torch::Tensor& rows, torch::Tensor& cache, const torch::Tensor& slots) const {
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == head_dim_, "k/v rows must be contiguous per token");
  const int64_t row_bytes = num_kv_heads_ * head_dim_ * rows.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = cache.size(0) * cache.size(1);
  char* base = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < rows.size(0); ++t) {
    if (sp[t] < 0) continue;
    TORCH_CHECK(sp[t] < num_slots, "slot out of range");
    std::memcpy(base + sp[t] * row_bytes, src + t * rows.stride(0) * rows.element_size(), row_bytes);
  }
}

}  // namespace pagecli
