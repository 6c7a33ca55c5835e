// What the VNNI products (quant_int8.cpp, quant_int4.cpp) share: activations rounded to int8 per row and
// block of 64 along k, d = max |x| / 127 and xq = round(x * (127 / max |x|)) (ties to even), a
// block whose max |x| is below 1e-30 all zeros (127 / max would overflow). The products multiply
// xq by unsigned weight bytes with vpdpbusd and need each 32-group's integer sum of xq (the int8
// weights' +128 offset, the 4-bit weights' minimum). pagecli.models.quantize.round_activations is
// this in PyTorch. And the work units and the store of a register tile's totals.

#pragma once

#include "gemm_bf16.h"
#include "greedy_choices.h"
#include "simd.h"
#include "work_share.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGECLI_HAVE_VNNI 1
#else
#define PAGECLI_HAVE_VNNI 0
#endif

namespace pagecli {

constexpr int64_t kActBlock = 64;  // activations' quantization block along k
constexpr int64_t kActGroup = 32;  // the integer sums' group along k

inline int64_t act_padded_k(int64_t K) { return (K + kActBlock - 1) / kActBlock * kActBlock; }

#if PAGECLI_HAVE_VNNI
// xq [M, Kp] int8 (zero past K), d [M, Kp / 64] fp32, gsum [M, Kp / 32] int32 (sum of xq per 32-group).
struct QuantizedRows {
  at::Tensor xq, d, gsum;
};

template <typename scalar_t>
inline void quantize_act_block(const scalar_t* x, int64_t n, int8_t* q, float* d, int32_t* gsum) {
  constexpr float kTinyBlock = 1e-30f;
  __m512 v[kActBlock / 16];
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < kActBlock / 16; ++i) {
    const int64_t left = n - 16 * i;
    if (left >= 16) {
      v[i] = load16(x + 16 * i);
    } else {
      alignas(64) scalar_t tail[16] = {};
      for (int64_t t = 0; t < std::max<int64_t>(left, 0); ++t) tail[t] = x[16 * i + t];
      v[i] = load16(tail);
    }
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  float m = _mm512_reduce_max_ps(amax);
  if (!(m >= kTinyBlock)) m = 0.0f;
  const __m512 inv = _mm512_set1_ps(m > 0 ? 127.0f / m : 0.0f);
  __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int i = 0; i < kActBlock / 16; ++i) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));  // nearest, ties to even
    const __m512i c = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    sums[i / 2] = _mm512_add_epi32(sums[i / 2], c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i), _mm512_cvtepi32_epi8(c));
  }
  *d = m / 127.0f;
  gsum[0] = _mm512_reduce_add_epi32(sums[0]);
  gsum[1] = _mm512_reduce_add_epi32(sums[1]);
}

// Activations rounded to int16 for the VNNI kernels of float32 models (quant_int4.cpp's wide tiles): per
// row and 64-block, d = max |x| / kWideLevels and xq = round(x * (kWideLevels / max |x|)) (ties to even),
// a block whose max |x| is below 1e-30 all zeros; each xq is kept as two int8 halves, xq = 256 hi + lo with
// hi = (xq + 128) >> 8 and lo = xq - 256 hi in [-128, 127], so vpdpbusd multiplies both by the unsigned
// weight bytes and 256 * sum(q hi) + sum(q lo) is the exact sum(q xq). 32639 (not 32767) keeps hi within
// [-127, 127]. pagecli.models.quantize.round_activations(x, 32639) is this rounding in PyTorch.
constexpr int kWideLevels = 32639;

// A batch's rows so rounded, in one piece of memory (bytes(M, K)): hi and lo [M, Kp] int8 (zero past K),
// d [M, Kp / 64] fp32, gsum [M, Kp / 32] int32 (each 32-group's sum of xq, exact).
struct WideRows {
  int8_t* hi;
  int8_t* lo;
  float* d;
  int32_t* gsum;
  int64_t Kp;

  static int64_t bytes(int64_t M, int64_t K) {
    const int64_t Kp = act_padded_k(K);
    return 2 * M * Kp + M * (Kp / kActBlock + Kp / kActGroup) * 4;
  }
  static WideRows in(void* memory, int64_t M, int64_t K) {
    const int64_t Kp = act_padded_k(K);
    int8_t* hi = static_cast<int8_t*>(memory);
    float* d = reinterpret_cast<float*>(hi + 2 * M * Kp);
    return {hi, hi + M * Kp, d, reinterpret_cast<int32_t*>(d + M * (Kp / kActBlock)), Kp};
  }
};

