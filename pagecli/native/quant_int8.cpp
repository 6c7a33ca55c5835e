// Activations times int8 weights quantized at load (a bf16 scale per output channel and block of 64
// along k): the quantized products of the decoder's Linears (quant_int8.h). Decode on a CPU is bound
// by the bytes of weights read per token; int8 halves them against bf16 (the scales add 3%). Prefill
// is bound by multiply-adds: VNNI's vpdpbusd does 64 int8 products per instruction where vdpbf16ps
// does 32 bf16 ones.
//
// AVX512-VNNI kernel: each call rounds its activations to int8 in blocks of 64 along k (a scale per
// row and block: d = max |x| / 127, xq = round(x * (127 / max |x|))), the way llama.cpp's Q8 activations go (in
// blocks of 32 there). A block's products are summed exactly in int32 (vpdpbusd takes the weights
// as unsigned bytes, q + 128, and the sum starts at -128 * sum(xq) to undo the offset), then the
// int32 sum (exact in fp32: |sum| < 2^21) is multiplied by d times the block's weight scale and
// added to an fp32 accumulator, blocks in order; the bias comes last. The weights' blocks are the
// activations' blocks, so each exact sum takes one product. Every output sums its blocks in the same
// order whatever the batch, and each block's sum is exact, so a row gets the same bits alone or in
// any batch. The loss (perplexity of SmolLM2-135M on tests/data/declaration.txt): in
// pagecli/models/quantize.py.
//
// Packed weights: uint8 [ceil(N / 48), Kp / 4, 48, 4] with Kp = K rounded up to 64,
// packed[p, j, c, t] = q[48 p + c, 4 j + t] + 128, 128 (q = 0) past N or K. A panel's k quad j is
// three zmm vectors whose lane c holds column c's four bytes: vpdpbusd's operand layout against
// xq[m, 4 j : 4 j + 4] broadcast to every lane. Scales: bf16 bits [ceil(N / 48), Kp / 64, 48], zero
// past N: a panel's block b is three zmm vectors once widened.
//
// Register tile: 4 rows by one panel: 12 int32 block sums and 12 fp32 accumulators, the 3 weight
// vectors of the quad and the broadcast (28 of the 32 zmm registers). Each quad costs 3 loads and 4
// broadcasts for 12 vpdpbusd; each block 3 scale loads and 12 multiplies more.
//
// AVX2 kernel (panel_i16.h): the activations rounded to int16 per row and 64-block, q in 16-column
// panels in k pairs widened to int16, a block's products summed in int32 by vpmaddwd (two k per
// lane), then the same block formula as the VNNI kernel's with d = max |x| / 32767. VNNI builds
// have it too, for float32 models (int16_activations).

#include "quant_int8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "act_quant.h"
#include "greedy_choices.h"
#include "panel_i16.h"
#include "weight_memory.h"
#include "work_share.h"

// Two kernels, both built where the instruction sets allow: VNNI (int8 activations) and AVX2 (int16
// activations, which float32 models ask for on a VNNI CPU too: PackedLinearInt8's int16_activations).
#define PAGECLI_INT8_VNNI PAGECLI_HAVE_VNNI
#if defined(__AVX2__) && defined(__FMA__)
#define PAGECLI_INT8_AVX2 1
#include <immintrin.h>
#else
#define PAGECLI_INT8_AVX2 0
#endif

