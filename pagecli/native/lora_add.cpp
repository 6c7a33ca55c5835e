// lora_add_ (lora_add.h): a step's low-rank adds, the down products per row (four of an adapter's A rows
// against one read of x), then the up products by column tiles over runs of rows that share an adapter (each
// adapter's b tile read from memory once per run, each row's outputs held in registers over the rank).
// bf16 and fp16 rows and stacks are widened to float32 as they are read (the stacks stay in the model's dtype:
// half the bytes a step reads), every sum runs in float32, and each output is rounded once.

#include "lora_add.h"

#include "simd.h"
#include "work_share.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace pagecli {
namespace {

constexpr int64_t kTile = 64;  // output columns per unit of the up products

#if defined(__AVX2__) && defined(__FMA__)
// 8 lanes of x, y or a stack widened to float32 (float32: as they are, so its sums are the same instructions),
// and stored back rounded to nearest-even, as c10's conversions round (bf16 NaN stays a quiet NaN).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32: widen and shift left
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#else
inline __m256 load8(const c10::Half* p) {
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(wide);
}
#endif
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(c10::Half* p, __m256 v) {
#if defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  alignas(32) float wide[8];
  _mm256_store_ps(wide, v);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::Half>(wide[i]);
#endif
}

// sum_k x[k] * a_j[k] for N rows a_j at once (x read once for all): per output 16 lanes, k in order within each
// lane (fused multiply-adds in float32), then the lanes in order. Every output's sum runs in this one order
// whatever N is.
template <int N, typename T>
void dots(const T* x, const T* const* a, int64_t n, float* out) {
  __m256 lo[N], hi[N];
  for (int j = 0; j < N; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256 x0 = load8(x + k), x1 = load8(x + k + 8);
    for (int j = 0; j < N; ++j) {
      lo[j] = _mm256_fmadd_ps(x0, load8(a[j] + k), lo[j]);
      hi[j] = _mm256_fmadd_ps(x1, load8(a[j] + k + 8), hi[j]);
    }
  }
  for (int j = 0; j < N; ++j) {
    alignas(32) float lane[16];
    _mm256_store_ps(lane, lo[j]);
    _mm256_store_ps(lane + 8, hi[j]);
    for (int64_t t = k, l = 0; t < n; ++t, ++l) lane[l] = std::fma(to_float(x[t]), to_float(a[j][t]), lane[l]);
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += lane[l];
    out[j] = sum;
  }
}

// o[c] += sum_j d[j] * b[j * width + c] for c < n, j ascending (fused), the o values held in registers in float32
// and rounded to T once, at the end.
template <typename T>
void axpys(T* o, const float* d, const T* b, int64_t rank, int64_t width, int64_t n) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    __m256 acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = load8(o + c + 8 * i);
    for (int64_t j = 0; j < rank; ++j) {
      const __m256 dj = _mm256_set1_ps(d[j]);
      const T* bj = b + j * width + c;
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(dj, load8(bj + 8 * i), acc[i]);
    }
    for (int i = 0; i < 4; ++i) store8(o + c + 8 * i, acc[i]);
  }
  for (; c + 8 <= n; c += 8) {
    __m256 acc = load8(o + c);
    for (int64_t j = 0; j < rank; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), load8(b + j * width + c), acc);
    store8(o + c, acc);
  }
  for (; c < n; ++c) {
    float acc = to_float(o[c]);
    for (int64_t j = 0; j < rank; ++j) acc = std::fma(d[j], to_float(b[j * width + c]), acc);
    o[c] = static_cast<T>(acc);
  }
}
#else
template <int N, typename T>
void dots(const T* x, const T* const* a, int64_t n, float* out) {
  for (int j = 0; j < N; ++j) {
    float lane[16] = {0};
    for (int64_t k = 0; k < n; ++k) lane[k % 16] = std::fma(to_float(x[k]), to_float(a[j][k]), lane[k % 16]);
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += lane[l];
    out[j] = sum;
  }
}

template <typename T>
void axpys(T* o, const float* d, const T* b, int64_t rank, int64_t width, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    float acc = to_float(o[c]);
    for (int64_t j = 0; j < rank; ++j) acc = std::fma(d[j], to_float(b[j * width + c]), acc);
    o[c] = static_cast<T>(acc);
  }
}
#endif

// Scratch for the rows' down products: the team's shared memory inside a DecodeStep team, else our own.
float* down_scratch(int64_t floats, std::vector<float>& own) {
  if (const TeamSeat& seat = team_seat(); seat.team) {
    return static_cast<float*>(seat.team->shared_scratch(floats * static_cast<int64_t>(sizeof(float)), seat.rank));
  }
  own.resize(floats);
  return own.data();
}

