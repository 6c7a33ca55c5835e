// LoRA adapters' low-rank adds over a step's rows, grouped by adapter (lora_add.cpp).

#pragma once

#include <torch/types.h>

#include <vector>

namespace pagecli {

// out[r] += row_scale[r] * (x[r] @ a[s].T) @ b[s] for every row r whose slot s = row_slot[r] >= 0 (rows of
// slot -1 run the base model alone). x [rows, in] and out [rows, out] (out changed in place), a [slots, rank,
// in] and b [slots, rank, out] contiguous (the loaded adapters' stacks, pagecli.models.lora_slots), all four of
// one dtype: float32, bfloat16 or float16 (sums in float32, each output rounded once to the dtype); row_slot
// [rows] int64, row_scale [rows] float32. Each row's sums run in
// one fixed order whatever the other rows are and however the threads share the work, so a request
// gets the same bits in any batch, in the one-call decode step and in the Python layer loop alike.
// Inside a DecodeStep team every member calls it (the work is shared out among them). tile_rank: null, or per
// 64-column tile of out the [first, end) of b's rank rows with a nonzero there (LoraStacks' bf16/fp16 stacks):
// the up products over that tile run those rows only.
void lora_add_(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
               const torch::Tensor& row_slot, const torch::Tensor& row_scale, const int32_t* tile_rank = nullptr);

// The loaded adapters' stacks per layer and product (qkv, o, gate_up, down), as lora_add_ takes them;
// an undefined pair where no loaded adapter targets that product.
class LoraStacks {
 public:
  // Per layer, 8 entries: a and b of qkv, o, gate_up, down (None where no adapter targets it).
  explicit LoraStacks(std::vector<std::vector<c10::optional<torch::Tensor>>> layers);

  // lora_add_ with layer `layer`'s product `which` (0 qkv, 1 o, 2 gate_up, 3 down); nothing where untargeted.
  void add(int64_t layer, int64_t which, const torch::Tensor& x, torch::Tensor out, const torch::Tensor& row_slot,
           const torch::Tensor& row_scale) const;

  int64_t num_layers() const { return static_cast<int64_t>(a_.size()); }
  // The stacks' dtype (the rows lora_add_ takes with them); none where no product is targeted.
  c10::optional<at::ScalarType> dtype() const { return dtype_; }

 private:
  std::vector<std::vector<torch::Tensor>> a_, b_;  // [layer][which], undefined where untargeted
  std::vector<std::vector<std::vector<int32_t>>> tile_rank_;  // [layer][which]: lora_add_'s tile_rank, or empty
  c10::optional<at::ScalarType> dtype_;
};

}  // namespace pagecli
