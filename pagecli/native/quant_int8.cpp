// bf16 activations times int8 weights quantized at load (one scale per output channel): the
// quantized products of the decoder's Linears (quant_int8.h). Decode on a CPU is bound by the
// bytes of weights read per token; int8 halves them against bf16.
//
// AVX512-BF16 kernel: the bf16 GEMM's panels and register tile (gemm_bf16.cpp), but the panels hold
// int8, 96 bytes per k pair. Each 32 values of a pair are widened in registers to bf16
// (int8 -> int32 -> fp32 -> bf16: exact, |q| <= 127) and multiplied with vdpbf16ps, so the
// products are exact and the fp32 sums run over k pairs in order; the scale and bias come last.
// The widening costs about 5 instructions per 32 weights, shared by the tile's rows: for one row
// it still runs faster than memory delivers the weights (2 Zen 4 cores).
// (Quantizing activations per row to int8 for VNNI's vpdpbusd would add their rounding error
// to the weights'; not tried here.)
//
// AVX2 kernel: q as it lies [N, K], 4 rows of x per weight row, 8 k per fp32 lane with FMA.

#include "quant_int8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGECLI_INT8_KIND 2
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGECLI_INT8_KIND 1
#include <immintrin.h>
#else
#define PAGECLI_INT8_KIND 0
#endif

namespace pagecli {
namespace {

constexpr int64_t kPanelCols = kPackedPanelCols;  // output columns per panel (gemm_bf16.h's layout)
constexpr int64_t kTileRows = 8;                   // rows of x per register tile (AVX-512)

// [N] -> fp32 [ceil(N / 48) * 48], zero past N.
at::Tensor padded_fp32(const at::Tensor& v, int64_t N) {
  auto padded = at::zeros({ceil_div(N, kPanelCols) * kPanelCols}, v.options().dtype(at::kFloat));
  padded.narrow(0, 0, N).copy_(v);
  return padded;
}

#if PAGECLI_INT8_KIND == 2
// q [N, K] int8 -> [ceil(N / 48), ceil(K / 2), 48, 2]: packed[p, j, c, h] = q[48 p + c, 2 j + h].
at::Tensor pack_int8(const at::Tensor& q) {
  const int64_t N = q.size(0), K = q.size(1), num_panels = ceil_div(N, kPanelCols), k_pairs = ceil_div(K, 2);
  auto packed = at::zeros({num_panels, k_pairs, kPanelCols, 2}, q.options());  // [num_panels, k_pairs, 48, 2]
  pack_into_panels(q.data_ptr<int8_t>(), packed.data_ptr<int8_t>(), N, K);
  return packed;
}

inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 32 int8 (16 columns x a k pair) -> 32 bf16 in the same order.
inline __m512bh widen(const int8_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo, 16-31 from hi
}

struct Tile {
  const uint16_t* x;  // first row; rows K elements apart
  int64_t K;
  const int8_t* panel;  // [k_pairs, 48, 2]
  const float* scale;   // this panel's 48 scales
  const float* bias;    // this panel's 48 biases, or nullptr
  uint16_t* y;          // y[first row, first column of the panel]; rows N apart
  int64_t N;
  int64_t cols;         // columns inside N
};

template <int kRows>
void tile_kernel(const Tile& t) {
  __m512 acc[kRows][3];
  for (int i = 0; i < kRows; ++i) {
    for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  auto step = [&](int64_t j, auto x_pair) {
    const int8_t* pair = t.panel + j * kPanelCols * 2;
    __m512bh wv[3];
    for (int v = 0; v < 3; ++v) wv[v] = widen(pair + v * 32);
    for (int i = 0; i < kRows; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x_pair(i));
      for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], wv[v], xb);
    }
  };
  const int64_t full_pairs = t.K / 2;
  int64_t j = 0;
  for (; j < full_pairs; ++j) step(j, [&](int i) { return load_pair(t.x + i * t.K + 2 * j); });
  if (t.K % 2) step(j, [&](int i) { return static_cast<int32_t>(t.x[i * t.K + 2 * j]); });
  for (int i = 0; i < kRows; ++i) {
    alignas(64) uint16_t out[kPanelCols];
    for (int v = 0; v < 3; ++v) {
      __m512 sum = _mm512_mul_ps(acc[i][v], _mm512_loadu_ps(t.scale + v * 16));
      if (t.bias) sum = _mm512_add_ps(sum, _mm512_loadu_ps(t.bias + v * 16));
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + v * 16), (__m256i)_mm512_cvtneps_pbh(sum));
    }
    std::memcpy(t.y + i * t.N, out, t.cols * sizeof(uint16_t));
  }
}

void run_tile(int64_t rows, const Tile& t) {
  switch (rows) {
    case 1: tile_kernel<1>(t); break;
    case 2: tile_kernel<2>(t); break;
    case 3: tile_kernel<3>(t); break;
    case 4: tile_kernel<4>(t); break;
    case 5: tile_kernel<5>(t); break;
    case 6: tile_kernel<6>(t); break;
    case 7: tile_kernel<7>(t); break;
    default: tile_kernel<8>(t); break;
  }
}

