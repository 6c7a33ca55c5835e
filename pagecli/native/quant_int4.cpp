// Activations times 4-bit weights in groups of 32 (a scale and a minimum per group): the products of
// --quantize int4 and of GGUF Q4_0/Q4_1 files run as they are (quant_int4.h). Decode on a CPU is
// bound by the bytes of weights read per token: 20 bytes per 32 weights, against 64 in bf16.
//
// AVX512-VNNI kernel. The activations are rounded to int8 per row and 64-block (act_quant.h, as the
// int8 product does), and multiplied by the 4-bit values with vpdpbusd: the nibbles are its unsigned
// operand as they are (0..15), so a group's sum of products is exact in int32. Per group, output
// and row: y += d * (scale * isum + min * gsum), with isum the group's integer sum of products,
// gsum its sum of xq and d the row's activation scale for the group's 64-block; groups in order,
// so a row's result never depends on its batch. pagecli.models.quantize_int4.int4_blocks_reference
// is this arithmetic in PyTorch.
//
// Packed layout: per panel of 48 output columns, per group of 32 k, one block of 960 bytes (15
// cache lines), blocks in (panel, group) order so a thread streams its panels once:
//   48 fp16 scales | 48 fp16 minimums | 4 x 3 vectors of 64 bytes,
// where byte (j, v, c, t) of vector (j, v) holds q[16 v + c, 4 j + t] in its low nibble and
// q[16 v + c, 16 + 4 j + t] in its high one (k within the group): masking gives k quad j and
// shifting quad j + 4, each in vpdpbusd's operand layout (lane c: column c's four k values).
// A tile of up to 4 rows keeps per row and column vector a group's int32 sums and the fp32 totals
// in registers.
//
// Wide tiles (float32 models on VNNI builds): the same blocks, the activations rounded to int16 with
// 32639 levels as two int8 halves, two vpdpbusd sums a group (wide_tile_kernel below). Against the AVX2
// kernel's 512-bit int16 tiles they replaced there (vpdpwssd on nibbles widened to int16), on AMD Zen 4
// at 2 threads: the embedded model's 120 decoder products 3.17 -> 2.62 ms at 1 row, 9.29 -> 7.81 at 9,
// 207 -> 173 at 256 (docs/benchmarks/speculation.md, "Wide int16 tiles").
//
// AVX2 kernel (panel_i16.h; builds without VNNI): the activations rounded to int16 per row and
// 64-block, the nibbles in k pairs widened to int16 and multiplied with vpmaddwd, each group's sums
// exact in int32, then the VNNI kernel's per-group formula with d = max |x| / 32767.

#include "quant_int4.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "act_quant.h"
#include "panel_i16.h"
#include "weight_memory.h"
#include "work_share.h"

// Two kernels, both built where the instruction sets allow: VNNI (int8 activations, or int16 ones on the
// wide tiles: PackedLinearInt4's int16_activations) and AVX2 (int16 activations, builds without VNNI).
#define PAGECLI_INT4_VNNI PAGECLI_HAVE_VNNI
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGECLI_INT4_AVX2 1
#include <immintrin.h>
#else
#define PAGECLI_INT4_AVX2 0
#endif

namespace pagecli {
namespace {

constexpr int64_t kPanelCols = kPackedPanelCols;        // output columns per panel
constexpr int64_t kDataBytes = kPanelCols * kInt4Group / 2;  // 768: a panel's 4-bit weights of one group
constexpr int64_t kBlockBytes = 2 * kPanelCols * 2 + kDataBytes;  // 960: scales, minimums, weights

#if PAGECLI_INT4_VNNI
// q [N, K] uint8, scale/min [N, groups] fp16 -> the panel blocks (layout above), zero past N and K.
at::Tensor pack_int4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& min) {
  const int64_t N = q.size(0), K = q.size(1), groups = scale.size(1), num_panels = ceil_div(N, kPanelCols);
  auto packed = weight_zeros({num_panels, groups, kBlockBytes}, q.scalar_type());  // [panels, groups, 960]
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(min.data_ptr<at::Half>());
  uint8_t* out = packed.data_ptr<uint8_t>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* block = out + (p * groups + g) * kBlockBytes;
        uint16_t* scales = reinterpret_cast<uint16_t*>(block);
        uint8_t* data = block + 4 * kPanelCols;
        for (int64_t col = 0; col < kPanelCols && p * kPanelCols + col < N; ++col) {
          const int64_t n = p * kPanelCols + col, v = col / 16, c = col % 16;
          scales[col] = dp[n * groups + g];
          scales[kPanelCols + col] = mp[n * groups + g];
          for (int64_t i = 0; i < kInt4Group && g * kInt4Group + i < K; ++i) {
            const int64_t high = i / 16, j = (i % 16) / 4, t = i % 4;
            data[((j * 3 + v) * 16 + c) * 4 + t] |= static_cast<uint8_t>(qp[n * K + g * kInt4Group + i] << (4 * high));
          }
        }
      }
    }
  });
  return packed;
}

