// A bf16 GEMM over weights packed once at load: y [M, N] = x [M, K] @ w [N, K]^T (+ bias) for any
// number of rows M, on AVX512-BF16 (vdpbf16ps: 16 fp32 lanes, each adding two bf16 products).
//
// Packed layout (pack_bf16_weights): bf16 [num_panels, k_pairs, 48, 2], num_panels = ceil(N / 48),
// k_pairs = ceil(K / 2), packed[p, j, c, h] = w[48 p + c, 2 j + h], zero past N or K. A panel is
// 48 output columns over the whole of K, one contiguous run of k_pairs * 192 bytes, and panels
// follow each other, so a thread that takes panels [a, b) reads one contiguous stream. A panel's
// k pair j is three zmm vectors (columns 0-15, 16-31, 32-47) whose lane c holds column c's two
// values at k = 2j, 2j + 1: vdpbf16ps's operand layout against x[m, 2j : 2j + 2] broadcast to
// every lane as one 32-bit value.
//
// Register tile: 8 rows of x by one panel, 24 fp32 accumulators held over the whole k loop, the 3
// weight vectors of the current pair and the broadcast pair: 28 of the 32 zmm registers. Each pair
// costs 3 vector loads and 8 broadcasts for 24 vdpbf16ps, so the core's one vdpbf16ps per cycle
// (Zen 4) is the limit, not its loads. Measured on one Zen 4 core (cache-resident [3072, 576]
// weights, 16-256 rows), 8x3, 6x4, 9x3 and 10x2 tiles all reach 81-95% of that peak, within 5% of
// each other (6x4 falls to 61% at 8 rows, which it splits 6 + 2); 48-column panels split the
// SmolLM2/Llama widths (576, 960, 3072, 49152 = 12, 20, 64, 1024 panels) evenly over 2 or 4
// threads, and 8 rows fit batches of 8 and 16 exactly. Splitting k into chunks that every row
// block takes in turn (partial sums kept in memory) measured 14-18% slower.
//
// Sum order: every output y[m, n] is one accumulator lane that starts at zero and takes k pairs
// 0, 1, ... in order (then + bias, then rounding to bf16), whatever M, the row's place in x, the
// tile height that served it or the thread count; so a row's result never depends on its batch.

#include "gemm_bf16.h"
#include "greedy_choices.h"
#include "weight_memory.h"
#include "work_share.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGECLI_HAVE_PACKED_GEMM 1
#include <immintrin.h>
#else
#define PAGECLI_HAVE_PACKED_GEMM 0
#endif