inline void round_wide_block(const float* x, int64_t n, int8_t* hi, int8_t* lo, float* d, int32_t* gsum) {
  constexpr float kTinyBlock = 1e-30f;
  __m512 v[kActBlock / 16];
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < kActBlock / 16; ++i) {
    const int64_t left = n - 16 * i;
    v[i] = left >= 16 ? _mm512_loadu_ps(x + 16 * i)
                      : _mm512_maskz_loadu_ps(static_cast<__mmask16>(left > 0 ? (1u << left) - 1 : 0), x + 16 * i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  float m = _mm512_reduce_max_ps(amax);
  if (!(m >= kTinyBlock)) m = 0.0f;
  const __m512 inv = _mm512_set1_ps(m > 0 ? static_cast<float>(kWideLevels) / m : 0.0f);
  const __m512i top = _mm512_set1_epi32(kWideLevels), bottom = _mm512_set1_epi32(-kWideLevels);
  __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int i = 0; i < kActBlock / 16; ++i) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));  // nearest, ties to even
    const __m512i c = _mm512_max_epi32(_mm512_min_epi32(r, top), bottom);
    sums[i / 2] = _mm512_add_epi32(sums[i / 2], c);
    const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(c, _mm512_set1_epi32(128)), 8);
    const __m512i l = _mm512_sub_epi32(c, _mm512_slli_epi32(h, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * i), _mm512_cvtepi32_epi8(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * i), _mm512_cvtepi32_epi8(l));
  }
  *d = m / static_cast<float>(kWideLevels);
  gsum[0] = _mm512_reduce_add_epi32(sums[0]);
  gsum[1] = _mm512_reduce_add_epi32(sums[1]);
}

// x [M, K] float32 (rows K apart) rounded as above into `out`, the blocks shared out among the threads
// (a Team's members inside one: work_share.h).
inline void round_wide_rows(const float* x, int64_t M, int64_t K, const WideRows& out) {
  const int64_t Kp = out.Kp, blocks = Kp / kActBlock;
  parallel_shared(M * blocks, [&](SharedWork::Cursor& cursor) {
    for (int64_t i; (i = cursor.next()) >= 0;) {
      const int64_t m = i / blocks, b = i % blocks;
      round_wide_block(x + m * K + b * kActBlock, std::min(kActBlock, K - b * kActBlock), out.hi + m * Kp + b * kActBlock,
                       out.lo + m * Kp + b * kActBlock, out.d + i, out.gsum + 2 * i);
    }
  }, 64);
}

// x [M, K] contiguous (float32, bf16 or fp16).
inline QuantizedRows quantize_activations(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), Kp = act_padded_k(K), blocks = Kp / kActBlock;
  QuantizedRows out{at::empty({M, Kp}, x.options().dtype(at::kChar)),
                    at::empty({M, blocks}, x.options().dtype(at::kFloat)),
                    at::empty({M, 2 * blocks}, x.options().dtype(at::kInt))};
  int8_t* qp = out.xq.data_ptr<int8_t>();
  float* dp = out.d.data_ptr<float>();
  int32_t* sp = out.gsum.data_ptr<int32_t>();
  PAGECLI_DISPATCH(x.scalar_type(), "quantize_activations", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        for (int64_t b = 0; b < blocks; ++b) {
          quantize_act_block(xp + m * K + b * kActBlock, std::min(kActBlock, K - b * kActBlock),
                             qp + m * Kp + b * kActBlock, dp + m * blocks + b, sp + m * 2 * blocks + 2 * b);
        }
      }
    });
  });
  return out;
}

// The work units of a VNNI product, taken row chunk by row chunk: unit u is panel u % panels over
// the row blocks [first_block(u), last_block(u)) of chunk u / panels. A chunk's quantized rows (about
// kChunkBytes of xq) stay in the core's L2 while its thread walks every panel past them. Without
// chunks each panel read all M rows: 4096 rows at K = 8192 are 32 MB of xq, over the L3, read again
// for each of the product's panels.
constexpr int64_t kChunkBytes = 256 * 1024;  // 128 to 512 KB measured alike; no chunks was slower

struct ProductUnits {
  int64_t panels, row_blocks, blocks_per_unit;
  int64_t count() const { return panels * ceil_div(row_blocks, blocks_per_unit); }
  int64_t panel(int64_t u) const { return u % panels; }
  int64_t first_block(int64_t u) const { return u / panels * blocks_per_unit; }
  int64_t last_block(int64_t u) const { return std::min(row_blocks, first_block(u) + blocks_per_unit); }
};