struct Tile : TileRows {
  int64_t groups;
  const uint8_t* panel;   // [groups, 960]
  const float* bias;      // this panel's 48 biases, or nullptr
};

// A group's exact integer sums (isum[row][column vector]) folded into the rows' fp32 totals:
// acc += d * (scale * isum + min * gsum), with the block's 48 fp16 scales then minimums at `halves`, and
// gsum, d the first row's entries for the group (rows s_stride and d_stride apart).
template <int kRows>
inline void fold_group(const uint16_t* halves, const __m512i (&isum)[kRows][3], const int32_t* gsum, const float* d,
                       int64_t s_stride, int64_t d_stride, __m512 (&acc)[kRows][3]) {
  for (int v = 0; v < 3; ++v) {
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + v * 16)));
    const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves + kPanelCols + v * 16)));
    for (int i = 0; i < kRows; ++i) {
      const __m512 xs = _mm512_set1_ps(static_cast<float>(gsum[i * s_stride]));
      const __m512 part = _mm512_fmadd_ps(min, xs, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[i][v]), scale));
      acc[i][v] = _mm512_fmadd_ps(part, _mm512_set1_ps(d[i * d_stride]), acc[i][v]);
    }
  }
}

template <int kRows, typename scalar_t>
void tile_kernel(const Tile& t) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t d_stride = t.Kp / kActBlock, s_stride = t.Kp / kActGroup;
  __m512 acc[kRows][3];
  for (int i = 0; i < kRows; ++i) {
    for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* block = t.panel + g * kBlockBytes;
    const uint16_t* halves = reinterpret_cast<const uint16_t*>(block);
    const uint8_t* data = block + 4 * kPanelCols;
    const int8_t* xg = t.xq + g * kInt4Group;
    __m512i sum[kRows][3];
    for (int i = 0; i < kRows; ++i) {
      for (int v = 0; v < 3; ++v) sum[i][v] = _mm512_setzero_si512();
    }
    for (int64_t j = 0; j < 4; ++j) {
      for (int v = 0; v < 3; ++v) {
        const __m512i w = _mm512_loadu_si512(data + (j * 3 + v) * 64);
        const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        for (int i = 0; i < kRows; ++i) {
          const int8_t* xr = xg + i * t.Kp;
          sum[i][v] = _mm512_dpbusd_epi32(sum[i][v], lo, _mm512_set1_epi32(load_quad(xr + 4 * j)));
          sum[i][v] = _mm512_dpbusd_epi32(sum[i][v], hi, _mm512_set1_epi32(load_quad(xr + 16 + 4 * j)));
        }
      }
    }
    fold_group<kRows>(halves, sum, t.gsum + g, t.d + g / 2, s_stride, d_stride, acc);
  }
  store_tile_rows<kRows>(acc, t.bias, static_cast<scalar_t*>(t.y), t.N, t.cols);
}

// The packed blocks of one product, for run_vnni_product (act_quant.h).
struct Panels {
  const uint8_t* blocks;  // [ceil(N / 48), groups, 960]
  const float* bias;      // [ceil(N / 48) * 48], or nullptr
  int64_t groups;

  template <int kRows, typename scalar_t>
  void tile(int64_t panel, const TileRows& rows) const {
    Tile t;
    static_cast<TileRows&>(t) = rows;
    t.groups = groups;
    t.panel = blocks + panel * groups * kBlockBytes;
    t.bias = bias ? bias + panel * kPanelCols : nullptr;
    tile_kernel<kRows, scalar_t>(t);
  }
};

// The wide tiles (float32 models on VNNI builds: int16_activations): the same panel blocks, the activations
// rounded to int16 (act_quant.h's WideRows: xq = 256 hi + lo, both int8), two vpdpbusd sums per row and column
// vector (one of hi, one of lo) combined once per group into the exact isum = 256 S_hi + S_lo
// (|isum| <= 32 * 15 * 32639 < 2^24: exact in fp32 too), then the int8 tiles' fold. Each output adds its
// groups in order whatever the tile, so a row's result never depends on its batch.
struct WideTile {
  const uint8_t* panel;   // [groups, 960]
  int64_t groups;
  const int8_t* hi;       // first row's halves; rows Kp apart
  const int8_t* lo;
  const float* d;         // first row's scale per 64-block; rows Kp / 64 apart
  const int32_t* gsum;    // first row's sum of xq per 32-group; rows Kp / 32 apart
  int64_t Kp;
  const float* bias;      // this panel's 48 biases, or nullptr
  float* y;               // y[first row, first column of the panel]; rows N apart
  int64_t N, cols;
};

