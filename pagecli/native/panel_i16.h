// The quantized products of float32 models (int8 weights in quant_int8.cpp, 4-bit ones in quant_int4.cpp): the
// activations rounded to int16 per row and block of 64 along k, multiplied by the weights widened to
// int16 with vpmaddwd (16 products an instruction, summed in pairs into int32 lanes), each group's
// exact integer sums scaled in fp32 once per group. AVX2 has no dot product of two signed int8
// operands (vpmaddubsw takes one unsigned operand and saturates at int16), and the float kernel this replaced spent four instructions a weight on widening it
// to fp32 (load, extend, convert, scale) before its FMA: decode was bound by those, not by memory.
//
// Activations: per row and 64-block, d = max |x| / 32767 and xq = round(x * (32767 / max |x|)) (ties
// to even), a block whose max |x| is below 1e-30 all zeros; each value moves at most max |x| / 65534,
// 2^-16 of its block's largest, 258 times finer than the int8 rounding of the VNNI kernels (and of
// llama.cpp's Q8 activations): float32 models keep their numbers to about float32's products' own
// rounding. The sums of xq per 32-group come along (4-bit weights' minimum). pagecli.models.quantize
// .round_activations(x, 32767) is this in PyTorch.
//
// Weights: 16-column panels (panel_f32.h's), k in pairs: a panel's pair j is 16 int16 values per
// 8 columns once widened, lane 2c + t holding column c's weight at k = 2 j + t, so vpmaddwd against
// the broadcast pair (xq[2 j], xq[2 j + 1]) leaves column c's two products summed in int32 lane c.
// A format is a `Pairs` type with kGroupPairs (k pairs per scale group), widen(p, j, lo, hi) (pair j of
// panel p: columns 0-7 and 8-15 as int16), scales(p, g, half) (group g's scales of 8 columns, read
// once for all the tile's rows) and fold(scales, isum, d, gsum, acc) (a row's int32 sums of the group
// -> its fp32 accumulator; d its scale of the group's 64-block, gsum its sum of xq over the
// 32-group). Register tile: R rows by P panels (panel_f32.h's for_panel_tiles; kI16Tiling: 1-3 rows by
// one panel), 2 R P int32 sums, the fp32 totals in memory between groups. Each output adds its groups in order
// whatever the tile, and a group's integer sums are exact, so a row gets the same bits alone or in any
// batch and any tiling.
// On AVX-512 builds, products of 4 or more rows run the same sums on 512-bit tiles of up to 8 rows by 2
// panels (tile_kernel512): the same bits, 2-3x the prompt rate.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_f32.h"
#include "tile_rows.h"
#include "work_share.h"

namespace pagecli {

constexpr int64_t kAct16Block = 64;  // activations' rounding block along k (= the int8 weights' block)
constexpr int64_t kAct16Group = 32;  // the sums of xq: one per 32-group (the 4-bit weights' group)

inline int64_t act16_padded_k(int64_t K) { return (K + kAct16Block - 1) / kAct16Block * kAct16Block; }

#if PAGECLI_PANEL_F32
// A batch's rows rounded: xq [M, Kp] int16 (zero past K), d [M, Kp / 64] fp32, gsum [M, Kp / 32] fp32
// (sum of xq per 32-group, exact: at most 32 * 32767), in one piece of memory (rows16_bytes).
struct Rows16 {
  int16_t* xq;
  float* d;
  float* gsum;
  int64_t Kp;