// lora_add_ over rows of T (float32, bf16 or fp16): the down products into float32 scratch, the up products'
// sums in float32, each output rounded to T once.
template <typename T>
void add_rows(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
              const int64_t* slot, const float* scale) {
  const int64_t rows = x.size(0), in = x.size(1), width = out.size(1), rank = a.size(1);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  std::vector<float> own;
  float* down = down_scratch(rows * rank, own);  // [rows, rank]: scale * x[r] @ a[slot].T
  parallel_shared(rows, [&](SharedWork::Cursor& cursor) {
    for (int64_t r; (r = cursor.next()) >= 0;) {
      if (slot[r] < 0) continue;
      const T* ar = ap + slot[r] * rank * in;
      const T* xr = xp + r * x_stride;
      float* dr = down + r * rank;
      int64_t j = 0;
      for (; j + 4 <= rank; j += 4) {
        const T* rows4[4] = {ar + j * in, ar + (j + 1) * in, ar + (j + 2) * in, ar + (j + 3) * in};
        dots<4>(xr, rows4, in, dr + j);
      }
      for (; j < rank; ++j) {
        const T* row = ar + j * in;
        dots<1>(xr, &row, in, dr + j);
      }
      for (j = 0; j < rank; ++j) dr[j] *= scale[r];
    }
  });
  const int64_t tiles = (width + kTile - 1) / kTile;
  parallel_shared(tiles, [&](SharedWork::Cursor& cursor) {
    for (int64_t t; (t = cursor.next()) >= 0;) {
      const int64_t c0 = t * kTile, n = std::min(kTile, width - c0);
      for (int64_t first = 0; first < rows;) {  // a run of rows of one slot: its b tile read once
        int64_t end = first + 1;
        while (end < rows && slot[end] == slot[first]) ++end;
        if (slot[first] >= 0) {
          const T* bs = bp + slot[first] * rank * width + c0;
          for (int64_t r = first; r < end; ++r) axpys(op + r * out_stride + c0, down + r * rank, bs, rank, width, n);
        }
        first = end;
      }
    }
  });
}

bool lora_dtype(at::ScalarType type) { return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf; }

}  // namespace

void lora_add_(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
               const torch::Tensor& row_slot, const torch::Tensor& row_scale) {
  TORCH_CHECK(lora_dtype(x.scalar_type()) && out.scalar_type() == x.scalar_type() &&
                  a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(),
              "lora_add_: x, out, a and b of one dtype: float32, bfloat16 or float16");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && x.size(0) == out.size(0),
              "lora_add_: x [rows, in] and out [rows, out] with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0) &&
                  a.size(1) == b.size(1) && a.size(2) == x.size(1) && b.size(2) == out.size(1),
              "lora_add_: a [slots, rank, in] and b [slots, rank, out] contiguous, of x's and out's widths");
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_scale.scalar_type() == at::kFloat &&
                  row_slot.is_contiguous() && row_scale.is_contiguous() && row_slot.numel() == x.size(0) &&
                  row_scale.numel() == x.size(0), "lora_add_: row_slot int64 and row_scale float32, one per row");
  const int64_t rows = x.size(0), slots = a.size(0);
  const int64_t* slot = row_slot.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slot[r] < slots, "lora_add_: a row's slot is out of range");
  const float* scale = row_scale.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kBFloat16: add_rows<c10::BFloat16>(out, x, a, b, slot, scale); break;
    case at::kHalf: add_rows<c10::Half>(out, x, a, b, slot, scale); break;
    default: add_rows<float>(out, x, a, b, slot, scale);
  }
}

LoraStacks::LoraStacks(std::vector<std::vector<c10::optional<torch::Tensor>>> layers) {
  for (auto& layer : layers) {
    TORCH_CHECK(layer.size() == 8, "LoraStacks: each layer needs a and b of its 4 products");
    std::vector<torch::Tensor> a(4), b(4);
    for (int which = 0; which < 4; ++which) {
      TORCH_CHECK(layer[2 * which].has_value() == layer[2 * which + 1].has_value(), "LoraStacks: a without b");
      if (!layer[2 * which].has_value()) continue;
      a[which] = *layer[2 * which];
      b[which] = *layer[2 * which + 1];
      TORCH_CHECK(a[which].is_contiguous() && b[which].is_contiguous() && lora_dtype(a[which].scalar_type()) &&
                      b[which].scalar_type() == a[which].scalar_type() &&
                      (!dtype_ || *dtype_ == a[which].scalar_type()),
                  "LoraStacks: contiguous stacks of one dtype (float32, bfloat16 or float16)");
      dtype_ = a[which].scalar_type();
    }
    a_.push_back(std::move(a));
    b_.push_back(std::move(b));
  }
}

void LoraStacks::add(int64_t layer, int64_t which, const torch::Tensor& x, torch::Tensor out,
                     const torch::Tensor& row_slot, const torch::Tensor& row_scale) const {
  TORCH_CHECK(layer >= 0 && layer < num_layers() && which >= 0 && which < 4, "LoraStacks.add: no such product");
  if (!a_[layer][which].defined()) return;
  lora_add_(out, x, a_[layer][which], b_[layer][which], row_slot, row_scale);
}

}  // namespace pagecli
