// Entry points of gemm_bf16.cpp (a bf16 GEMM over weights packed once at load), bound into the
// extension by bindings.cpp.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Optional.h>

#include "work_share.h"

#include <algorithm>
#include <cstdint>
#include <tuple>

namespace pagecli {

constexpr int64_t kPackedPanelCols = 48;  // output columns per panel of the packed layouts (bf16, int8)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How both packed kernels share out a product: a work unit is (panel, group of row blocks), a thread's
// units are consecutive. Up to 4 row blocks, or when the panels alone keep every thread busy, one group
// (one reader per panel: the weights' memory stream dominates); otherwise enough groups for about 4
// units per thread.
struct RowGroups {
  int64_t count;             // groups the row blocks split into
  int64_t blocks_per_group;  // row blocks in each group but the last
};

inline RowGroups split_row_blocks(int64_t num_panels, int64_t row_blocks) {
  const int64_t wanted_units = 4 * work_threads();
  int64_t groups = 1;
  if (row_blocks > 4 && num_panels < wanted_units) groups = std::min(row_blocks, ceil_div(wanted_units, num_panels));
  const int64_t blocks_per_group = ceil_div(row_blocks, groups);
  return {ceil_div(row_blocks, blocks_per_group), blocks_per_group};
}

// A per-column vector [N] (scales, biases) as fp32 [ceil(N / 48) * 48], zero past N: read a panel at a time.
inline at::Tensor padded_fp32(const at::Tensor& v, int64_t N) {
  auto padded = v.new_zeros({ceil_div(N, kPackedPanelCols) * kPackedPanelCols}, v.options().dtype(at::kFloat));
  padded.narrow(0, 0, N).copy_(v);
  return padded;
}

// The panel layout both packed kernels stream: src [N, K] row-major -> dst [ceil(N / 48), ceil(K / 2), 48, 2]
// with dst[p, j, c, h] = src[48 p + c, 2 j + h]. dst must come zeroed: padding past N or K stays zero.
template <typename T>
void pack_into_panels(const T* src, T* dst, int64_t N, int64_t K) {
  const int64_t num_panels = ceil_div(N, kPackedPanelCols), k_pairs = ceil_div(K, 2);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPackedPanelCols && p * kPackedPanelCols + c < N; ++c) {
        const T* row = src + (p * kPackedPanelCols + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[((p * k_pairs + k / 2) * kPackedPanelCols + c) * 2 + k % 2] = row[k];
      }
    }
  });
}

// w [N, K] bf16 contiguous -> the packed panels linear_bf16_packed reads (layout in gemm_bf16.cpp):
// bf16 [ceil(N / 48), ceil(K / 2), 48, 2], zero where N or K is padded.
at::Tensor pack_bf16_weights(const at::Tensor& w);

// y [M, N] bf16 = x [M, K] @ w^T (+ bias) for any M >= 1, from pack_bf16_weights(w). Each output
// element is summed in the same order whatever M, its row's place in x, or the thread count.
at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t N, int64_t K);

// Whether this build has the kernel (AVX512-BF16); without it the functions here raise.
bool has_packed_linear();

// w[ids] [*ids.shape, K] read back from pack_bf16_weights(w) (exact copies): an embedding table
// kept only in the packed layout, for a model whose output layer shares it.
at::Tensor gather_packed_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t N, int64_t K);

// A Linear whose weights were put into a kernel's own layout at load (PackedLinear here,
// PackedLinearInt8 in quant_int8.h): what DecodeStep and the Python Linear call.
class PackedProduct {
 public:
  virtual ~PackedProduct() = default;
  // x [..., K] -> x @ w^T (+ bias) [..., N]
  virtual at::Tensor forward(const at::Tensor& x) const = 0;
  virtual int64_t out_features() const = 0;  // N
  // Whether forward_into runs: y [M, N] = x [M, K] @ w^T (+ bias), both contiguous, of those shapes
  // and in into_dtype() (the caller checks), computed without allocating a tensor and through
  // parallel_shared only, so a Team's members can run it together (work_share.h).
  virtual bool runs_into() const { return false; }
  virtual at::ScalarType into_dtype() const { return at::kBFloat16; }
  virtual void forward_into(const at::Tensor& x, at::Tensor& y) const;
  // forward() of x [M, K] with each row's greedy choice taken as the kernel stores its tiles
  // (greedy_choices.h): (y [M, N], choices int64 [M], greedy_tokens' choices over y). choices is
  // undefined where the kernel does not take them for this x (then y is forward()'s, and the caller
  // makes its own pass).
  virtual std::tuple<at::Tensor, at::Tensor> forward_choosing(const at::Tensor& x) const;

 protected:
  // forward() of a product whose forward_into runs: x2 [M, K] (any float dtype, converted to
  // into_dtype() where it differs) -> y [M, N] in x2's dtype.
  at::Tensor forward_via_into(const at::Tensor& x2) const;
};

// One bf16 weight [N, K] (and bias) packed once at load: the engine's form of a Linear on levels
// with the packed GEMM. Holds only the panels (the caller drops the row-layout weight) and the bias
// widened to fp32 and padded once, rather than per call.
class PackedLinear : public PackedProduct {
 public:
  PackedLinear(const at::Tensor& w, const c10::optional<at::Tensor>& bias);

  // x [..., K] bf16 -> [..., N] bf16, as linear_bf16_packed (the same bits for a row in any batch).
  at::Tensor forward(const at::Tensor& x) const override;
  bool runs_into() const override;
  void forward_into(const at::Tensor& x, at::Tensor& y) const override;
  // bf16 x [M, K]: the choices over the bf16 outputs as stored.
  std::tuple<at::Tensor, at::Tensor> forward_choosing(const at::Tensor& x) const override;
  // w[ids]: gather_packed_rows over these panels.
  at::Tensor rows(const at::Tensor& ids) const;

  const at::Tensor& panels() const { return panels_; }
  int64_t out_features() const override { return N_; }
  int64_t in_features() const { return K_; }

 private:
  at::Tensor panels_;  // [ceil(N / 48), ceil(K / 2), 48, 2] bf16
  at::Tensor bias_;    // [ceil(N / 48) * 48] fp32, zero past N; undefined without bias
  int64_t N_, K_;
};

}  // namespace pagecli