  static int64_t bytes(int64_t M, int64_t K) {
    const int64_t Kp = act16_padded_k(K);
    return M * Kp * static_cast<int64_t>(sizeof(int16_t)) + M * (Kp / kAct16Block + Kp / kAct16Group) * 4;
  }
  // The rows of M x K activations laid out in `memory` (at least bytes(M, K), 4-byte aligned).
  static Rows16 in(void* memory, int64_t M, int64_t K) {
    const int64_t Kp = act16_padded_k(K);
    int16_t* xq = static_cast<int16_t*>(memory);
    float* d = reinterpret_cast<float*>(xq + M * Kp);
    return {xq, d, d + M * (Kp / kAct16Block), Kp};
  }
};

inline void round_block16(const float* x, int64_t n, int16_t* q, float* d, float* gsum) {
  constexpr float kTinyBlock = 1e-30f;
  alignas(32) float v[kAct16Block] = {};
  std::memcpy(v, x, std::max<int64_t>(n, 0) * sizeof(float));
  __m256 amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < kAct16Block; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_load_ps(v + i), abs_mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = 0.0f;
  for (float l : lanes) m = std::max(m, l);
  if (!(m >= kTinyBlock)) m = 0.0f;
  const __m256 inv = _mm256_set1_ps(m > 0 ? 32767.0f / m : 0.0f);
  const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
  alignas(32) int32_t r[kAct16Block];
  for (int i = 0; i < kAct16Block; i += 8) {
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + i), inv));  // nearest, ties to even
    _mm256_store_si256(reinterpret_cast<__m256i*>(r + i), _mm256_max_epi32(_mm256_min_epi32(c, hi), lo));
  }
  int32_t sums[2] = {0, 0};
  for (int i = 0; i < kAct16Block; ++i) {
    q[i] = static_cast<int16_t>(r[i]);
    sums[i / kAct16Group] += r[i];
  }
  *d = m / 32767.0f;
  gsum[0] = static_cast<float>(sums[0]);
  gsum[1] = static_cast<float>(sums[1]);
}

// x [M, K] float32, rows K apart -> its rows rounded as above into `out`, the blocks shared out among
// the threads (a Team's members inside one: work_share.h).
inline void round_rows16(const float* x, int64_t M, int64_t K, const Rows16& out) {
  const int64_t Kp = out.Kp, blocks = Kp / kAct16Block;
  parallel_shared(M * blocks, [&](SharedWork::Cursor& cursor) {
    for (int64_t i; (i = cursor.next()) >= 0;) {
      const int64_t m = i / blocks, b = i % blocks;
      round_block16(x + m * K + b * kAct16Block, std::min(kAct16Block, K - b * kAct16Block),
                    out.xq + m * Kp + b * kAct16Block, out.d + i, out.gsum + 2 * i);
    }
  }, 64);
}

namespace panel_i16 {

// Tiles of at most 3 rows by one panel. One panel at a time even for one row: a decode step's weights
// come from memory, not cache, and a tile then reads one run of consecutive bytes; one row by two panels
// read side by side (panel_f32.h's float32 tiling) took 1.8 times as long over the embedded model's 120
// layer products (8 against 4.4 ms a token, AVX2, 1 thread) and 2.2 times over its output layer, though
// it ran a little faster with the weights in cache. And 3 rows: vpmaddwd writes a temporary that a
// vpaddd then adds (no accumulate in place as an FMA has), so the 2 R sums, the 2 widened weight vectors,
// the broadcasts and the temporaries must fit the 16 ymm registers; at 4 or more rows GCC kept sums on
// the stack (a load and a store each per k pair), and 4 rows took twice as long as 3.
constexpr PanelTiling kI16Tiling{3, 0};

struct Tile {
  int64_t panel;        // the tile's first panel
  const int16_t* xq;    // the tile's first row's xq, rows Kp apart
  const float* d;       // its scales per 64-block, rows Kp / 64 apart
  const float* gsum;    // its sums per 32-group, rows Kp / 32 apart
  const float* bias;    // the first panel's first column's bias, or nullptr
  float* y;             // y's row of the first row, at the first panel's first column; rows N apart
  int64_t Kp, N, cols;  // cols: columns of y the tile covers
};

template <int R, int P, typename Pairs>
void tile_kernel(const Pairs& w, const Tile& t) {
  constexpr int64_t kGroupPairs = Pairs::kGroupPairs, kGroupK = 2 * kGroupPairs;
  alignas(32) float acc[R][2 * P][8] = {};
  const int64_t groups = t.Kp / kGroupK;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sum[R][2 * P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < 2 * P; ++v) sum[r][v] = _mm256_setzero_si256();
    }
    const int16_t* xg = t.xq + g * kGroupK;
#pragma GCC unroll 2
    for (int64_t j = 0; j < kGroupPairs; ++j) {
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q) {
        __m256i lo, hi;
        w.widen(t.panel + q, g * kGroupPairs + j, lo, hi);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, xg + r * t.Kp + 2 * j, sizeof(pair));
          const __m256i xv = _mm256_set1_epi32(pair);
          sum[r][2 * q] = _mm256_add_epi32(sum[r][2 * q], _mm256_madd_epi16(lo, xv));
          sum[r][2 * q + 1] = _mm256_add_epi32(sum[r][2 * q + 1], _mm256_madd_epi16(hi, xv));
        }
      }
    }
    const int64_t block = g * kGroupK / kAct16Block, group32 = g * kGroupK / kAct16Group;
