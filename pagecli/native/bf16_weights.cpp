// Float32 activations times weights kept in bfloat16 (bf16_weights.h), for float32 models on the
// avx2 level: CPUs without bf16 arithmetic (AMD Zen 2/3, Intel before Cooper Lake, most laptops).
//
// Why: at the avx2 level a model runs in float32, and a decode step reads every weight once, four
// bytes each. Nearly every checkpoint is published in bf16, and a float32 model converted from one
// holds only bf16 values, so the low half of each float is zero: keeping the weights in bf16 halves
// the bytes read per token and the memory the model takes, and changes no product (each bf16 widens
// to the float it was). The arithmetic stays fp32 FMA.
//
// Panels: bf16 [ceil(N / 16), K, 16]. Row k of panel p holds 8 32-bit words; word j is column
// 16 p + j in its low half and column 16 p + 8 + j in its high half (zero past N). One 32-byte load
// gives both halves of a panel's k: shifting every word left 16 bits is columns 0-7 as floats,
// masking off the low half is columns 8-15, each in column order, so no shuffle is needed and the
// results store contiguously.
//
// Register tile: R rows of x by P panels (2 R P accumulators of 8 columns, at most 12 of the 16 ymm
// registers): per k, P loads and 2 P integer ops widen the weights, R broadcasts of x feed 2 R P
// FMAs. Rows in blocks of 6 (12 accumulators; FMAs outnumber every other operation 4 to 1), fewer
// rows with more panels at once (decode: one row, two panels, four independent FMA chains, enough
// to stream the weights at the memory's rate). Each output is one fp32 lane summing its K products
// in k order (then the bias), whatever the tile, so a row gets the same bits in any batch.

#include "bf16_weights.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "weight_memory.h"
#include "work_share.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PAGECLI_BF16_WEIGHTS 1
#include <immintrin.h>
#else
#define PAGECLI_BF16_WEIGHTS 0
#endif

namespace pagecli {
namespace {

constexpr int64_t kCols = 16;  // columns per panel

#if PAGECLI_BF16_WEIGHTS
constexpr int64_t kRowBlock = 6;  // rows of x per tile, where there are that many

// Panels per tile for a tile of R rows: at most 12 accumulators, and at least 4 FMA chains.
constexpr int panels_for(int64_t rows) { return rows >= 4 ? 1 : 2; }

struct Tile {
  const float* x;        // the tile's first row of x, rows K floats apart
  const uint16_t* w;     // the tile's first panel, panels K * 16 apart
  const float* bias;     // the first panel's first column's bias, or nullptr
  float* y;              // y's row of x's first row, at the first panel's first column; rows N apart
  int64_t K, N, cols;    // cols: columns of y the tile covers (its panels' share of N)
};

template <int R, int P>
void tile_kernel(const Tile& t) {
  __m256 acc[R][2 * P];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 2 * P; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int64_t panel_elems = t.K * kCols;
  for (int64_t k = 0; k < t.K; ++k) {
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.w + q * panel_elems + k * kCols));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(words, high));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(t.x + r * t.K + k);
        acc[r][2 * q] = _mm256_fmadd_ps(xv, lo, acc[r][2 * q]);
        acc[r][2 * q + 1] = _mm256_fmadd_ps(xv, hi, acc[r][2 * q + 1]);
      }
    }
  }
  // The sums leave the registers once, through this buffer (the bias added here, in fp32 as in
  // the sums): indexing the accumulators by a run-time column count instead keeps GCC from holding
  // them in registers across the k loop.
  alignas(32) float sums[R][2 * P][8];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < 2 * P; ++v) _mm256_store_ps(sums[r][v], acc[r][v]);
  }
  for (int r = 0; r < R; ++r) {
    const float* s = &sums[r][0][0];
    float* yr = t.y + r * t.N;
    for (int64_t c = 0; c < t.cols; ++c) yr[c] = t.bias ? s[c] + t.bias[c] : s[c];
  }
}

template <int P>
void tile_rows(int64_t rows, const Tile& t) {
  switch (rows) {
    case 1: return tile_kernel<1, P>(t);
    case 2: return tile_kernel<2, P>(t);
    case 3: return tile_kernel<3, P>(t);
    default: break;
  }
  if constexpr (P == 1) {
    switch (rows) {
      case 4: return tile_kernel<4, 1>(t);
      case 5: return tile_kernel<5, 1>(t);
      case 6: return tile_kernel<6, 1>(t);
      default: break;
    }
  }
  TORCH_CHECK(false, "Bf16WeightLinear: no tile of ", rows, " rows by ", P, " panels");
}