namespace pagecli {
namespace {

constexpr int64_t kLanes = 16;                             // fp32 lanes of a zmm: columns per weight vector
constexpr int64_t kPanelVectors = 3;                       // weight vectors per k pair of a panel
constexpr int64_t kPanelCols = kLanes * kPanelVectors;     // 48 output columns per panel
static_assert(kPanelCols == kPackedPanelCols, "the kernel's panel width is the packed layout's");
constexpr int64_t kTileRows = 8;                           // rows of x per register tile
constexpr int64_t kPairBytes = kPanelCols * 2 * 2;         // 192: one k pair of a panel, one line per vector
constexpr int64_t kAheadBytes = 16384;                     // software prefetch distance past the loads

#if PAGECLI_HAVE_PACKED_GEMM

// One register tile's operands: up to 8 rows of x against one panel.
struct Tile {
  const uint16_t* x;  // first row of x; rows x_stride elements apart
  int64_t x_stride;
  int64_t K;
  const char* panel;  // [k_pairs, 48, 2] bf16
  const float* bias;  // this panel's 48 fp32 biases (zero past N), or nullptr
  uint16_t* y;        // y[first row, first column of the panel]; rows y_stride elements apart
  int64_t y_stride;
  int64_t cols;       // columns of the panel inside N (48 but in the last panel)
};

// A thread's software prefetch over the weights it reads, one contiguous run (its panels, in
// order): a cursor that each tile moves on by up to kLines cache lines per k pair, but not past a
// limit that the tile sets from its progress. Which tiles prefetch, and how far ahead, is decided
// in linear_bf16_packed from measurements on Zen 4.
struct WeightStream {
  const char* next;  // the next line to prefetch
  const char* end;   // the end of the run
};

inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The tile product over the whole of K, then stored. At k pair j it prefetches up to kLines lines
// (prefetcht1, which measured faster than prefetcht0 here), none at or past
// limit_begin + j * limit_step.
template <int kRows, int kLines>
void tile_kernel(const Tile& t, WeightStream& stream, const char* limit_begin, int64_t limit_step) {
  __m512 acc[kRows][kPanelVectors];
  for (int i = 0; i < kRows; ++i) {
    for (int v = 0; v < kPanelVectors; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  const char* next = stream.next;
  auto step = [&](int64_t j, auto x_pair) {
    const char* pair = t.panel + j * kPairBytes;
    if constexpr (kLines > 0) {
      const char* limit = std::min(stream.end, limit_begin + j * limit_step);
      for (int l = 0; l < kLines; ++l) {
        if (next < limit) {
          _mm_prefetch(next, _MM_HINT_T1);
          next += 64;
        }
      }
    }
    __m512bh wv[kPanelVectors];
    for (int v = 0; v < kPanelVectors; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(pair + v * 64);
    for (int i = 0; i < kRows; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x_pair(i));
      for (int v = 0; v < kPanelVectors; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], wv[v], xb);
    }
  };
  const int64_t full_pairs = t.K / 2;
  int64_t j = 0;
  for (; j < full_pairs; ++j) {
    step(j, [&](int i) { return load_pair(t.x + i * t.x_stride + 2 * j); });
  }
  if (t.K % 2) {  // the last pair's second value is padding: zero in x as in the weights
    step(j, [&](int i) { return static_cast<int32_t>(t.x[i * t.x_stride + 2 * j]); });
  }
  stream.next = next;
  for (int i = 0; i < kRows; ++i) {
    uint16_t* row = t.y + i * t.y_stride;
    alignas(64) uint16_t out[kPanelCols];
    for (int v = 0; v < kPanelVectors; ++v) {
      const __m512 sum = t.bias ? _mm512_add_ps(acc[i][v], _mm512_loadu_ps(t.bias + v * kLanes)) : acc[i][v];
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + v * kLanes), (__m256i)_mm512_cvtneps_pbh(sum));
    }
    std::memcpy(row, out, t.cols * sizeof(uint16_t));
  }
}

template <int kLines>
void run_tile(int64_t rows, const Tile& t, WeightStream& stream, const char* limit_begin, int64_t limit_step) {
  switch (rows) {
    case 1: tile_kernel<1, kLines>(t, stream, limit_begin, limit_step); break;
    case 2: tile_kernel<2, kLines>(t, stream, limit_begin, limit_step); break;
    case 3: tile_kernel<3, kLines>(t, stream, limit_begin, limit_step); break;
    case 4: tile_kernel<4, kLines>(t, stream, limit_begin, limit_step); break;
    case 5: tile_kernel<5, kLines>(t, stream, limit_begin, limit_step); break;
    case 6: tile_kernel<6, kLines>(t, stream, limit_begin, limit_step); break;
    case 7: tile_kernel<7, kLines>(t, stream, limit_begin, limit_step); break;
    default: tile_kernel<8, kLines>(t, stream, limit_begin, limit_step); break;
  }
}
#endif

}  // namespace

at::Tensor pack_bf16_weights(const at::Tensor& w) {
#if PAGECLI_HAVE_PACKED_GEMM
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "pack_bf16_weights takes a contiguous bf16 [N, K] CPU weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N > 0 && K > 0, "pack_bf16_weights needs a non-empty weight");
  const int64_t num_panels = ceil_div(N, kPanelCols), k_pairs = ceil_div(K, 2);
  auto packed = weight_zeros({num_panels, k_pairs, kPanelCols, 2}, w.scalar_type());  // [num_panels, k_pairs, 48, 2]
  pack_into_panels(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                   reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>()), N, K);
  return packed;
#else
  TORCH_CHECK(false, "pack_bf16_weights needs AVX512-BF16, which this build lacks (has_packed_linear() is false)");
#endif
}

