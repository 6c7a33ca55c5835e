// lora_add_ (lora_add.h): a step's low-rank adds, the down products per row (four of an adapter's A rows
// against one read of x), then the up products by column tiles over runs of rows that share an adapter (each
// adapter's b tile read from memory once per run, each row's outputs held in registers over the rank).
// bf16 and fp16 rows and stacks are widened to float32 as they are read (the stacks stay in the model's dtype:
// half the bytes a step reads), every sum runs in float32, and each output is rounded once.

#include "lora_add.h"

#include "simd.h"
#include "work_share.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace pagecli {
namespace {

constexpr int64_t kTile = 64;  // output columns per unit of the up products

#if defined(__AVX2__) && defined(__FMA__)  // load8/store8: simd.h
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

// axpys for two rows of one adapter at once: each b vector read (and widened) once for both, eight independent
// sums in flight instead of four. Every output's operations are axpys's, in its order (the same bits).
template <typename T>
void axpys2(T* o0, T* o1, const float* d0, const float* d1, const T* b, int64_t rank, int64_t width, int64_t n) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    __m256 acc0[4], acc1[4];
    for (int i = 0; i < 4; ++i) {
      acc0[i] = load8(o0 + c + 8 * i);
      acc1[i] = load8(o1 + c + 8 * i);
    }
    for (int64_t j = 0; j < rank; ++j) {
      const __m256 e0 = _mm256_set1_ps(d0[j]), e1 = _mm256_set1_ps(d1[j]);
      const T* bj = b + j * width + c;
      for (int i = 0; i < 4; ++i) {
        const __m256 bv = load8(bj + 8 * i);
        acc0[i] = _mm256_fmadd_ps(e0, bv, acc0[i]);
        acc1[i] = _mm256_fmadd_ps(e1, bv, acc1[i]);
      }
    }
    for (int i = 0; i < 4; ++i) {
      store8(o0 + c + 8 * i, acc0[i]);
      store8(o1 + c + 8 * i, acc1[i]);
    }
  }
  if (c < n) {
    axpys(o0 + c, d0, b + c, rank, width, n - c);
    axpys(o1 + c, d1, b + c, rank, width, n - c);
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

template <typename T>
void axpys2(T* o0, T* o1, const float* d0, const float* d1, const T* b, int64_t rank, int64_t width, int64_t n) {
  axpys(o0, d0, b, rank, width, n);
  axpys(o1, d1, b, rank, width, n);
}
#endif

#if PAGECLI_HAVE_BF16_DOT
// dots for bf16 rows and stacks on AVX512-BF16: pairs of products summed in float32 by the dot instruction, 32
// per step, two sums per output (alternate blocks of 32), the last block masked with zeros past n, then the
// two sums' lanes in one fixed tree. One order per output whatever N is, as the float32 dots.
template <int N>
void dots(const c10::BFloat16* x, const c10::BFloat16* const* a, int64_t n, float* out) {
  __m512 acc[N][2];
  for (int j = 0; j < N; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= n; k += 64) {
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + k), x1 = (__m512bh)_mm512_loadu_si512(x + k + 32);
    for (int j = 0; j < N; ++j) {
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], x0, (__m512bh)_mm512_loadu_si512(a[j] + k));
      acc[j][1] = _mm512_dpbf16_ps(acc[j][1], x1, (__m512bh)_mm512_loadu_si512(a[j] + k + 32));
    }
  }
  for (int half = 0; k < n; k += 32, half ^= 1) {
    const __mmask32 live = n - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - k)) - 1;
    const __m512bh xk = (__m512bh)_mm512_maskz_loadu_epi16(live, x + k);
    for (int j = 0; j < N; ++j) {
      acc[j][half] = _mm512_dpbf16_ps(acc[j][half], xk, (__m512bh)_mm512_maskz_loadu_epi16(live, a[j] + k));
    }
  }
  for (int j = 0; j < N; ++j) out[j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]));
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
              const int64_t* slot, const float* scale, const int32_t* tile_rank) {
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
      const int64_t j0 = tile_rank ? tile_rank[2 * t] : 0, j1 = tile_rank ? tile_rank[2 * t + 1] : rank;
      if (j0 >= j1) continue;  // every slot's b is zero over this tile
      for (int64_t first = 0; first < rows;) {  // a run of rows of one slot: its b tile read once
        int64_t end = first + 1;
        while (end < rows && slot[end] == slot[first]) ++end;
        if (slot[first] >= 0) {
          const T* bs = bp + (slot[first] * rank + j0) * width + c0;  // rows j0.. of the slot's b, this tile
          int64_t r = first;
          for (; r + 2 <= end; r += 2) {
            axpys2(op + r * out_stride + c0, op + (r + 1) * out_stride + c0, down + r * rank + j0,
                   down + (r + 1) * rank + j0, bs, j1 - j0, width, n);
          }
          if (r < end) axpys(op + r * out_stride + c0, down + r * rank + j0, bs, j1 - j0, width, n);
        }
        first = end;
      }
    }
  });
}

