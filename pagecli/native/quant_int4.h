// Entry points of quant_int4.cpp: activations times 4-bit weights in groups of 32 along K, each group with an fp16 scale and an fp16 minimum (the Q4_1 family; Q4_0 is the
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
//  - AVX512-VNNI builds: per (panel of 48 columns, group) one 960-byte block: 48 fp16 scales,
//    48 fp16 minimums, then the 4-bit weights, multiplied as vpdpbusd's unsigned bytes by the
//    activations rounded to int8 per 64-block (act_quant.h): per group
//    y += d * (scale * sum(xq * q) + min * sum(xq)), each group's integer sums exact (layout in
//    quant_int4.cpp; pagecli.models.quantize_int4.int4_blocks_reference is this in PyTorch);
//  - AVX512-VNNI builds with int16_activations (float32 models): the same panel blocks, the
//    activations rounded to int16 per 64-block with 32639 levels and kept as two int8 halves
//    (xq = 256 hi + lo, act_quant.h's WideRows), two vpdpbusd sums per group combined exactly
//    (the "wide" tiles, kind avx512_vnni_i16; int4_blocks_reference with levels=32639);
//  - AVX2 (builds without VNNI): 16-column panels of nibbles in k pairs, widened to int16 and
//    multiplied with vpmaddwd by the activations rounded to int16 per 64-block (panel_i16.h), the
//    same per-group formula with int16 xq (int4_blocks_reference with levels=32767; layout in
//    quant_int4.cpp).
class PackedLinearInt4 : public PackedProduct {
 public:
  // int16_activations: activations rounded to int16 (the wide VNNI tiles, or the AVX2 kernel where
  // the build has no VNNI); float32 models ask for it, so their products stay within 2^-16 of float math.
  PackedLinearInt4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& min,
                   const c10::optional<at::Tensor>& bias, bool int16_activations = false);

  // x [..., K] (float32, bf16 or fp16) -> [..., N] in x's dtype.
  at::Tensor forward(const at::Tensor& x) const override;
  // The wide or AVX2 kernel into y, float32 x [M, K] and y [M, N] (DecodeStep's team: gemm_bf16.h's PackedProduct).
  bool runs_into() const override;
  at::ScalarType into_dtype() const override { return at::kFloat; }
  void forward_into(const at::Tensor& x, at::Tensor& y) const override;

  const at::Tensor& weights() const { return weights_; }  // the packed blocks (uint8)
  // AVX2: the (scale, min) pairs kept beside the rows; AVX512-VNNI: empty (inside the blocks).
  at::Tensor scales() const;
  int64_t out_features() const override { return N_; }
  int64_t in_features() const { return K_; }
  const char* kind() const;  // the kernel this layer runs: "avx512_vnni", "avx512_vnni_i16" or "avx2"

 private:
  at::Tensor weights_;     // uint8: panel blocks (AVX512-VNNI), or nibble pair panels [ceil(N / 16), Kp / 2, 16] (AVX2)
  at::Tensor scale_min_;   // AVX2 only: fp16 [ceil(N / 16), Kp / 32, 2, 16]; undefined on AVX512-VNNI
  at::Tensor bias_;        // [ceil(N / 48) * 48] fp32, zero past N; undefined without bias
  int64_t N_, K_;
  bool vnni_;  // the VNNI kernel and its panel blocks, else the AVX2 one over the packed rows
  bool wide_;  // on the VNNI panel blocks, activations rounded to int16 (the wide tiles), not int8
};

// Which kernel this build runs: "avx512_vnni", "avx2", or "" (none: the constructor raises).
const char* int4_linear_kind();

}  // namespace pagecli
