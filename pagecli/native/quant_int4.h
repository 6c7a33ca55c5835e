// Entry points of quant_int4.cpp: bf16 (or fp32 on AVX2) activations times 4-bit weights in groups
// of 32 along K, each group with an fp16 scale and an fp16 minimum (the Q4_1 family; Q4_0 is the
// case min = -8 * scale). Packed once at load; bound into the extension by bindings.cpp.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "gemm_bf16.h"

#include <cstdint>

namespace pagecli {

constexpr int64_t kInt4Group = 32;  // weights per group along K: one scale and one minimum each

// One Linear's weight in 4 bits: q [N, K] uint8 in [0, 15], scale and min [N, ceil(K / 32)] fp16,
// w[n, k] = q[n, k] * scale[n, g] + min[n, g] with g = k / 32 (pagecli.models.quantize_int4 makes
// them; GGUF Q4_0/Q4_1 blocks map onto them as they are). The product, per output:
// y[m, n] = sum over groups g of (scale[n, g] * sum_k x[m, k] q[n, k] + min[n, g] * sum_k x[m, k]) + bias[n],
// every sum in fp32, groups in order, so a row's result never depends on its batch.
//  - AVX512-BF16 builds: per (panel of 48 columns, group) one 960-byte block: 48 fp16 scales,
//    48 fp16 minimums, then the 4-bit weights; nibbles are turned into bf16 in registers with a
//    16-entry table (vpermw: exact, q <= 15) and multiplied with vdpbf16ps (exact products);
//  - AVX2 builds: rows as they lie, 16 bytes per group (byte i: q[32 g + i] | q[32 g + 16 + i] << 4),
//    widened to fp32 and multiplied with FMA.
class PackedLinearInt4 : public PackedProduct {
 public:
  PackedLinearInt4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& min,
                   const c10::optional<at::Tensor>& bias);

  // x [..., K] (bf16, or bf16/fp32 on AVX2) -> [..., N] in x's dtype.
  at::Tensor forward(const at::Tensor& x) const override;

  const at::Tensor& weights() const { return weights_; }  // the packed blocks (uint8)
  // AVX2: the (scale, min) pairs kept beside the rows; AVX512-BF16: empty (inside the blocks).
  at::Tensor scales() const;
  int64_t out_features() const { return N_; }
  int64_t in_features() const { return K_; }

 private:
  at::Tensor weights_;     // uint8: panel blocks (AVX512-BF16), or [N, groups * 16] (AVX2)
  at::Tensor scale_min_;   // AVX2 only: [N, groups, 2] fp32 (scale, min); undefined on AVX512-BF16
  at::Tensor bias_;        // [ceil(N / 48) * 48] fp32, zero past N; undefined without bias
  int64_t N_, K_;
};

// Which kernel this build runs: "avx512_bf16", "avx2", or "" (none: the constructor raises).
const char* int4_linear_kind();

}  // namespace pagecli
