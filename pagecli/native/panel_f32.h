// The register-tiled product of float32 activations and weights kept in 16-column panels: the AVX2
// kernel of float32 models' weights, kept in bf16 or float32 (float_panels.cpp). Its division of a
// product into tiles (for_panel_tiles) serves the quantized AVX2 kernels too (panel_i16.h).
//
// A format is a `Panels` type whose widen(p, k, lo, hi) gives row k of panel p as two fp32 vectors,
// columns 16 p + 0-7 and 16 p + 8-15: the weight values themselves, so the product is float32 math
// on the weights it holds. A tile of R rows of x by P panels keeps
// 2 R P accumulators (at most 12 of the 16 ymm registers): per k, P widenings, R broadcasts of x,
// 2 R P FMAs. Rows in blocks of 6 (FMAs outnumber the widening's operations), fewer rows with two
// panels at once (decode: one row, four independent FMA chains, enough to stream the weights at the
// memory's rate). Each output is one fp32 lane summing its K products in k order (then the bias),
// whatever the tile, so a row gets the same bits alone or in any batch.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gemm_bf16.h"
#include "greedy_choices.h"
#include "tile_rows.h"
#include "work_share.h"

#if defined(__AVX2__) && defined(__FMA__)
#define PAGECLI_PANEL_F32 1
#include <immintrin.h>
#else
#define PAGECLI_PANEL_F32 0
#endif

namespace pagecli {

constexpr int64_t kPanelF32Cols = 16;  // columns per panel

// How a kernel cuts a product into register tiles: rows of x per tile where there are that many, and
// the most rows a tile of two panels takes (fewer rows than that get two panels, so one row still runs
// four independent chains).
struct PanelTiling {
  int64_t row_block;
  int64_t two_panel_rows;
  constexpr int panels(int64_t rows) const { return rows <= two_panel_rows ? 2 : 1; }
};

// The float32 kernel's: at most 12 accumulators (an FMA adds into its accumulator in place), and at
// least 4 FMA chains.
constexpr PanelTiling kF32Tiling{6, 3};

// A tile's fp32 sums (rows `stride` floats apart) -> y's first `cols` columns (rows N apart), plus the
// bias if any, added in fp32 after them.
inline void store_tile(const float* sums, int64_t stride, int rows, const float* bias, float* y, int64_t N,
                       int64_t cols) {
  for (int r = 0; r < rows; ++r) {
    const float* s = sums + r * stride;
    float* yr = y + r * N;
    for (int64_t c = 0; c < cols; ++c) yr[c] = bias ? s[c] + bias[c] : s[c];
  }
}

#if PAGECLI_PANEL_F32
namespace panel_f32 {

struct Tile {
  int64_t panel;       // the tile's first panel
  const float* x;      // the tile's first row of x, rows K floats apart
  const float* bias;   // the first panel's first column's bias, or nullptr
  float* y;            // y's row of x's first row, at the first panel's first column; rows N apart
  int64_t K, N, cols;  // cols: columns of y the tile covers (its panels' share of N)
};

template <int R, int P, typename Panels>
void tile_kernel(const Panels& w, const Tile& t) {
  __m256 acc[R][2 * P];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 2 * P; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < t.K; ++k) {
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) {
      __m256 lo, hi;
      w.widen(t.panel + q, k, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(t.x + r * t.K + k);
        acc[r][2 * q] = _mm256_fmadd_ps(xv, lo, acc[r][2 * q]);
        acc[r][2 * q + 1] = _mm256_fmadd_ps(xv, hi, acc[r][2 * q + 1]);
      }
    }
  }
  // The sums leave the registers once, through this buffer (the bias added in fp32 after them):
  // indexing the accumulators by a run-time column count instead keeps GCC from holding them in
  // registers across the k loop.
  alignas(32) float sums[R][2 * P][8];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int v = 0; v < 2 * P; ++v) _mm256_store_ps(sums[r][v], acc[r][v]);
  }
  store_tile(&sums[0][0][0], 2 * P * 8, R, t.bias, t.y, t.N, t.cols);
}

}  // namespace panel_f32
#endif