#pragma GCC unroll 4
    for (int v = 0; v < 2 * P; ++v) {
      const typename Pairs::Scales scales = w.scales(t.panel + v / 2, g, v % 2);  // once for the tile's rows
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float d = t.d[r * (t.Kp / kAct16Block) + block], gsum = t.gsum[r * (t.Kp / kAct16Group) + group32];
        _mm256_store_ps(acc[r][v], Pairs::fold(scales, _mm256_cvtepi32_ps(sum[r][v]), d, gsum, _mm256_load_ps(acc[r][v])));
      }
    }
  }
  store_tile(&acc[0][0][0], 2 * P * 8, R, t.bias, t.y, t.N, t.cols);
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGECLI_PANEL_I16_512 1
// The same products on 512-bit registers, for tiles of many rows (prompts, batches) on AVX-512 CPUs: a
// panel's k pair widened once into one register (the format's widen512: columns 0-15 in order, two int16
// per int32 lane) serves up to 8 rows by 2 panels, each row's pair broadcast once for both panels, and one
// vpdpwssd (AVX512-VNNI; else vpmaddwd and vpaddd) a row and panel adds 32 products where AVX2 takes three
// instructions for 16. The integer sums are the same numbers (exact: |xq| <= 32767, no pair saturates) and
// each group is folded by the format's fold512, lane for lane the operations of its fold, in the same group
// order: the outputs are the AVX2 tile's bits, so a row's result does not depend on which tile ran it.
constexpr PanelTiling kI16Tiling512{8, 8};
// Rows from which a product takes the 512-bit tiles: below it (decode) the AVX2 tile of one panel streams
// the weights from memory as one run, which is what bounds a step of a few rows.
constexpr int64_t kI16Rows512 = 4;

inline __m512i madd_pairs512(__m512i sum, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sum, w, x);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(w, x));
#endif
}

template <int R, int P, typename Pairs>
void tile_kernel512(const Pairs& w, const Tile& t) {
  constexpr int64_t kGroupPairs = Pairs::kGroupPairs, kGroupK = 2 * kGroupPairs;
  alignas(64) float acc[R][P][16] = {};  // the fp32 totals, in memory between groups (the sums fill the registers)
  const int64_t groups = t.Kp / kGroupK;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int q = 0; q < P; ++q) sum[r][q] = _mm512_setzero_si512();
    }
    const int16_t* xg = t.xq + g * kGroupK;
#pragma GCC unroll 2
    for (int64_t j = 0; j < kGroupPairs; ++j) {
      __m512i wv[P];
#pragma GCC unroll 2
      for (int q = 0; q < P; ++q) wv[q] = w.widen512(t.panel + q, g * kGroupPairs + j);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xg + r * t.Kp + 2 * j, sizeof(pair));
        const __m512i xv = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
        for (int q = 0; q < P; ++q) sum[r][q] = madd_pairs512(sum[r][q], wv[q], xv);
      }
    }
    const int64_t block = g * kGroupK / kAct16Block, group32 = g * kGroupK / kAct16Group;
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) {
      const typename Pairs::Scales512 scales = w.scales512(t.panel + q, g);  // once for the tile's rows
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float d = t.d[r * (t.Kp / kAct16Block) + block], gsum = t.gsum[r * (t.Kp / kAct16Group) + group32];
        _mm512_store_ps(acc[r][q], Pairs::fold512(scales, _mm512_cvtepi32_ps(sum[r][q]), d, gsum, _mm512_load_ps(acc[r][q])));
      }
    }
  }
  store_tile(&acc[0][0][0], P * 16, R, t.bias, t.y, t.N, t.cols);
}
#else
#define PAGECLI_PANEL_I16_512 0
#endif

}  // namespace panel_i16

