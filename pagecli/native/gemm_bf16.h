// Entry points of gemm_bf16.cpp (a bf16 GEMM over weights packed once at load), bound into the
// extension by cpu_ops.cpp's module.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace pagecli {

// w [N, K] bf16 contiguous -> the packed panels linear_bf16_packed reads (layout in gemm_bf16.cpp):
// bf16 [ceil(N / 48), ceil(K / 2), 48, 2], zero where N or K is padded.
at::Tensor pack_bf16_weights(const at::Tensor& w);

// y [M, N] bf16 = x [M, K] @ w^T (+ bias) for any M >= 1, from pack_bf16_weights(w). Each output
// element is summed in the same order whatever M, its row's place in x, or the thread count.
at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t N, int64_t K);

// Whether this build has the kernel (AVX512-BF16); without it the two functions above raise.
bool has_packed_linear();

}  // namespace pagecli