// The tiles of a panel product of M rows by N columns, shared out over the threads: tile(P, rows,
// first panel, first row, columns) for every tile of `rows` rows (up to tiling.row_block) by P panels of
// 16 columns (two where there are at most tiling.two_panel_rows rows, so decode runs four chains). Work units are (group of
// panels, group of row blocks), a thread's own units one run of the weights in order (as
// gemm_bf16.cpp shares its panels). The last group may hold one panel where P is 2: a one-panel
// tile covers it.
template <typename TileFn>
void for_panel_tiles(int64_t M, int64_t N, const TileFn& tile, PanelTiling tiling = kF32Tiling) {
  if (M <= 0) return;
  const int64_t rows_per_block = std::min(M, tiling.row_block);
  const int P = tiling.panels(rows_per_block);
  const int64_t num_panels = ceil_div(N, kPanelF32Cols), groups = ceil_div(num_panels, P);
  const int64_t row_blocks = ceil_div(M, rows_per_block);
  const RowGroups split = split_row_blocks(groups, row_blocks);
  parallel_shared(groups * split.count, [&](SharedWork::Cursor& cursor) {
    for (int64_t u; (u = cursor.next()) >= 0;) {
      const int64_t group = u / split.count, first_block = u % split.count * split.blocks_per_group;
      const int64_t end_block = std::min(row_blocks, first_block + split.blocks_per_group);
      const int64_t c0 = group * P * kPanelF32Cols, cols = std::min(P * kPanelF32Cols, N - c0);
      for (int64_t b = first_block; b < end_block; ++b) {
        const int64_t m0 = b * rows_per_block;
        tile(cols > kPanelF32Cols ? P : 1, std::min(rows_per_block, M - m0), group * P, m0, cols);
      }
    }
  });
}

#if PAGECLI_PANEL_F32
// y [M, N] = x [M, K] @ w^T (+ bias [N]), all fp32 but the panels; each tile folded into `choices`
// as it is stored, where given.
template <typename Panels>
void panel_product(const Panels& w, const float* x, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                   GreedyChoices* choices = nullptr) {
  using namespace panel_f32;
  for_panel_tiles(M, N, [&](int P, int64_t rows, int64_t panel, int64_t m0, int64_t cols) {
    const int64_t c0 = panel * kPanelF32Cols;
    const Tile t{panel, x + m0 * K, bias ? bias + c0 : nullptr, y + m0 * N + c0, K, N, cols};
    // A kernel per tile size: 1-3 rows by two panels, 1-6 by one (kF32Tiling).
    if (P == 2) {
      with_rows_upto<kF32Tiling.two_panel_rows>(rows, [&](auto r) { tile_kernel<decltype(r)::value, 2>(w, t); });
    } else {
      with_rows_upto<kF32Tiling.row_block>(rows, [&](auto r) { tile_kernel<decltype(r)::value, 1>(w, t); });
    }
    if (choices) choices->tile(t.y, N, m0, rows, c0, cols);
  });
}

#endif

// fn(p, c, row) for every column 16 p + c < N of src [N, K] row-major (row: its K values), the panels
// shared out over the threads: how every panel layout is packed.
template <typename T, typename Fn>
void for_panel_columns(const T* src, int64_t N, int64_t K, const Fn& fn) {
  at::parallel_for(0, ceil_div(N, kPanelF32Cols), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanelF32Cols && p * kPanelF32Cols + c < N; ++c) fn(p, c, src + (p * kPanelF32Cols + c) * K);
    }
  });
}

// src [N, K] row-major -> dst [ceil(N / 16), K, 16] where row k of panel p holds, at slot(c), column
// 16 p + c's value (dst must come zeroed: columns past N stay zero).
template <typename T, typename Slot>
void pack_f32_panels(const T* src, T* dst, int64_t N, int64_t K, const Slot& slot) {
  for_panel_columns(src, N, K, [&](int64_t p, int64_t c, const T* row) {
    T* out = dst + p * K * kPanelF32Cols + slot(c);
    for (int64_t k = 0; k < K; ++k) out[k * kPanelF32Cols] = row[k];
  });
}

}  // namespace pagecli
