// Float32 activations times weights kept in 16-column panels, in bfloat16 where every value is one
// (float_panels.h), for float32 models on the avx2 level: CPUs without bf16 arithmetic (AMD Zen 2/3,
// Intel before Cooper Lake, most laptops). Other weights keep float32 in the same panels: the tile
// streams them at the memory's rate, where PyTorch's float32 product of a few rows does not.
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
// masking off the low half is columns 8-15, each in column order, so no shuffle is needed. The
// product is panel_f32.h's register tile.

#include "float_panels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "panel_f32.h"
#include "weight_memory.h"

namespace pagecli {
namespace {

constexpr int64_t kCols = kPanelF32Cols;

// Where column c of a panel lies in a row of 16 bf16: word c % 8, its low half for c < 8.
int64_t bf16_slot(int64_t c) { return c < 8 ? 2 * c : 2 * (c - 8) + 1; }

#if PAGECLI_PANEL_F32
struct Bf16Panels {
  const uint16_t* data;  // [ceil(N / 16), K, 16]
  int64_t K;

  void widen(int64_t p, int64_t k, __m256& lo, __m256& hi) const {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + (p * K + k) * kCols));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};

// Weights bfloat16 cannot hold (a float32 checkpoint, a model dequantized from a GGUF file): the same
// panels in float32, columns in order, two loads.
struct F32Panels {
  const float* data;  // [ceil(N / 16), K, 16]
  int64_t K;

  void widen(int64_t p, int64_t k, __m256& lo, __m256& hi) const {
    const float* row = data + (p * K + k) * kCols;
    lo = _mm256_loadu_ps(row);
    hi = _mm256_loadu_ps(row + 8);
  }
};
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

bool has_bf16_weight_linear() { return PAGECLI_PANEL_F32; }

F32PanelLinear::F32PanelLinear(const at::Tensor& w, const c10::optional<at::Tensor>& bias)
    : N_(w.dim() == 2 ? w.size(0) : 0), K_(w.dim() == 2 ? w.size(1) : 0) {
  TORCH_CHECK(PAGECLI_PANEL_F32, "F32PanelLinear needs AVX2 and FMA, which this build lacks");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && N_ > 0 && K_ > 0 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "F32PanelLinear takes a float32 or bf16 [N, K] CPU weight");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N_, "bias must have N = ", N_, " values");
    bias_ = bias->to(at::kFloat).contiguous().clone();
  }
  const int64_t num_panels = ceil_div(N_, kCols);
  if (w.scalar_type() == at::kBFloat16 || bf16_exact(w)) {
    const at::Tensor src = w.to(at::kBFloat16).contiguous();  // exact
    panels_ = weight_zeros({num_panels, K_, kCols}, at::kBFloat16);
    pack_f32_panels(reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>()),
                    reinterpret_cast<uint16_t*>(panels_.data_ptr<at::BFloat16>()), N_, K_, bf16_slot);
  } else {
    const at::Tensor src = w.contiguous();
    panels_ = weight_zeros({num_panels, K_, kCols}, at::kFloat);
    pack_f32_panels(src.data_ptr<float>(), panels_.data_ptr<float>(), N_, K_, [](int64_t c) { return c; });
  }
}

at::Tensor F32PanelLinear::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == K_ && x.scalar_type() == at::kFloat,
              "F32PanelLinear takes float32 x [..., ", K_, "]");
  const at::Tensor y = forward_via_into(x.reshape({-1, K_}));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N_;
  return y.view(shape);
}

bool F32PanelLinear::runs_into() const { return PAGECLI_PANEL_F32; }

void F32PanelLinear::forward_into(const at::Tensor& x, at::Tensor& y) const { product_into(x, y, nullptr); }

void F32PanelLinear::product_into(const at::Tensor& x, at::Tensor& y, GreedyChoices* choices) const {
#if PAGECLI_PANEL_F32
  const float* bp = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t M = x.size(0);
  if (panels_.scalar_type() == at::kBFloat16) {
    panel_product(Bf16Panels{reinterpret_cast<const uint16_t*>(panels_.data_ptr<at::BFloat16>()), K_}, xp, bp, yp, M, N_,
                  K_, choices);
  } else {
    panel_product(F32Panels{panels_.data_ptr<float>(), K_}, xp, bp, yp, M, N_, K_, choices);
  }
#else
  PackedProduct::forward_into(x, y);
#endif
}

std::tuple<at::Tensor, at::Tensor> F32PanelLinear::forward_choosing(const at::Tensor& x) const {
  if (!runs_into() || x.dim() != 2 || !x.device().is_cpu() || x.scalar_type() != at::kFloat || x.size(1) != K_) {
    return PackedProduct::forward_choosing(x);
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({xc.size(0), N_}, xc.options());  // [M, N]
  GreedyChoices choices(xc.size(0));
  product_into(xc, y, &choices);
  return {y, choices.finish(y)};
}

at::Tensor F32PanelLinear::rows(const at::Tensor& ids) const {
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t count = flat.numel(), K = K_;
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N_, "row id ", ip[i], " out of range");
  auto out = at::empty({count, K_}, panels_.options().dtype(at::kFloat));
  uint32_t* op = reinterpret_cast<uint32_t*>(out.data_ptr<float>());
  const bool bf16 = panels_.scalar_type() == at::kBFloat16;
  const uint16_t* d16 = bf16 ? reinterpret_cast<const uint16_t*>(panels_.data_ptr<at::BFloat16>()) : nullptr;
  const uint32_t* d32 = bf16 ? nullptr : reinterpret_cast<const uint32_t*>(panels_.data_ptr<float>());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = ip[i] / kCols, c = ip[i] % kCols;
      if (bf16) {
        const uint16_t* src = d16 + p * K * kCols + bf16_slot(c);
        for (int64_t k = 0; k < K; ++k) op[i * K + k] = static_cast<uint32_t>(src[k * kCols]) << 16;
      } else {
        const uint32_t* src = d32 + p * K * kCols + c;
        for (int64_t k = 0; k < K; ++k) op[i * K + k] = src[k * kCols];
      }
    }
  });
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K_);
  return out.view(shape);
}

}  // namespace pagecli