at::Tensor product_avx512(const at::Tensor& xc, const at::Tensor& packed, const float* sp, const float* bp, int64_t N,
                          int64_t K) {
  TORCH_CHECK(xc.scalar_type() == at::kBFloat16, "the int8 product takes bf16 activations on this level");
  const int64_t M = xc.size(0), num_panels = ceil_div(N, kPanelCols), k_pairs = ceil_div(K, 2);
  auto y = at::empty({M, N}, xc.options());  // [M, N]
  if (M == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int8_t* wp = packed.data_ptr<int8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t panel_bytes = k_pairs * kPanelCols * 2, row_blocks = ceil_div(M, kTileRows);
  const RowGroups split = split_row_blocks(num_panels, row_blocks);  // shared out as the bf16 GEMM does
  const int64_t groups = split.count, blocks_per_group = split.blocks_per_group;
  at::parallel_for(0, num_panels * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t panel = u / groups, group = u % groups;
      Tile t;
      t.K = K;
      t.N = N;
      t.panel = wp + panel * panel_bytes;
      t.scale = sp + panel * kPanelCols;
      t.bias = bp ? bp + panel * kPanelCols : nullptr;
      t.cols = std::min(kPanelCols, N - panel * kPanelCols);
      const int64_t first = group * blocks_per_group, last = std::min(row_blocks, first + blocks_per_group);
      for (int64_t b = first; b < last; ++b) {
        const int64_t m0 = b * kTileRows;
        t.x = xp + m0 * K;
        t.y = yp + m0 * N + panel * kPanelCols;
        run_tile(std::min(kTileRows, M - m0), t);
      }
    }
  });
  return y;
}
#endif

#if PAGECLI_INT8_KIND == 1
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// x as fp32 [M, K]; q [N, K] int8 as it lies. Each weight row's 8-k slices are widened once for up
// to 4 rows of x; every (row, column) output sums the same lanes in the same order for any M.
at::Tensor product_avx2(const at::Tensor& x, const at::Tensor& q, const float* sp, const float* bp, int64_t N,
                        int64_t K) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, K]
  const int64_t M = xf.size(0);
  auto yf = at::empty({M, N}, xf.options());  // [M, N] fp32, cast to x's dtype at the end
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = q.data_ptr<int8_t>();
  float* yp = yf.data_ptr<float>();
  const int64_t full = K / 8 * 8;
  constexpr int64_t R = 4;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* w = wp + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        const int64_t rows = std::min(R, M - m0);
        __m256 acc[R] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t k = 0; k < full; k += 8) {
          int64_t bytes;
          std::memcpy(&bytes, w + k, 8);
          const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
          for (int64_t i = 0; i < rows; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + (m0 + i) * K + k), wv, acc[i]);
        }
        for (int64_t i = 0; i < rows; ++i) {
          float sum = hsum8(acc[i]);
          for (int64_t k = full; k < K; ++k) sum += xp[(m0 + i) * K + k] * static_cast<float>(w[k]);
          sum *= sp[n];
          if (bp) sum += bp[n];
          yp[(m0 + i) * N + n] = sum;
        }
      }
    }
  });
  return yf.to(x.scalar_type());
}
#endif

}  // namespace

PackedLinearInt8::PackedLinearInt8(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& bias)
    : N_(q.size(0)), K_(q.dim() == 2 ? q.size(1) : 0) {
  TORCH_CHECK(PAGECLI_INT8_KIND != 0, "the int8 products need AVX2 or AVX512-BF16, which this build lacks");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && N_ > 0 &&
                  K_ > 0,
              "PackedLinearInt8 takes a contiguous int8 [N, K] CPU weight");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N_, "scale must have N = ", N_, " values");
  scale_ = padded_fp32(scale, N_);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N_, "bias must have N = ", N_, " values");
    bias_ = padded_fp32(*bias, N_);
  }
#if PAGECLI_INT8_KIND == 2
  weights_ = pack_int8(q);
#else
  weights_ = q;
#endif
}

at::Tensor PackedLinearInt8::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K_, "PackedLinearInt8 takes x [..., ", K_, "]");
  const at::Tensor x2 = x.reshape({-1, K_}).contiguous();  // [M, K]
  const float* sp = scale_.data_ptr<float>();
  const float* bp = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
  at::Tensor y;
#if PAGECLI_INT8_KIND == 2
  y = product_avx512(x2, weights_, sp, bp, N_, K_);
#elif PAGECLI_INT8_KIND == 1
  y = product_avx2(x2, weights_, sp, bp, N_, K_);
#else
  TORCH_CHECK(false, "the int8 products need AVX2 or AVX512-BF16, which this build lacks");
#endif
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N_;
  return y.view(shape);
}

const char* int8_linear_kind() {
  return PAGECLI_INT8_KIND == 2 ? "avx512_bf16" : PAGECLI_INT8_KIND == 1 ? "avx2" : "";
}

}  // namespace pagecli