// Tiles of up to 2 rows: a row's 6 sums (hi and lo by 3 column vectors) and 3 totals take 9 of the 32
// registers; at 4 rows GCC kept sums on the stack and 4 rows took 1.6x as long as two 2-row tiles.
constexpr int64_t kWideTileRows = 2;

template <int kRows>
void wide_tile_kernel(const WideTile& t) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t d_stride = t.Kp / kActBlock, s_stride = t.Kp / kActGroup;
  __m512 acc[kRows][3];
  for (int i = 0; i < kRows; ++i) {
    for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < t.groups; ++g) {
    const uint8_t* block = t.panel + g * kBlockBytes;
    const uint16_t* halves = reinterpret_cast<const uint16_t*>(block);
    const uint8_t* data = block + 4 * kPanelCols;
    __m512i sum_hi[kRows][3], sum_lo[kRows][3];
    for (int i = 0; i < kRows; ++i) {
      for (int v = 0; v < 3; ++v) sum_hi[i][v] = sum_lo[i][v] = _mm512_setzero_si512();
    }
    for (int64_t j = 0; j < 4; ++j) {
      for (int v = 0; v < 3; ++v) {
        const __m512i w = _mm512_loadu_si512(data + (j * 3 + v) * 64);
        const __m512i wl = _mm512_and_si512(w, low), wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        for (int i = 0; i < kRows; ++i) {
          const int8_t* h = t.hi + i * t.Kp + g * kInt4Group;
          const int8_t* l = t.lo + i * t.Kp + g * kInt4Group;
          sum_hi[i][v] = _mm512_dpbusd_epi32(sum_hi[i][v], wl, _mm512_set1_epi32(load_quad(h + 4 * j)));
          sum_hi[i][v] = _mm512_dpbusd_epi32(sum_hi[i][v], wh, _mm512_set1_epi32(load_quad(h + 16 + 4 * j)));
          sum_lo[i][v] = _mm512_dpbusd_epi32(sum_lo[i][v], wl, _mm512_set1_epi32(load_quad(l + 4 * j)));
          sum_lo[i][v] = _mm512_dpbusd_epi32(sum_lo[i][v], wh, _mm512_set1_epi32(load_quad(l + 16 + 4 * j)));
        }
      }
    }
    for (int i = 0; i < kRows; ++i) {  // isum = 256 S_hi + S_lo, exact
      for (int v = 0; v < 3; ++v) sum_hi[i][v] = _mm512_add_epi32(_mm512_slli_epi32(sum_hi[i][v], 8), sum_lo[i][v]);
    }
    fold_group<kRows>(halves, sum_hi, t.gsum + g, t.d + g / 2, s_stride, d_stride, acc);
  }
  store_tile_rows<kRows>(acc, t.bias, t.y, t.N, t.cols);
}

// x [M, K] float32 times the panel blocks (+ bias) -> y [M, N] float32 on the wide tiles, without a tensor
// allocated: the rounded rows go to the team's shared scratch inside a Team (DecodeStep's forward_team), else
// to memory of this call's own; the units as run_vnni_product's.
void wide_product_into(const uint8_t* blocks, int64_t groups, const float* bias, const float* x, int64_t M, int64_t K,
                       float* y, int64_t N) {
  if (M == 0) return;
  const int64_t bytes = WideRows::bytes(M, K);
  const TeamSeat& seat = team_seat();
  std::vector<unsigned char> own;
  void* memory = seat.team ? seat.team->shared_scratch(bytes, seat.rank) : (own.resize(bytes), own.data());
  const WideRows rows = WideRows::in(memory, M, K);
  round_wide_rows(x, M, K, rows);
  const int64_t Kp = rows.Kp, num_panels = ceil_div(N, kPanelCols);
  const ProductUnits units = product_units(num_panels, M, kWideTileRows, Kp);
  parallel_shared(units.count(), [&](SharedWork::Cursor& cursor) {
    for (int64_t u; (u = cursor.next()) >= 0;) {
      const int64_t panel = units.panel(u);
      for (int64_t rb = units.first_block(u); rb < units.last_block(u); ++rb) {
        const int64_t m0 = rb * kWideTileRows, n_rows = std::min(kWideTileRows, M - m0);
        const WideTile t{blocks + panel * groups * kBlockBytes, groups, rows.hi + m0 * Kp, rows.lo + m0 * Kp,
                         rows.d + m0 * (Kp / kActBlock), rows.gsum + m0 * (Kp / kActGroup), Kp,
                         bias ? bias + panel * kPanelCols : nullptr, y + m0 * N + panel * kPanelCols, N,
                         std::min(kPanelCols, N - panel * kPanelCols)};
        if (n_rows == 1) {
          wide_tile_kernel<1>(t);
        } else {
          wide_tile_kernel<2>(t);
        }
      }
    }
  });
}

