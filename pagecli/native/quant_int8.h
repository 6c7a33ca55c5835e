// Entry points of quant_int8.cpp: bf16 activations times int8 weights (symmetric, one scale per
// output channel), packed once at load; bound into the extension by bindings.cpp.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "gemm_bf16.h"

#include <cstdint>
#include <tuple>

namespace pagecli {

class GreedyChoices;

// One Linear's weight quantized to int8 at load: q [N, K] int8 and scale [N, ceil(K / 64)] bf16 with
// w[n, k] ~= q[n, k] * scale[n, k / 64] (pagecli.models.quantize makes them), and the bias.
//  - AVX512-VNNI builds: each call rounds x to int8 in blocks of 64 along k (a scale per row and
//    block), sums each block's products exactly in int32 with vpdpbusd over weights packed once
//    ([ceil(N / 48), Kp / 4, 48, 4] uint8 of q + 128, Kp = K rounded up to 64), multiplies each
//    block's sum by its two scales, adds the blocks in order in fp32, plus the bias (layout in
//    quant_int8.cpp; pagecli.models.quantize.int8_blocks_reference is this arithmetic in PyTorch).
//    x may be float32, bf16 or fp16; the same bits for a row alone or in any batch;
//  - AVX2 (any build with AVX2, for int16_activations on VNNI ones): x rounded to int16 per row and
//    64-block, q in 16-column panels in k pairs widened to int16, each block's sums in int32 with
//    vpmaddwd, then the same block formula (panel_i16.h; int8_blocks_reference with levels=32767);
//    a row gets the same bits alone or in any batch there too.
// GGUF's Q8_0 blocks run as they lie on the AVX2 kernel: q [N, K] int8 and an fp16 scale per 32 along
// k ([N, ceil(K / 32)]; the scale's dtype says which), w = q * scale.
constexpr int64_t kQ8Block = 32;

class PackedLinearInt8 : public PackedProduct {
 public:
  // int16_activations: the AVX2 kernel (activations rounded to int16) even where the build has
  // VNNI; float32 models ask for it, so their products stay within 2^-16 of float math.
  PackedLinearInt8(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                   bool int16_activations = false);

  // x [..., K] -> [..., N] in x's dtype.
  at::Tensor forward(const at::Tensor& x) const override;
  // The AVX2 kernel into y, float32 x [M, K] and y [M, N] (DecodeStep's team: gemm_bf16.h's PackedProduct).
  bool runs_into() const override;
  at::ScalarType into_dtype() const override { return at::kFloat; }
  void forward_into(const at::Tensor& x, at::Tensor& y) const override;
  // x [M, K] on the VNNI kernel (any float dtype), or float32 on the AVX2 one: the choices over the
  // outputs as stored.
  std::tuple<at::Tensor, at::Tensor> forward_choosing(const at::Tensor& x) const override;

  const at::Tensor& weights() const { return weights_; }  // the packed (or row-layout) int8 weights
  int64_t out_features() const override { return N_; }
  int64_t in_features() const { return K_; }
  const at::Tensor& scales() const { return scale_; }  // the weight scales as the kernel reads them
  const char* kind() const;  // the kernel this layer runs: "avx512_vnni" or "avx2"

 private:
  // forward_into on the AVX2 kernel, each tile folded into choices where given.
  void product16_into(const at::Tensor& x, at::Tensor& y, GreedyChoices* choices) const;

  at::Tensor weights_;  // uint8 packed panels (AVX512-VNNI) or int8 [ceil(N / 16), Kp / 2, 32] pair panels (AVX2)
  at::Tensor scale_;    // bf16 [ceil(N / 48), Kp / 64, 48] (AVX512-VNNI) or [ceil(N / 16), Kp / 64, 16] (AVX2), zero past N
  at::Tensor bias_;     // [ceil(N / 48) * 48] fp32, zero past N; undefined without bias
  int64_t N_, K_;
  bool vnni_;  // the VNNI kernel and its packed layout, else the AVX2 one (panel_i16.h)
  bool q8_0_ = false;  // fp16 scales per 32 (GGUF Q8_0 blocks as they lie; AVX2 kernel only)
};

// Which kernel this build runs: "avx512_vnni", "avx2", or "" (none: the constructor raises).
const char* int8_linear_kind();

}  // namespace pagecli
