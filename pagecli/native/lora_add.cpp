// lora_add_ (lora_add.h): a step's low-rank adds, the down products per row (four of an adapter's A rows
// against one read of x), then the up products by column tiles over runs of rows that share an adapter (each
// adapter's b tile read from memory once per run, each row's outputs held in registers over the rank).

#include "lora_add.h"

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
// sum_k x[k] * a_j[k] for N rows a_j at once (x read once for all): per output 16 lanes, k in order within each
// lane (fused multiply-adds), then the lanes in order. Every output's sum runs in this one order whatever N is.
template <int N>
void dots(const float* x, const float* const* a, int64_t n, float* out) {
  __m256 lo[N], hi[N];
  for (int j = 0; j < N; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int j = 0; j < N; ++j) {
      lo[j] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(a[j] + k), lo[j]);
      hi[j] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(a[j] + k + 8), hi[j]);
    }
  }
  for (int j = 0; j < N; ++j) {
    alignas(32) float lane[16];
    _mm256_store_ps(lane, lo[j]);
    _mm256_store_ps(lane + 8, hi[j]);
    for (int64_t t = k, l = 0; t < n; ++t, ++l) lane[l] = std::fma(x[t], a[j][t], lane[l]);
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += lane[l];
    out[j] = sum;
  }
}

// o[c] += sum_j d[j] * b[j * width + c] for c < n, j ascending (fused), the o values held in registers.
void axpys(float* o, const float* d, const float* b, int64_t rank, int64_t width, int64_t n) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    __m256 acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = _mm256_loadu_ps(o + c + 8 * i);
    for (int64_t j = 0; j < rank; ++j) {
      const __m256 dj = _mm256_set1_ps(d[j]);
      const float* bj = b + j * width + c;
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(dj, _mm256_loadu_ps(bj + 8 * i), acc[i]);
    }
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + c + 8 * i, acc[i]);
  }
  for (; c + 8 <= n; c += 8) {
    __m256 acc = _mm256_loadu_ps(o + c);
    for (int64_t j = 0; j < rank; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), _mm256_loadu_ps(b + j * width + c), acc);
    _mm256_storeu_ps(o + c, acc);
  }
  for (; c < n; ++c) {
    float acc = o[c];
    for (int64_t j = 0; j < rank; ++j) acc = std::fma(d[j], b[j * width + c], acc);
    o[c] = acc;
  }
}
#else
template <int N>
void dots(const float* x, const float* const* a, int64_t n, float* out) {
  for (int j = 0; j < N; ++j) {
    float lane[16] = {0};
    for (int64_t k = 0; k < n; ++k) lane[k % 16] = std::fma(x[k], a[j][k], lane[k % 16]);
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += lane[l];
    out[j] = sum;
  }
}

void axpys(float* o, const float* d, const float* b, int64_t rank, int64_t width, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    float acc = o[c];
    for (int64_t j = 0; j < rank; ++j) acc = std::fma(d[j], b[j * width + c], acc);
    o[c] = acc;
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

}  // namespace

void lora_add_(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
               const torch::Tensor& row_slot, const torch::Tensor& row_scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat, "lora_add_ runs float32");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && x.size(0) == out.size(0),
              "lora_add_: x [rows, in] and out [rows, out] with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0) &&
                  a.size(1) == b.size(1) && a.size(2) == x.size(1) && b.size(2) == out.size(1),
              "lora_add_: a [slots, rank, in] and b [slots, rank, out] contiguous, of x's and out's widths");
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_scale.scalar_type() == at::kFloat &&
                  row_slot.is_contiguous() && row_scale.is_contiguous() && row_slot.numel() == x.size(0) &&
                  row_scale.numel() == x.size(0), "lora_add_: row_slot int64 and row_scale float32, one per row");
  const int64_t rows = x.size(0), in = x.size(1), width = out.size(1), rank = a.size(1), slots = a.size(0);
  const int64_t* slot = row_slot.data_ptr<int64_t>();
  const float* scale = row_scale.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slot[r] < slots, "lora_add_: a row's slot is out of range");
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  std::vector<float> own;
  float* down = down_scratch(rows * rank, own);  // [rows, rank]: scale * x[r] @ a[slot].T
  parallel_shared(rows, [&](SharedWork::Cursor& cursor) {
    for (int64_t r; (r = cursor.next()) >= 0;) {
      if (slot[r] < 0) continue;
      const float* ar = ap + slot[r] * rank * in;
      const float* xr = xp + r * x_stride;
      float* dr = down + r * rank;
      int64_t j = 0;
      for (; j + 4 <= rank; j += 4) {
        const float* rows4[4] = {ar + j * in, ar + (j + 1) * in, ar + (j + 2) * in, ar + (j + 3) * in};
        dots<4>(xr, rows4, in, dr + j);
      }
      for (; j < rank; ++j) {
        const float* row = ar + j * in;
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
          const float* bs = bp + slot[first] * rank * width + c0;
          for (int64_t r = first; r < end; ++r) axpys(op + r * out_stride + c0, down + r * rank, bs, rank, width, n);
        }
        first = end;
      }
    }
  });
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
      TORCH_CHECK(a[which].is_contiguous() && b[which].is_contiguous() && a[which].scalar_type() == at::kFloat &&
                      b[which].scalar_type() == at::kFloat, "LoraStacks: contiguous float32 stacks");
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