at::Tensor product_avx512(const at::Tensor& x, const at::Tensor& packed, const float* bp, int64_t N) {
  return run_vnni_product(x, N, Panels{packed.data_ptr<uint8_t>(), bp, packed.size(1)});
}
#endif

#if PAGECLI_INT4_AVX2
// The AVX2 layout (panel_i16.h's pairs at 4 bits): uint8 [ceil(N / 16), Kp / 2, 16] where byte
// 2 c + t of pair j of panel p holds column 16 p + c's q at k = 2 j + t in its low nibble and column
// 16 p + 8 + c's in its high one (zero past N and K), and per panel and group of 32 k the columns'
// scales then minimums, fp16 [ceil(N / 16), Kp / 32, 2, 16] as given (zero past N and K), widened
// once per group. A pair is one
// 16-byte load widened to int16, its nibbles split by a mask and a shift. Per group:
// y += d * (scale * isum + min * gsum), isum exact in fp32 (|isum| <= 32 * 15 * 32767 < 2^24).
constexpr int64_t kNibblePairBytes = kPanelF32Cols;

struct Int4Pairs {
  static constexpr int64_t kGroupPairs = kInt4Group / 2;
  const uint8_t* data;
  const uint16_t* scale_min;  // fp16 bits
  int64_t pairs, groups;

  void widen(int64_t p, int64_t j, __m256i& lo, __m256i& hi) const {
    const __m256i v = _mm256_cvtepu8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + (p * pairs + j) * kNibblePairBytes)));
    lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(v, 4);
  }

  struct Scales {
    __m256 scale, min;
  };

  Scales scales(int64_t p, int64_t g, int half) const {
    const uint16_t* sm = scale_min + (p * groups + g) * 2 * kPanelF32Cols + 8 * half;
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + kPanelF32Cols)))};
  }

  static __m256 fold(const Scales& s, __m256 isum, float d, float gsum, __m256 acc) {
    const __m256 t = _mm256_fmadd_ps(s.min, _mm256_set1_ps(gsum), _mm256_mul_ps(s.scale, isum));
    return _mm256_fmadd_ps(_mm256_set1_ps(d), t, acc);
  }

#if PAGECLI_PANEL_I16_512
  // The same on a whole panel (columns 0-15 in order, panel_i16.h's 512-bit tiles): each lane's numbers
  // and operations are widen's, scales' and fold's.
  __m512i widen512(int64_t p, int64_t j) const {
    const __m256i v = _mm256_cvtepu8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + (p * pairs + j) * kNibblePairBytes)));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, _mm256_set1_epi16(0x0F))),
                              _mm256_srli_epi16(v, 4), 1);
  }

  struct Scales512 {
    __m512 scale, min;
  };

  Scales512 scales512(int64_t p, int64_t g) const {
    const uint16_t* sm = scale_min + (p * groups + g) * 2 * kPanelF32Cols;
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm))),
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + kPanelF32Cols)))};
  }

  static __m512 fold512(const Scales512& s, __m512 isum, float d, float gsum, __m512 acc) {
    const __m512 t = _mm512_fmadd_ps(s.min, _mm512_set1_ps(gsum), _mm512_mul_ps(s.scale, isum));
    return _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc);
  }
#endif
};

at::Tensor pack_nibble_pairs(const at::Tensor& q) {
  const int64_t N = q.size(0), K = q.size(1), Kp = act16_padded_k(K);
  auto packed = weight_zeros({ceil_div(N, kPanelF32Cols), Kp / 2, kNibblePairBytes}, at::kByte);
  pack_pair_panels(q.data_ptr<uint8_t>(), packed.data_ptr<uint8_t>(), N, K, Kp, kNibblePairBytes,
                   [](uint8_t* pair, int64_t c, int64_t t, uint8_t v) {
                     pair[2 * (c % 8) + t] |= static_cast<uint8_t>(v << (c < 8 ? 0 : 4));
                   });
  return packed;
}