inline ProductUnits product_units(int64_t num_panels, int64_t M, int64_t tile_rows, int64_t Kp) {
  const int64_t row_blocks = ceil_div(M, tile_rows);
  const RowGroups split = split_row_blocks(num_panels, row_blocks);  // few panels: rows shared out too
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkBytes / (tile_rows * Kp));
  return {num_panels, row_blocks, std::min(split.blocks_per_group, chunk_blocks)};
}

// One register tile of a VNNI product: up to kVnniTileRows rows of x by one panel of 48 columns.
// Each product's own Tile extends it with its panel's weights.
constexpr int64_t kVnniTileRows = 4;

struct TileRows {
  const int8_t* xq;     // first row's quantized activations; rows Kp apart
  const float* d;       // first row's scale per 64-block; rows Kp / 64 apart
  const int32_t* gsum;  // first row's sum of xq per 32-group; rows Kp / 32 apart
  int64_t Kp;
  void* y;              // y[first row, first column of the panel]; rows N apart
  int64_t N;
  int64_t cols;         // columns inside N
};

// x [M, K] times a product's packed panels -> y [M, N] in x's dtype: x's activations rounded once
// (quantize_activations), then product.tile<rows, scalar_t>(panel, TileRows) for every panel and
// register tile, in product_units' order, shared out over the threads; each tile folded into `choices`
// as it is stored, where given.
template <typename Product>
at::Tensor run_vnni_product(const at::Tensor& x, int64_t N, const Product& product, GreedyChoices* choices = nullptr) {
  const int64_t M = x.size(0), num_panels = ceil_div(N, kPackedPanelCols);
  auto y = at::empty({M, N}, x.options());  // [M, N]
  if (M == 0) return y;
  const QuantizedRows rows = quantize_activations(x);
  const int64_t Kp = rows.xq.size(1), blocks = Kp / kActBlock;
  const int8_t* qp = rows.xq.data_ptr<int8_t>();
  const float* dp = rows.d.data_ptr<float>();
  const int32_t* sp = rows.gsum.data_ptr<int32_t>();
  const ProductUnits units = product_units(num_panels, M, kVnniTileRows, Kp);
  PAGECLI_DISPATCH(x.scalar_type(), "vnni_product", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    parallel_shared(units.count(), [&](SharedWork::Cursor& cursor) {
      for (int64_t u; (u = cursor.next()) >= 0;) {
        const int64_t panel = units.panel(u);
        for (int64_t rb = units.first_block(u); rb < units.last_block(u); ++rb) {
          const int64_t m0 = rb * kVnniTileRows;
          const TileRows tile{qp + m0 * Kp, dp + m0 * blocks, sp + m0 * 2 * blocks, Kp,
                              yp + m0 * N + panel * kPackedPanelCols, N,
                              std::min(kPackedPanelCols, N - panel * kPackedPanelCols)};
          const int64_t rows = std::min(kVnniTileRows, M - m0);
          switch (rows) {
            case 1: product.template tile<1, scalar_t>(panel, tile); break;
            case 2: product.template tile<2, scalar_t>(panel, tile); break;
            case 3: product.template tile<3, scalar_t>(panel, tile); break;
            default: product.template tile<4, scalar_t>(panel, tile); break;
          }
          if (choices) {
            choices->tile(static_cast<const scalar_t*>(tile.y), N, m0, rows, panel * kPackedPanelCols, tile.cols);
          }
        }
      }
    });
  });
  return y;
}

inline int32_t load_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A register tile's fp32 totals for kRows rows by one panel of 48 columns -> y: plus the panel's
// biases (if any), rounded to scalar_t; only the first `cols` columns are written (the last panel
// may pass N). y rows are N apart.
template <int kRows, typename scalar_t>
inline void store_tile_rows(const __m512 (&acc)[kRows][3], const float* bias, scalar_t* y, int64_t N, int64_t cols) {
  for (int i = 0; i < kRows; ++i) {
    alignas(64) scalar_t out[48];
    for (int v = 0; v < 3; ++v) {
      __m512 r = acc[i][v];
      if (bias) r = _mm512_add_ps(r, _mm512_loadu_ps(bias + v * 16));
      store16(out + v * 16, r);
    }
    std::memcpy(y + i * N, out, cols * sizeof(scalar_t));
  }
}
#endif

}  // namespace pagecli