namespace pagecli {
namespace {

// scale [N, B] (bf16, or fp16 for Q8_0 blocks) -> [ceil(N / cols), blocks, cols] (blocks >= B), zero
// past N and B: each panel's scales, a block at a time (the VNNI panels' 48 columns, the AVX2 panels' 16).
at::Tensor scales_by_panel(const at::Tensor& scale, int64_t cols, int64_t blocks) {
  const int64_t N = scale.size(0), B = blocks, num_panels = ceil_div(N, cols);
  auto padded = at::zeros({num_panels * cols, B}, scale.options());
  padded.narrow(0, 0, N).narrow(1, 0, scale.size(1)).copy_(scale);
  return padded.view({num_panels, cols, B}).transpose(1, 2).contiguous();
}

constexpr int64_t kPanelCols = kPackedPanelCols;  // output columns per panel (gemm_bf16.h's layout)

#if PAGECLI_INT8_VNNI
constexpr int64_t kQuadsPerBlock = kActBlock / 4;  // k quads per activation block (act_quant.h)
constexpr int64_t kQuadBytes = kPanelCols * 4;    // 192: one k quad of a panel

// q [N, K] int8 -> uint8 [ceil(N / 48), Kp / 4, 48, 4] of q + 128 (layout above).
at::Tensor pack_int8(const at::Tensor& q) {
  const int64_t N = q.size(0), K = q.size(1), num_panels = ceil_div(N, kPanelCols), quads = act_padded_k(K) / 4;
  auto packed = weight_zeros({num_panels, quads, kPanelCols, 4}, at::kByte).fill_(128);
  const int8_t* src = q.data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t c = 0; c < kPanelCols && p * kPanelCols + c < N; ++c) {
        const int8_t* row = src + (p * kPanelCols + c) * K;
        for (int64_t k = 0; k < K; ++k) {
          dst[((p * quads + k / 4) * kPanelCols + c) * 4 + k % 4] = static_cast<uint8_t>(row[k] + 128);
        }
      }
    }
  });
  return packed;
}


struct Tile : TileRows {
  int64_t blocks;          // Kp / 64
  const uint8_t* panel;    // [Kp / 4, 48, 4]
  const uint16_t* wscale;  // this panel's weight scales, bf16 bits [blocks, 48]
  const float* bias;       // this panel's 48 biases, or nullptr
};

template <int kRows, typename scalar_t>
void tile_kernel(const Tile& t) {
  __m512 acc[kRows][3];
  for (int i = 0; i < kRows; ++i) {
    for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < t.blocks; ++b) {
    __m512i sum[kRows][3];
    for (int i = 0; i < kRows; ++i) {
      const int32_t* sums = t.gsum + i * 2 * t.blocks + 2 * b;
      const __m512i start = _mm512_set1_epi32(-128 * (sums[0] + sums[1]));  // undoes the weights' +128
      for (int v = 0; v < 3; ++v) sum[i][v] = start;
    }
    const uint8_t* quads = t.panel + b * kQuadsPerBlock * kQuadBytes;
    const int8_t* xb = t.xq + b * kActBlock;
    for (int64_t j = 0; j < kQuadsPerBlock; ++j) {
      const uint8_t* w = quads + j * kQuadBytes;
      const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128);
      for (int i = 0; i < kRows; ++i) {
        const __m512i xv = _mm512_set1_epi32(load_quad(xb + i * t.Kp + 4 * j));
        sum[i][0] = _mm512_dpbusd_epi32(sum[i][0], w0, xv);
        sum[i][1] = _mm512_dpbusd_epi32(sum[i][1], w1, xv);
        sum[i][2] = _mm512_dpbusd_epi32(sum[i][2], w2, xv);
      }
    }
    for (int v = 0; v < 3; ++v) {  // one scale vector live at a time: the tile holds 28 registers already
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.wscale + b * kPanelCols + 16 * v));
      const __m512 ws = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));  // bf16 -> fp32
      for (int i = 0; i < kRows; ++i) {
        const __m512 ds = _mm512_mul_ps(_mm512_set1_ps(t.d[i * t.blocks + b]), ws);
        acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][v]), ds, acc[i][v]);
      }
    }
  }
  store_tile_rows<kRows>(acc, t.bias, static_cast<scalar_t*>(t.y), t.N, t.cols);
}

// The packed weights of one product, for run_vnni_product (act_quant.h).
struct Panels {
  const uint8_t* weights;  // [ceil(N / 48), Kp / 4, 48, 4]
  const uint16_t* scales;  // [ceil(N / 48), Kp / 64, 48]
  const float* bias;       // [ceil(N / 48) * 48], or nullptr
  int64_t blocks, panel_bytes;

  template <int kRows, typename scalar_t>
  void tile(int64_t panel, const TileRows& rows) const {
    Tile t;
    static_cast<TileRows&>(t) = rows;
    t.blocks = blocks;
    t.panel = weights + panel * panel_bytes;
    t.wscale = scales + panel * blocks * kPanelCols;
    t.bias = bias ? bias + panel * kPanelCols : nullptr;
    tile_kernel<kRows, scalar_t>(t);
  }
};