#if PAGECLI_HAVE_PACKED_GEMM
namespace {

// y [M, N] = xc [M, K] (contiguous) @ the packed weights (+ bias, fp32 padded to whole panels).
// y [M, N] (contiguous) = xc [M, K] @ w^T (+ bias); allocates nothing (a Team's members all run it).
// Each tile is folded into `choices` as it is stored, where given.
void packed_product_into(const at::Tensor& xc, const at::Tensor& packed, const float* bp, int64_t N, int64_t K,
                         at::Tensor& y, GreedyChoices* choices = nullptr) {
  const int64_t M = xc.size(0), num_panels = ceil_div(N, kPanelCols), k_pairs = ceil_div(K, 2);
  if (M == 0) return;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const char* wp = reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t panel_bytes = k_pairs * kPairBytes;
  const int64_t row_blocks = ceil_div(M, kTileRows);
  const RowGroups split = split_row_blocks(num_panels, row_blocks);
  const int64_t row_groups = split.count, blocks_per_group = split.blocks_per_group;
  // Work unit u: panel u / row_groups, row group u % row_groups; a thread's own units are
  // consecutive, so its panels are one run of the weights, read in order (work_share.h: a thread
  // done early takes units another has not begun, and starts a stream over that run).
  const int64_t units = num_panels * row_groups;
  parallel_shared(units, [&](SharedWork::Cursor& cursor) {
    WeightStream stream{nullptr, nullptr};
    for (int64_t u; (u = cursor.next()) >= 0;) {
      if (cursor.entered_part()) {
        const char* run_begin = wp + u / row_groups * panel_bytes;
        const char* run_end = wp + ((cursor.end_of_part() - 1) / row_groups + 1) * panel_bytes;
        stream = WeightStream{std::min(run_end, run_begin + kAheadBytes), run_end};
      }
      const int64_t panel = u / row_groups, group = u % row_groups;
      Tile t;
      t.x_stride = K;
      t.K = K;
      t.panel = wp + panel * panel_bytes;
      t.bias = bp ? bp + panel * kPanelCols : nullptr;
      t.y_stride = N;
      t.cols = std::min(kPanelCols, N - panel * kPanelCols);
      const int64_t first_block = group * blocks_per_group;
      const int64_t blocks = std::min(row_blocks, first_block + blocks_per_group) - first_block;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m0 = (first_block + b) * kTileRows, rows = std::min(kTileRows, M - m0);
        t.x = xp + m0 * K;
        t.y = yp + m0 * N + panel * kPanelCols;
        // Prefetch, as measured on Zen 4 (106 MB of [3072, 576] weights, one thread): up to 4 rows
        // read the panel faster than memory delivers it, and the hardware prefetcher alone keeps
        // up (4.1 ms, the plain-read time; a software prefetch made it 5.1). 5-8 rows compute
        // longer per line: a prefetch 16 KB ahead, one pair's 3 lines per pair, took 8 rows from
        // 5.1 to 4.7 ms. With several blocks the panel is computed from cache after the first
        // block, so the next panel is fetched meanwhile, evenly over all of this panel's blocks
        // (a panel + 16 KB ahead of the work done): 16-32 rows 10-20% faster than prefetching
        // only in the first block.
        if (blocks == 1 && rows <= 4) {
          run_tile<0>(rows, t, stream, nullptr, 0);
        } else if (blocks == 1) {
          run_tile<3>(rows, t, stream, t.panel + kAheadBytes, kPairBytes);
        } else {
          const char* limit_begin = t.panel + panel_bytes + kAheadBytes + b * panel_bytes / blocks;
          const int64_t limit_step = kPairBytes / blocks;  // the limit moves one panel per unit
          if (blocks <= 3) {  // 3 / blocks lines per pair, and a little more to catch up at the start
            run_tile<2>(rows, t, stream, limit_begin, limit_step);
          } else {
            run_tile<1>(rows, t, stream, limit_begin, limit_step);
          }
        }
        if (choices) choices->tile(reinterpret_cast<const c10::BFloat16*>(t.y), N, m0, rows, panel * kPanelCols, t.cols);
      }
    }
  });
}

at::Tensor packed_product(const at::Tensor& xc, const at::Tensor& packed, const float* bp, int64_t N, int64_t K) {
  auto y = at::empty({xc.size(0), N}, xc.options());  // [M, N]
  packed_product_into(xc, packed, bp, N, K, y);
  return y;
}

void check_packed(const at::Tensor& packed, int64_t N, int64_t K) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({ceil_div(N, kPanelCols), ceil_div(K, 2), kPanelCols, 2}),
              "packed must be pack_bf16_weights of a [", N, ", ", K, "] weight");
}

// bias [N] -> fp32 [ceil(N / 48) * 48], zero past N (undefined without bias).
at::Tensor padded_bias(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must have N = ", N, " values");
  auto padded = at::zeros({ceil_div(N, kPanelCols) * kPanelCols}, bias->options().dtype(at::kFloat));
  padded.narrow(0, 0, N).copy_(*bias);
  return padded;
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K,
              "linear_bf16_packed takes a bf16 CPU x [M, K] with K = ", K);
}

}  // namespace
#endif

at::Tensor linear_bf16_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t N, int64_t K) {
#if PAGECLI_HAVE_PACKED_GEMM
  check_x(x, K);
  check_packed(packed, N, K);
  const at::Tensor bias_padded = padded_bias(bias, N);
  return packed_product(x.contiguous(), packed, bias_padded.defined() ? bias_padded.data_ptr<float>() : nullptr, N, K);
#else
  TORCH_CHECK(false, "linear_bf16_packed needs AVX512-BF16, which this build lacks (has_packed_linear() is false)");
#endif
}