// y [M, N] = x [M, K] @ w^T (+ bias), all fp32 but the panels.
void product(const float* x, const uint16_t* panels, const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t rows_per_block = std::min(M, kRowBlock);
  const int P = panels_for(rows_per_block);
  const int64_t num_panels = ceil_div(N, kCols), groups = ceil_div(num_panels, P);
  const int64_t row_blocks = ceil_div(M, rows_per_block);
  const RowGroups split = split_row_blocks(groups, row_blocks);
  // Unit u: panel group u / split.count, row group u % split.count; a thread's own units are one
  // run of the weights, in order (as gemm_bf16.cpp shares its panels).
  parallel_shared(groups * split.count, [&](SharedWork::Cursor& cursor) {
    for (int64_t u; (u = cursor.next()) >= 0;) {
      const int64_t group = u / split.count, first_block = u % split.count * split.blocks_per_group;
      const int64_t end_block = std::min(row_blocks, first_block + split.blocks_per_group);
      const int64_t c0 = group * P * kCols;
      Tile t;
      t.w = panels + group * P * K * kCols;
      t.bias = bias ? bias + c0 : nullptr;
      t.K = K;
      t.N = N;
      t.cols = std::min(P * kCols, N - c0);
      for (int64_t b = first_block; b < end_block; ++b) {
        const int64_t m0 = b * rows_per_block, rows = std::min(rows_per_block, M - m0);
        t.x = x + m0 * K;
        t.y = y + m0 * N + c0;
        // The last group may hold fewer panels than P: its missing panel's columns are past N, so
        // a one-panel tile covers them.
        if (P == 2 && t.cols > kCols) {
          tile_rows<2>(rows, t);
        } else {
          tile_rows<1>(rows, t);
        }
      }
    }
  });
}
#endif

}  // namespace

bool bf16_exact(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat, "bf16_exact takes a float32 CPU tensor");
  const at::Tensor c = w.contiguous();
  const uint32_t* p = reinterpret_cast<const uint32_t*>(c.data_ptr<float>());
  const int64_t n = c.numel();
  std::atomic<bool> exact{true};
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    uint32_t low = 0;
    for (int64_t i = begin; i < end; ++i) low |= p[i] & 0xFFFFu;
    if (low) exact.store(false, std::memory_order_relaxed);
  });
  return exact.load();
}

bool has_bf16_weight_linear() { return PAGECLI_BF16_WEIGHTS; }

Bf16WeightLinear::Bf16WeightLinear(const at::Tensor& w, const c10::optional<at::Tensor>& bias)
    : N_(w.dim() == 2 ? w.size(0) : 0), K_(w.dim() == 2 ? w.size(1) : 0) {
  TORCH_CHECK(PAGECLI_BF16_WEIGHTS, "Bf16WeightLinear needs AVX2 and FMA, which this build lacks");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && N_ > 0 && K_ > 0 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "Bf16WeightLinear takes a float32 or bf16 [N, K] CPU weight");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || bf16_exact(w),
              "Bf16WeightLinear: the weight has values that bfloat16 cannot hold; it would change the products");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N_, "bias must have N = ", N_, " values");
    bias_ = bias->to(at::kFloat).contiguous().clone();
  }
  const at::Tensor src = w.to(at::kBFloat16).contiguous();  // exact: checked above
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  const int64_t num_panels = ceil_div(N_, kCols), K = K_, N = N_;
  panels_ = weight_zeros({num_panels, K_, kCols}, at::kBFloat16);
  uint16_t* d = reinterpret_cast<uint16_t*>(panels_.data_ptr<at::BFloat16>());
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kCols && p * kCols + c < N; ++c) {
        const uint16_t* row = s + (p * kCols + c) * K;
        const int64_t slot = c < 8 ? 2 * c : 2 * (c - 8) + 1;  // word c % 8, low half for c < 8
        uint16_t* dst = d + p * K * kCols + slot;
        for (int64_t k = 0; k < K; ++k) dst[k * kCols] = row[k];
      }
    }
  });
}

at::Tensor Bf16WeightLinear::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K_ && x.scalar_type() == at::kFloat,
              "Bf16WeightLinear takes float32 x [..., ", K_, "]");
  const at::Tensor x2 = x.reshape({-1, K_}).contiguous();
  const int64_t M = x2.size(0);
  auto y = at::empty({M, N_}, x2.options());
#if PAGECLI_BF16_WEIGHTS
  if (M > 0) {
    product(x2.data_ptr<float>(), reinterpret_cast<const uint16_t*>(panels_.data_ptr<at::BFloat16>()),
            bias_.defined() ? bias_.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N_, K_);
  }
#endif
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N_;
  return y.view(shape);
}

at::Tensor Bf16WeightLinear::rows(const at::Tensor& ids) const {
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t count = flat.numel(), K = K_;
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N_, "row id ", ip[i], " out of range");
  auto out = at::empty({count, K_}, panels_.options().dtype(at::kFloat));
  const uint16_t* d = reinterpret_cast<const uint16_t*>(panels_.data_ptr<at::BFloat16>());
  uint32_t* op = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = ip[i] / kCols, c = ip[i] % kCols;
      const uint16_t* src = d + p * K * kCols + (c < 8 ? 2 * c : 2 * (c - 8) + 1);
      for (int64_t k = 0; k < K; ++k) op[i * K + k] = static_cast<uint32_t>(src[k * kCols]) << 16;
    }
  });
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K_);
  return out.view(shape);
}

}  // namespace pagecli
