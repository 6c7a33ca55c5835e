// Entry points of float_panels.cpp: float32 activations times weights kept in panels, in bfloat16 where
// that loses nothing, for float32 models on CPUs without bf16 arithmetic (the avx2 level), bound into
// the extension by bindings.cpp.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "gemm_bf16.h"

#include <tuple>

namespace pagecli {

class GreedyChoices;

// Whether every value of the float32 tensor w is a bfloat16 (the low 16 bits of each are zero), so
// that keeping it in bf16 loses nothing: true of every float32 model converted from a bf16
// checkpoint, the embedded SmolLM2 among them.
bool bf16_exact(const at::Tensor& w);

// Whether this build has the kernel (AVX2 and FMA); without it F32PanelLinear raises.
bool has_bf16_weight_linear();

// One float32 weight [N, K] in 16-column panels (panel_f32.h): in bf16 when its values are all
// bfloat16 (bf16_exact; half the bytes a decode step reads, the same products), else in float32.
// x [..., K] float32 -> [..., N] float32; each output sums its K products in k order in one fp32
// lane, so a row gets the same bits alone or in any batch.
class F32PanelLinear : public PackedProduct {
 public:
  F32PanelLinear(const at::Tensor& w, const c10::optional<at::Tensor>& bias);

  at::Tensor forward(const at::Tensor& x) const override;
  // forward() into y, float32 x [M, K] and y [M, N] (DecodeStep's team: gemm_bf16.h's PackedProduct).
  bool runs_into() const override;
  at::ScalarType into_dtype() const override { return at::kFloat; }
  void forward_into(const at::Tensor& x, at::Tensor& y) const override;
  // float32 x [M, K]: the choices over the float32 outputs.
  std::tuple<at::Tensor, at::Tensor> forward_choosing(const at::Tensor& x) const override;
  // w[ids] [*ids.shape, K] float32, read back from the panels (exact): an embedding table shared
  // with the output layer is then kept only here.
  at::Tensor rows(const at::Tensor& ids) const;

  const at::Tensor& panels() const { return panels_; }
  int64_t out_features() const override { return N_; }
  int64_t in_features() const { return K_; }

 private:
  // forward_into, each tile folded into choices where given.
  void product_into(const at::Tensor& x, at::Tensor& y, GreedyChoices* choices) const;

  at::Tensor panels_;  // [ceil(N / 16), K, 16] bf16 or float32 (layout in float_panels.cpp)
  at::Tensor bias_;    // [N] fp32, or undefined
  int64_t N_, K_;
};

}  // namespace pagecli
