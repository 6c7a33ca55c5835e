// Entry points of quant_int8.cpp: bf16 activations times int8 weights (symmetric, one scale per
// output channel), packed once at load; bound into the extension by bindings.cpp.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "gemm_bf16.h"

#include <cstdint>

namespace pagecli {

// One Linear's weight quantized to int8 at load: q [N, K] int8 and scale [N] fp32 with
// w[n, k] ~= q[n, k] * scale[n] (pagecli.models.quantize makes them), and the bias.
// y[m, n] = (sum over k of x[m, k] * q[n, k]) * scale[n] + bias[n], the sum in fp32.
//  - AVX512-BF16 builds: q packed like the bf16 GEMM's panels, [ceil(N / 48), ceil(K / 2), 48, 2]
//    int8, widened to bf16 in registers (exact: |q| <= 127) and multiplied with vdpbf16ps, so every
//    product is exact and each output sums its k pairs in order whatever the batch (the same bits
//    for a row alone or in any batch, as the bf16 GEMM);
//  - AVX2 builds: q as it lies, widened to fp32 and multiplied with FMA, 8 k at a time per lane;
//    a row's sum order does not depend on its batch either.
class PackedLinearInt8 : public PackedProduct {
 public:
  PackedLinearInt8(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& bias);

  // x [..., K] (bf16, or fp32 on AVX2) -> [..., N] in x's dtype.
  at::Tensor forward(const at::Tensor& x) const override;

  const at::Tensor& weights() const { return weights_; }  // the packed (or row-layout) int8 weights
  int64_t out_features() const { return N_; }
  int64_t in_features() const { return K_; }

 private:
  at::Tensor weights_;  // int8: packed panels (AVX512-BF16) or [N, K] (AVX2)
  at::Tensor scale_;    // [ceil(N / 48) * 48] fp32, zero past N
  at::Tensor bias_;     // [ceil(N / 48) * 48] fp32, zero past N; undefined without bias
  int64_t N_, K_;
};

// Which kernel this build runs: "avx512_bf16", "avx2", or "" (none: the constructor raises).
const char* int8_linear_kind();

}  // namespace pagecli