at::Tensor gather_packed_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t N, int64_t K) {
#if PAGECLI_HAVE_PACKED_GEMM
  check_packed(packed, N, K);
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "ids must be int64 or int32");
  const at::Tensor flat = ids.to(at::kLong).contiguous().view({-1});
  std::vector<int64_t> out_shape(ids.sizes().begin(), ids.sizes().end());
  out_shape.push_back(K);
  auto out = at::empty({flat.size(0), K}, packed.options());  // [tokens, K]
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < flat.size(0); ++t) {
    TORCH_CHECK_INDEX(idp[t] >= 0 && idp[t] < N, "index ", idp[t], " is out of range for ", N, " rows");
  }
  const int64_t k_pairs = ceil_div(K, 2), full_pairs = K / 2;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, flat.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = idp[t];
      // Row n is column n % 48 of panel n / 48: one k pair every 48 * 2 values.
      const uint16_t* col = src + (n / kPanelCols) * k_pairs * kPanelCols * 2 + (n % kPanelCols) * 2;
      uint16_t* row = dst + t * K;
      for (int64_t j = 0; j < full_pairs; ++j) std::memcpy(row + 2 * j, col + j * kPanelCols * 2, 2 * sizeof(uint16_t));
      if (K % 2) row[K - 1] = col[full_pairs * kPanelCols * 2];
    }
  });
  return out.view(out_shape);
#else
  TORCH_CHECK(false, "gather_packed_rows needs AVX512-BF16, which this build lacks (has_packed_linear() is false)");
#endif
}

PackedLinear::PackedLinear(const at::Tensor& w, const c10::optional<at::Tensor>& bias)
    : panels_(pack_bf16_weights(w)), N_(w.size(0)), K_(w.size(1)) {
#if PAGECLI_HAVE_PACKED_GEMM
  bias_ = padded_bias(bias, N_);
#endif
}

at::Tensor PackedLinear::forward(const at::Tensor& x) const {
#if PAGECLI_HAVE_PACKED_GEMM
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K_, "PackedLinear takes x [..., ", K_, "]");
  const at::Tensor x2 = x.reshape({-1, K_});  // [M, K]
  check_x(x2, K_);
  auto y = packed_product(x2.contiguous(), panels_, bias_.defined() ? bias_.data_ptr<float>() : nullptr, N_, K_);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N_;
  return y.view(shape);
#else
  TORCH_CHECK(false, "PackedLinear needs AVX512-BF16, which this build lacks (has_packed_linear() is false)");
#endif
}

void PackedProduct::forward_into(const at::Tensor&, at::Tensor&) const {
  TORCH_CHECK(false, "this product has no forward_into (runs_into() is false)");
}

std::tuple<at::Tensor, at::Tensor> PackedProduct::forward_choosing(const at::Tensor& x) const {
  return {forward(x), at::Tensor()};
}

at::Tensor PackedProduct::forward_via_into(const at::Tensor& x2) const {
  const at::Tensor xi = x2.to(into_dtype()).contiguous();
  at::Tensor y = at::empty({xi.size(0), out_features()}, xi.options());
  forward_into(xi, y);
  return y.to(x2.scalar_type());
}

bool PackedLinear::runs_into() const { return PAGECLI_HAVE_PACKED_GEMM; }

void PackedLinear::forward_into(const at::Tensor& x, at::Tensor& y) const {
#if PAGECLI_HAVE_PACKED_GEMM
  packed_product_into(x, panels_, bias_.defined() ? bias_.data_ptr<float>() : nullptr, N_, K_, y);
#else
  PackedProduct::forward_into(x, y);
#endif
}

std::tuple<at::Tensor, at::Tensor> PackedLinear::forward_choosing(const at::Tensor& x) const {
#if PAGECLI_HAVE_PACKED_GEMM
  if (x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.size(1) == K_) {
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({xc.size(0), N_}, xc.options());  // [M, N]
    GreedyChoices choices(xc.size(0));
    packed_product_into(xc, panels_, bias_.defined() ? bias_.data_ptr<float>() : nullptr, N_, K_, y, &choices);
    return {y, choices.finish(y)};
  }
#endif
  return PackedProduct::forward_choosing(x);
}

at::Tensor PackedLinear::rows(const at::Tensor& ids) const { return gather_packed_rows(panels_, ids, N_, K_); }

bool has_packed_linear() { return PAGECLI_HAVE_PACKED_GEMM; }

}  // namespace pagecli