at::Tensor product_avx512(const at::Tensor& x, const at::Tensor& packed, const uint16_t* sp, const float* bp,
                          int64_t N, int64_t K, GreedyChoices* choices = nullptr) {
  const int64_t Kp = act_padded_k(K);
  return run_vnni_product(x, N, Panels{packed.data_ptr<uint8_t>(), sp, bp, Kp / kActBlock, Kp / 4 * kQuadBytes},
                          choices);
}
#endif

#if PAGECLI_INT8_AVX2
// The AVX2 layout (panel_i16.h's pairs): int8 [ceil(N / 16), Kp / 2, 32] where pair j of panel p holds
// columns 16 p + 0-7 in its first 16 bytes and 16 p + 8-15 in the next, byte 2 c + t of each half
// column c's q at k = 2 j + t (zero past N and K), and the bf16 scales [ceil(N / 16), Kp / 64, 16]
// (zero past N). A 64-block's int32 sums (|sum| < 2^28) take d times the columns' scales. GGUF's
// Q8_0 blocks run as they lie: kBlock 32 with their fp16 scales (the same kernel, a fold per 32 k).
constexpr int64_t kPairBytes = 2 * kPanelF32Cols;

template <int64_t kBlock, bool kHalfScales>
struct Int8Pairs {
  static constexpr int64_t kGroupPairs = kBlock / 2;  // one scale per block
  const int8_t* data;
  const uint16_t* scale;  // bf16 bits, or fp16 ones (kHalfScales)
  int64_t pairs, blocks;

  void widen(int64_t p, int64_t j, __m256i& lo, __m256i& hi) const {
    const int8_t* w = data + (p * pairs + j) * kPairBytes;
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kPanelF32Cols)));
  }

  struct Scales {
    __m256 ws;
  };

  Scales scales(int64_t p, int64_t block, int half) const {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + (p * blocks + block) * kPanelF32Cols + 8 * half));
    if constexpr (kHalfScales) return {_mm256_cvtph_ps(bits)};
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))};  // bf16 -> fp32
  }

  static __m256 fold(const Scales& s, __m256 isum, float d, float, __m256 acc) {
    return _mm256_fmadd_ps(isum, _mm256_mul_ps(_mm256_set1_ps(d), s.ws), acc);
  }

#if PAGECLI_PANEL_I16_512
  // The same on a whole panel (columns 0-15 in order, panel_i16.h's 512-bit tiles): each lane's numbers
  // and operations are widen's, scales' and fold's.
  __m512i widen512(int64_t p, int64_t j) const {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + (p * pairs + j) * kPairBytes)));
  }

  struct Scales512 {
    __m512 ws;
  };

  Scales512 scales512(int64_t p, int64_t block) const {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + (p * blocks + block) * kPanelF32Cols));
    if constexpr (kHalfScales) return {_mm512_cvtph_ps(bits)};
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};  // bf16 -> fp32
  }

  static __m512 fold512(const Scales512& s, __m512 isum, float d, float, __m512 acc) {
    return _mm512_fmadd_ps(isum, _mm512_mul_ps(_mm512_set1_ps(d), s.ws), acc);
  }
#endif
};

at::Tensor pack_int8_pairs(const at::Tensor& q) {
  const int64_t N = q.size(0), K = q.size(1), Kp = act16_padded_k(K);
  auto packed = weight_zeros({ceil_div(N, kPanelF32Cols), Kp / 2, kPairBytes}, at::kChar);
  pack_pair_panels(q.data_ptr<int8_t>(), packed.data_ptr<int8_t>(), N, K, Kp, kPairBytes,
                   [](int8_t* pair, int64_t c, int64_t t, int8_t v) { pair[c / 8 * 16 + 2 * (c % 8) + t] = v; });
  return packed;
}
#endif

}  // namespace

PackedLinearInt8::PackedLinearInt8(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                                   bool int16_activations)
    : N_(q.size(0)), K_(q.dim() == 2 ? q.size(1) : 0), vnni_(PAGECLI_INT8_VNNI && !int16_activations) {
  TORCH_CHECK(vnni_ || PAGECLI_INT8_AVX2, "the int8 products need AVX2 or AVX512-VNNI, which this build lacks");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && N_ > 0 &&
                  K_ > 0,
              "PackedLinearInt8 takes a contiguous int8 [N, K] CPU weight");
  const int64_t blocks = ceil_div(K_, kActBlock), q8_blocks = ceil_div(K_, kQ8Block);
  q8_0_ = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N_ &&
                  ((scale.scalar_type() == at::kBFloat16 && scale.size(1) == blocks) ||
                   (q8_0_ && scale.size(1) == q8_blocks)),
              "scale must be bf16 [N, ceil(K / 64)] = [", N_, ", ", blocks, "] or, for Q8_0 blocks, fp16 [N, ceil(K / 32)] = [",
              N_, ", ", q8_blocks, "]");
  TORCH_CHECK(!(q8_0_ && vnni_), "Q8_0 blocks (fp16 scales per 32) run on the AVX2 kernel only: pass int16_activations");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N_, "bias must have N = ", N_, " values");
    bias_ = padded_fp32(*bias, N_);
  }
