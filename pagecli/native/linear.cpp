// Linear products over row-layout bf16 weights: the few-row AVX512-BF16 kernel, AMX tiles, and
// native_linear, which picks one of them or at::linear by shape and CPU. (The packed GEMM is
// gemm_bf16.cpp.)

#include "cpu_ops.h"
#include "simd.h"
#include "work_share.h"

#include <algorithm>

namespace pagecli {

#if PAGECLI_HAVE_BF16_DOT
// Sum of x[k] * w[k] for bf16 rows of length dim, in fp32 (vdpbf16ps, 32 products per step).
inline __m512 bf16_dot_step(__m512 acc, const c10::BFloat16* x, const c10::BFloat16* w, __mmask32 mask) {
  const __m512i xv = _mm512_maskz_loadu_epi16(mask, x);
  const __m512i wv = _mm512_maskz_loadu_epi16(mask, w);
  return _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)wv);
}

// Software prefetch of a contiguous stream, a fixed distance ahead of where it is read: each
// advance() asks for the next 64-byte line, one per line consumed, so the distance holds. A thread
// of the rows kernel reads its weight rows as one contiguous run; the hardware prefetcher alone, or
// prefetching each row's line of the next 4-row tile (a few KB ahead, in four streams), left a
// Zen 4 core at about half its read bandwidth: SmolLM2's 269 MB in 12 ms (22 GB/s) against 6.2 ms
// for a plain read (43.6 GB/s, 2 threads); 16 KB ahead on the one stream: 7.0 ms (38.5 GB/s).
struct StreamPrefetch {
  static constexpr int64_t kAheadBytes = 16384;
  const char* next;
  const char* end;
  StreamPrefetch(const void* begin, const void* stop)
      : next(static_cast<const char*>(begin) + kAheadBytes), end(static_cast<const char*>(stop)) {}
  inline void advance() {
    if (next < end) {
      _mm_prefetch(next, _MM_HINT_T0);
      next += 64;
    }
  }
};
#endif

// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for a few rows M: each weight row is read once for all
// M rows, four weight rows at a time, with the rows split across threads.
torch::Tensor linear_bf16_rows(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#if PAGECLI_HAVE_BF16_DOT
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(torch::kBFloat16).contiguous();
    bp = b.data_ptr<c10::BFloat16>();
  }
  const int64_t full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - full)) - 1);
  constexpr int64_t R = 4;  // weight rows per inner step
  auto store = [&](int64_t m, int64_t n, float v) {
    if (bp) v += static_cast<float>(bp[n]);
    yp[m * N + n] = static_cast<c10::BFloat16>(v);
  };
  // More rows: blocks of 4 x rows against the tile's 4 weight rows, 16 accumulators summed by one
  // transpose-add tree. The tile stays in L1 across the row blocks, so the weights are still read
  // from memory once (oneDNN's bf16 matmul, which does not prefetch, takes about twice as long).
  constexpr int64_t MB = 4;
  auto rows_blocks = [&](int64_t n0, int64_t rows, StreamPrefetch& ahead) {
    const c10::BFloat16* wr[R];
    for (int64_t r = 0; r < R; ++r) wr[r] = wp + (n0 + std::min(r, rows - 1)) * K;  // spare lanes repeat a row
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t m_rows = std::min(MB, M - m0);
      const c10::BFloat16* xr[MB];
      for (int64_t i = 0; i < MB; ++i) xr[i] = xp + (m0 + std::min(i, m_rows - 1)) * K;
      __m512 acc[MB * R];
      for (auto& a : acc) a = _mm512_setzero_ps();
      auto step = [&](int64_t k, __mmask32 mask) {
        __m512i wv[R];
        for (int64_t r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi16(mask, wr[r] + k);
        for (int64_t i = 0; i < MB; ++i) {
          const __m512i xv = _mm512_maskz_loadu_epi16(mask, xr[i] + k);
          for (int64_t r = 0; r < R; ++r) acc[i * R + r] = _mm512_dpbf16_ps(acc[i * R + r], (__m512bh)xv, (__m512bh)wv[r]);
        }
      };
      for (int64_t k = 0; k < full; k += 32) {
        if (m0 == 0) {
          for (int64_t r = 0; r < R; ++r) ahead.advance();
        }
        step(k, 0xFFFFFFFFu);
      }
      if (tail) step(full, tail);
      alignas(64) float sums[MB * R];
      _mm512_store_ps(sums, sum_lanes_16(acc));
      for (int64_t i = 0; i < m_rows; ++i) {
        for (int64_t r = 0; r < rows; ++r) store(m0 + i, n0 + r, sums[i * R + r]);
      }
    }
  };
  parallel_shared((N + R - 1) / R, [&](SharedWork::Cursor& cursor) {
    // A thread's own weight rows lie in one contiguous run (work_share.h: a thread done early takes
    // tiles of another's run, and prefetches from there on).
    StreamPrefetch ahead(wp, wp);
    for (int64_t tile; (tile = cursor.next()) >= 0;) {
      if (cursor.entered_part()) {
        ahead = StreamPrefetch(wp + tile * R * K, wp + std::min(cursor.end_of_part() * R, N) * K);
      }
      const int64_t n0 = tile * R;
      const int64_t rows = std::min<int64_t>(R, N - n0);
      if (M > 2) {
        rows_blocks(n0, rows, ahead);
        continue;
      }
      for (int64_t m = 0; m < M; ++m) {
        const c10::BFloat16* xr = xp + m * K;
        __m512 acc[R] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t k = 0; k < full; k += 32) {
          for (int64_t r = 0; r < rows; ++r) {
            if (m == 0) ahead.advance();
            acc[r] = bf16_dot_step(acc[r], xr + k, wp + (n0 + r) * K + k, 0xFFFFFFFFu);
          }
        }
        if (tail) {
          for (int64_t r = 0; r < rows; ++r) acc[r] = bf16_dot_step(acc[r], xr + full, wp + (n0 + r) * K + full, tail);
        }
        for (int64_t r = 0; r < rows; ++r) store(m, n0 + r, _mm512_reduce_add_ps(acc[r]));
      }
    }
  }, 16);
  return y;