// x [M, K] float32 (rows K apart) times the panels of `w` (+ bias [N] fp32) -> y [M, N] float32,
// without a tensor allocated: the rounded rows go to the team's shared scratch inside a Team
// (DecodeStep's forward_team), else to memory of this call's own. Each tile is folded into `choices`
// as it is stored, where given.
template <typename Pairs>
void panel_product16_into(const Pairs& w, const float* x, int64_t M, int64_t K, const float* bias, float* y, int64_t N,
                          GreedyChoices* choices = nullptr) {
  using namespace panel_i16;
  if (M == 0) return;
  const int64_t bytes = Rows16::bytes(M, K);
  const TeamSeat& seat = team_seat();
  std::vector<unsigned char> own;
  void* memory = seat.team ? seat.team->shared_scratch(bytes, seat.rank) : (own.resize(bytes), own.data());
  const Rows16 rows = Rows16::in(memory, M, K);
  round_rows16(x, M, K, rows);
  const int64_t Kp = rows.Kp;
  const auto tile_at = [&](int64_t panel, int64_t m0, int64_t cols) {
    const int64_t c0 = panel * kPanelF32Cols;
    return Tile{panel, rows.xq + m0 * Kp, rows.d + m0 * (Kp / kAct16Block), rows.gsum + m0 * (Kp / kAct16Group),
                bias ? bias + c0 : nullptr, y + m0 * N + c0, Kp, N, cols};
  };
#if PAGECLI_PANEL_I16_512
  if (M >= kI16Rows512) {
    for_panel_tiles(M, N, [&](int P, int64_t n_rows, int64_t panel, int64_t m0, int64_t cols) {
      const Tile t = tile_at(panel, m0, cols);
      if (P == 2) {
        with_rows_upto<kI16Tiling512.row_block>(n_rows, [&](auto r) { tile_kernel512<decltype(r)::value, 2>(w, t); });
      } else {
        with_rows_upto<kI16Tiling512.row_block>(n_rows, [&](auto r) { tile_kernel512<decltype(r)::value, 1>(w, t); });
      }
      if (choices) choices->tile(t.y, N, m0, n_rows, panel * kPanelF32Cols, cols);
    }, kI16Tiling512);
    return;
  }
#endif
  for_panel_tiles(M, N, [&](int P, int64_t n_rows, int64_t panel, int64_t m0, int64_t cols) {
    const Tile t = tile_at(panel, m0, cols);
    TORCH_CHECK(P == 1 && n_rows <= kI16Tiling.row_block, "panel product: no int16 tile of ", n_rows, " rows by ", P, " panels");
    with_rows_upto<kI16Tiling.row_block>(n_rows, [&](auto r) { tile_kernel<decltype(r)::value, 1>(w, t); });
    if (choices) choices->tile(t.y, N, m0, n_rows, panel * kPanelF32Cols, cols);
  }, kI16Tiling);
}
#endif

// src [N, K] row-major (T = int8_t or uint8_t) -> dst [ceil(N / 16), Kp / 2, pair_bytes], dst zeroed
// (past N and K stay zero): put(pair, c, t, value) stores column 16 p + c's value at k = 2 j + t into
// pair j of panel p.
template <typename T, typename Put>
void pack_pair_panels(const T* src, T* dst, int64_t N, int64_t K, int64_t Kp, int64_t pair_bytes, const Put& put) {
  for_panel_columns(src, N, K, [&](int64_t p, int64_t c, const T* row) {
    for (int64_t k = 0; k < K; ++k) put(dst + (p * (Kp / 2) + k / 2) * pair_bytes, c, k % 2, row[k]);
  });
}

}  // namespace pagecli