#if PAGECLI_INT8_VNNI
  if (vnni_) {
    weights_ = pack_int8(q);
    scale_ = scales_by_panel(scale, kPanelCols, scale.size(1));
    return;
  }
#endif
#if PAGECLI_INT8_AVX2
  weights_ = pack_int8_pairs(q);
  scale_ = scales_by_panel(scale, kPanelF32Cols, act16_padded_k(K_) / (q8_0_ ? kQ8Block : kActBlock));
#endif
}

at::Tensor PackedLinearInt8::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K_, "PackedLinearInt8 takes x [..., ", K_, "]");
  const at::Tensor x2 = x.reshape({-1, K_}).contiguous();  // [M, K]
  at::Tensor y;
#if PAGECLI_INT8_VNNI
  if (vnni_) {
    const float* bp = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
    y = product_avx512(x2, weights_, reinterpret_cast<const uint16_t*>(scale_.data_ptr<at::BFloat16>()), bp, N_, K_);
  }
#endif
#if PAGECLI_INT8_AVX2
  if (!vnni_) y = forward_via_into(x2);
#endif
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N_;
  return y.view(shape);
}

bool PackedLinearInt8::runs_into() const { return PAGECLI_INT8_AVX2 && !vnni_; }

void PackedLinearInt8::forward_into(const at::Tensor& x, at::Tensor& y) const { product16_into(x, y, nullptr); }

std::tuple<at::Tensor, at::Tensor> PackedLinearInt8::forward_choosing(const at::Tensor& x) const {
  if (x.dim() != 2 || !x.device().is_cpu() || x.size(1) != K_) return PackedProduct::forward_choosing(x);
  const at::Tensor xc = x.contiguous();
  GreedyChoices choices(xc.size(0));
#if PAGECLI_INT8_VNNI
  if (vnni_) {
    const float* bp = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
    at::Tensor y = product_avx512(xc, weights_, reinterpret_cast<const uint16_t*>(scale_.data_ptr<at::BFloat16>()), bp,
                                  N_, K_, &choices);
    return {y, choices.finish(y)};
  }
#endif
  if (runs_into() && xc.scalar_type() == at::kFloat) {
    at::Tensor y = at::empty({xc.size(0), N_}, xc.options());  // [M, N]
    product16_into(xc, y, &choices);
    return {y, choices.finish(y)};
  }
  return PackedProduct::forward_choosing(x);  // another dtype: forward() rounds the float32 outputs to it
}

void PackedLinearInt8::product16_into(const at::Tensor& x, at::Tensor& y, GreedyChoices* choices) const {
#if PAGECLI_INT8_AVX2
  if (!vnni_) {
    const uint16_t* sp = static_cast<const uint16_t*>(scale_.data_ptr());
    const int8_t* wp = weights_.data_ptr<int8_t>();
    const float* bp = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t M = x.size(0);
    if (q8_0_) {
      panel_product16_into(Int8Pairs<kQ8Block, true>{wp, sp, weights_.size(1), scale_.size(1)}, xp, M, K_, bp, yp, N_,
                           choices);
    } else {
      panel_product16_into(Int8Pairs<kActBlock, false>{wp, sp, weights_.size(1), scale_.size(1)}, xp, M, K_, bp, yp, N_,
                           choices);
    }
    return;
  }
#endif
  PackedProduct::forward_into(x, y);
}

const char* PackedLinearInt8::kind() const { return vnni_ ? "avx512_vnni" : "avx2"; }

const char* int8_linear_kind() {
  return PAGECLI_INT8_VNNI ? "avx512_vnni" : PAGECLI_INT8_AVX2 ? "avx2" : "";
}

}  // namespace pagecli