bool lora_dtype(at::ScalarType type) { return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf; }

// Per 64-column tile of b [slots, rank, width], the [first, end) of its rank rows that hold a nonzero in that tile
// for some slot ({0, 0}: none). A fused product's stacks (qkv, gate_up) are zero off each part's block: q's rows
// over k's and v's columns, and so on, a third to a half of their up products.
std::vector<int32_t> tile_ranks(const torch::Tensor& b) {
  const int64_t rank = b.size(1), width = b.size(2), tiles = (width + kTile - 1) / kTile;
  auto used = torch::zeros({rank, tiles * kTile}, torch::kBool);  // [rank, tiles * kTile]
  used.narrow(1, 0, width).copy_(b.ne(0).any(0));
  const auto any = used.view({rank, tiles, kTile}).any(2).contiguous();  // [rank, tiles]
  const auto seen = any.accessor<bool, 2>();
  std::vector<int32_t> ranges(2 * tiles, 0);
  for (int64_t t = 0; t < tiles; ++t) {
    int32_t first = -1, end = 0;
    for (int64_t j = 0; j < rank; ++j) {
      if (!seen[j][t]) continue;
      if (first < 0) first = static_cast<int32_t>(j);
      end = static_cast<int32_t>(j + 1);
    }
    ranges[2 * t] = first < 0 ? 0 : first;
    ranges[2 * t + 1] = end;
  }
  return ranges;
}

}  // namespace

void lora_add_(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
               const torch::Tensor& row_slot, const torch::Tensor& row_scale, const int32_t* tile_rank) {
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
    case at::kBFloat16: add_rows<c10::BFloat16>(out, x, a, b, slot, scale, tile_rank); break;
    case at::kHalf: add_rows<c10::Half>(out, x, a, b, slot, scale, tile_rank); break;
    default: add_rows<float>(out, x, a, b, slot, scale, tile_rank);
  }
}

LoraStacks::LoraStacks(std::vector<std::vector<c10::optional<torch::Tensor>>> layers) {
  for (auto& layer : layers) {
    TORCH_CHECK(layer.size() == 8, "LoraStacks: each layer needs a and b of its 4 products");
    std::vector<torch::Tensor> a(4), b(4);
    std::vector<std::vector<int32_t>> ranks(4);
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
      // float32 adds every rank row (its bits as they always were: adding a zero product can turn a -0 into
      // +0); bf16/fp16 skip the rows that are zero over a tile.
      if (*dtype_ != at::kFloat) ranks[which] = tile_ranks(b[which]);
    }
    a_.push_back(std::move(a));
    b_.push_back(std::move(b));
    tile_rank_.push_back(std::move(ranks));
  }
}

void LoraStacks::add(int64_t layer, int64_t which, const torch::Tensor& x, torch::Tensor out,
                     const torch::Tensor& row_slot, const torch::Tensor& row_scale) const {
  TORCH_CHECK(layer >= 0 && layer < num_layers() && which >= 0 && which < 4, "LoraStacks.add: no such product");
  if (!a_[layer][which].defined()) return;
  const auto& ranges = tile_rank_[layer][which];
  lora_add_(out, x, a_[layer][which], b_[layer][which], row_slot, row_scale, ranges.empty() ? nullptr : ranges.data());
}

}  // namespace pagecli