#else
  TORCH_CHECK(false, "linear_bf16_rows needs AVX512-BF16, which this build lacks");
#endif
}

#if PAGECLI_HAVE_AMX
// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) on AMX tiles; K a multiple of 32, N of 16.
// The weights are the A operand just as they lie in memory (a tile: 16 weight rows x 32 k), so
// they are streamed once and never repacked; x goes once per call into the B operand's
// pair-interleaved layout (16 k pairs x 16 rows x 2). A tile product then gives 16 outputs for
// 16 rows of x. oneDNN's bf16 matmul (also on AMX here) takes about twice as long for up to 32
// rows, which fits it reordering the weights into its own layout on every call; for these rows
// the results are bit-identical to it (both sum over k in the same order, in fp32).
// Tiles: 0-3 accumulate 4 blocks of 16 rows of x, 4 holds the weights, 5-6 x (alternating).
torch::Tensor linear_bf16_amx(torch::Tensor x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(amx_granted(), "the kernel did not grant this process AMX tiles");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(w.is_contiguous() && w.size(1) % 32 == 0 && w.size(0) % 16 == 0,
              "w must be contiguous, its rows a multiple of 32 long and their number a multiple of 16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t k_steps = K / 32, m_blocks = (M + 15) / 16;
  // x^T, pair-interleaved: [k_steps, m_blocks, 16 k pairs, 16 rows] of 32-bit (2 x bf16) cells,
  // rows past M zero.
  auto packed = torch::empty({k_steps, m_blocks, 16, 16}, x.options().dtype(torch::kInt32));
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  uint32_t* pk = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  for (int64_t ks = 0; ks < k_steps; ++ks) {
    for (int64_t mb = 0; mb < m_blocks; ++mb) {
      uint32_t* tile = pk + (ks * m_blocks + mb) * 256;
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t m = mb * 16 + c;
        for (int64_t kp = 0; kp < 16; ++kp) tile[kp * 16 + c] = m < M ? x_pairs[m * (K / 2) + ks * 16 + kp] : 0u;
      }
    }
  }
  auto y = torch::empty({M, N}, x.options());
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const char* w_end = reinterpret_cast<const char*>(wp + N * K);
  constexpr int64_t kAhead = 4;  // k steps between a weight line's prefetch and its tile load
  parallel_shared(N / 16, [&](SharedWork::Cursor& cursor) {
    load_tile_config();
    alignas(64) float out[16 * 16];  // [16 weight rows, 16 rows of x]
    for (int64_t block; (block = cursor.next()) >= 0;) {
      const int64_t n0 = block * 16;
      const c10::BFloat16* a = wp + n0 * K;
      for (int64_t mb0 = 0; mb0 < m_blocks; mb0 += 4) {
        const int64_t mbs = std::min<int64_t>(4, m_blocks - mb0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ks = 0; ks < k_steps; ++ks) {
          if (mb0 == 0) {
            // The hardware prefetcher alone leaves a core well short of its read bandwidth on
            // 16 strided rows; fetch each row's line kAhead steps on (the next block's near the end).
            for (int64_t r = 0; r < 16; ++r) {
              const int64_t ahead = ks + kAhead;
              const c10::BFloat16* line = ahead < k_steps ? a + r * K + ahead * 32 : a + (16 + r) * K + (ahead - k_steps) * 32;
              if (reinterpret_cast<const char*>(line) < w_end) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
            }
          }
          _tile_loadd(4, a + ks * 32, K * 2);
          const uint32_t* xt = pk + (ks * m_blocks + mb0) * 256;
          _tile_loadd(5, xt, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (mbs > 1) {
            _tile_loadd(6, xt + 256, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (mbs > 2) {
            _tile_loadd(5, xt + 512, 64);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (mbs > 3) {
            _tile_loadd(6, xt + 768, 64);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
        const __m512 bias16 = bp ? _mm512_loadu_ps(bp + n0) : _mm512_setzero_ps();
        for (int64_t j = 0; j < mbs; ++j) {
          switch (j) {  // tile numbers must be constants
            case 0: _tile_stored(0, out, 64); break;
            case 1: _tile_stored(1, out, 64); break;
            case 2: _tile_stored(2, out, 64); break;
            default: _tile_stored(3, out, 64); break;
          }
          const int64_t first = (mb0 + j) * 16, count = std::min<int64_t>(16, M - first);
          for (int64_t c = 0; c < count; ++c) {  // column c of out: row first + c of y
            store16(yp + (first + c) * N + n0, _mm512_add_ps(tile_column(out, c), bias16));
          }
        }
      }
    }
    _tile_release();
  });
  return y;
}
#endif

bool has_amx() {
#if PAGECLI_HAVE_AMX
  return amx_granted();
#else
  return false;
#endif
}

// Up to this many rows, the AVX512-BF16 rows kernel beats oneDNN's bf16 matmul, which costs about
// the same for 1 row as for 16 (docs/BENCHMARKS.md, "CPU kernels"): SmolLM2's weights for 1-4 rows
// take 11-14 ms with the kernel, 21-24 ms with oneDNN; at 8 rows they tie.
constexpr int64_t kRowsKernelMaxRows = 4;
// Up to this many rows, AMX tiles over the weights as they lie beat oneDNN (docs/BENCHMARKS.md).
constexpr int64_t kAmxMaxRows = 128;

// The bf16 product x [M, K] @ w[N, K]^T (+ bias) the engine uses, by shape and CPU: AMX tiles,
// else the rows kernel for a few rows, else at::linear (oneDNN; also every other dtype).
torch::Tensor native_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  const bool bf16 = x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 &&
                    w.is_contiguous();
#if PAGECLI_HAVE_AMX
  if (bf16 && x.size(0) <= kAmxMaxRows && w.size(1) % 32 == 0 && w.size(0) % 16 == 0 && amx_granted()) {
    return linear_bf16_amx(x, w, bias);
  }
#endif
  if (PAGECLI_HAVE_BF16_DOT && bf16 && x.size(0) <= kRowsKernelMaxRows) return linear_bf16_rows(x, w, bias);
  return at::linear(x, w, bias);
}

bool has_bf16_linear() { return PAGECLI_HAVE_BF16_DOT; }

}  // namespace pagecli