// scale and min [N, G] fp16 -> fp16 [ceil(N / 16), groups, 2, 16] (groups >= G), zero past N and G.
at::Tensor panel_scale_min(const at::Tensor& scale, const at::Tensor& min, int64_t groups) {
  const int64_t N = scale.size(0), num_panels = ceil_div(N, kPanelF32Cols);
  auto padded = at::zeros({num_panels * kPanelF32Cols, groups, 2}, scale.options().dtype(at::kHalf));
  padded.narrow(0, 0, N).narrow(1, 0, scale.size(1)).copy_(at::stack({scale, min}, 2));
  // [panels, 16, groups, 2] -> [panels, groups, 2, 16]
  return padded.view({num_panels, kPanelF32Cols, groups, 2}).permute({0, 2, 3, 1}).contiguous();
}
#endif

}  // namespace

PackedLinearInt4::PackedLinearInt4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& min,
                                   const c10::optional<at::Tensor>& bias, bool int16_activations)
    : N_(q.dim() == 2 ? q.size(0) : 0), K_(q.dim() == 2 ? q.size(1) : 0),
      vnni_(PAGECLI_INT4_VNNI), wide_(PAGECLI_INT4_VNNI && int16_activations) {
  TORCH_CHECK(vnni_ || PAGECLI_INT4_AVX2, "the int4 products need AVX2 or AVX512-VNNI, which this build lacks");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() && N_ > 0 &&
                  K_ > 0,
              "PackedLinearInt4 takes a contiguous uint8 [N, K] CPU weight");
  const int64_t groups = ceil_div(K_, kInt4Group);
  for (const at::Tensor* t : {&scale, &min}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 2 && t->size(0) == N_ && t->size(1) == groups,
                "scale and min must be fp16 [N, ceil(K / 32)] = [", N_, ", ", groups, "]");
  }
  TORCH_CHECK(q.max().item<int>() <= 15, "q holds 4-bit values: 0 to 15");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N_, "bias must have N = ", N_, " values");
    bias_ = padded_fp32(*bias, N_);
  }
#if PAGECLI_INT4_VNNI
  if (vnni_) {
    weights_ = pack_int4(q, scale.contiguous(), min.contiguous());
    return;
  }
#endif
#if PAGECLI_INT4_AVX2
  weights_ = pack_nibble_pairs(q);
  scale_min_ = panel_scale_min(scale, min, act16_padded_k(K_) / kInt4Group);
#endif
}

at::Tensor PackedLinearInt4::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K_, "PackedLinearInt4 takes x [..., ", K_, "]");
  const at::Tensor x2 = x.reshape({-1, K_}).contiguous();  // [M, K]
  at::Tensor y;
#if PAGECLI_INT4_VNNI
  if (vnni_) {
    y = wide_ ? forward_via_into(x2) : product_avx512(x2, weights_, bias_.defined() ? bias_.data_ptr<float>() : nullptr, N_);
  }
#endif
#if PAGECLI_INT4_AVX2
  if (!vnni_) y = forward_via_into(x2);
#endif
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N_;
  return y.view(shape);
}

bool PackedLinearInt4::runs_into() const { return wide_ || (PAGECLI_INT4_AVX2 && !vnni_); }

void PackedLinearInt4::forward_into(const at::Tensor& x, at::Tensor& y) const {
#if PAGECLI_INT4_VNNI
  if (wide_) {
    wide_product_into(weights_.data_ptr<uint8_t>(), weights_.size(1), bias_.defined() ? bias_.data_ptr<float>() : nullptr,
                      x.data_ptr<float>(), x.size(0), K_, y.data_ptr<float>(), N_);
    return;
  }
#endif
#if PAGECLI_INT4_AVX2
  if (!vnni_) {
    const Int4Pairs w{weights_.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale_min_.data_ptr<at::Half>()),
                      weights_.size(1), scale_min_.size(1)};
    panel_product16_into(w, x.data_ptr<float>(), x.size(0), K_, bias_.defined() ? bias_.data_ptr<float>() : nullptr,
                         y.data_ptr<float>(), N_);
    return;
  }
#endif
  PackedProduct::forward_into(x, y);
}

at::Tensor PackedLinearInt4::scales() const {
  return scale_min_.defined() ? scale_min_ : at::empty({0}, weights_.options().dtype(at::kFloat));
}

const char* PackedLinearInt4::kind() const { return wide_ ? "avx512_vnni_i16" : vnni_ ? "avx512_vnni" : "avx2"; }

const char* int4_linear_kind() {
  return PAGECLI_INT4_VNNI ? "avx512_vnni" : PAGECLI_INT4_AVX2 ? "avx2" : "";
}

}  // namespace pagecli
