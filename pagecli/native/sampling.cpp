// One drawn token per row of logits, after temperature, top-k, top-p and min-p, without sorting the
// vocabulary (engine/sampler.py states the filters' order and what each keeps; this is its CPU kernel).
//
// Every filter keeps the tokens whose weight e = exp((logit - top) / temperature) is at least some
// threshold, so a row's kept set is {e >= tau}: min-p keeps e >= min_p (the top token's e is 1);
// top-k keeps e >= the k-th largest e; top-p keeps the tokens whose heavier tokens (e greater than
// theirs, among those top-k kept) hold less than top_p of the kept weight. Ties at a threshold are
// all kept. How each is found without a sort of the vocabulary:
// - top-p alone (the shipped default) by rejection against pivots: draw from the tokens at or above
//   the current pivot (at first min-p's threshold, or all); a drawn token that top-p keeps is the
//   answer; else no token at or below its weight is kept, so the pivot moves just above it and the
//   next draw comes from fewer tokens. Each draw lands in the kept set with probability at least
//   top_p of what remains, and conditioned on landing there it is distributed as the filtered
//   distribution, so the answer is drawn from it exactly. A round is two vectorized passes; after
//   kMaxRounds, what is left is sorted (partially: a weighted quickselect) to find the threshold.
// - top-k by one scan of the logits that keeps a buffer of those above a running k-th value
//   (re-selected with nth_element when the buffer doubles), then a second that collects the tokens at
//   or above the k-th logit in vocabulary order: only their weights are computed (no exponential over
//   the vocabulary), and top-p's threshold is selected among them. The k kept are those of the k
//   largest logits, all of those tied with the k-th kept.
// A draw is the inverse of the kept tokens' cumulative weight at u * (their total): the first token
// whose running sum passes it, found over sums of 64-token blocks and then within one block. A token
// of weight 0 is never drawn. A row's uniform numbers come from its own 64-bit random word, so a row
// draws the same token alone or in any batch, on any thread.

#include "cpu_ops.h"
#include "kv_quant.h"  // hsum8; every build level has AVX2 and FMA (kv_quant.h stops one without)
#include "row_max.h"
#include "simd.h"
#include "work_share.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

namespace pagecli {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// A weight is 2^t with t = (logit - top) * log2(e) / temperature <= 0; below 2^-125 (86.6 nats under
// the top) it is 0, as it nearly is in a float32 softmax (whose normal numbers end at 2^-126).
constexpr float kLowestLog2 = -125.0f;
constexpr float kLog2E = 1.44269504088896341f;
constexpr int64_t kBlock = 64;  // tokens per block of a draw's first search
constexpr int kMaxRounds = 4;   // rejection rounds before top-p's threshold is selected outright

struct RowFilters {
  float log2_scale;  // log2(e) / temperature: a weight is 2^((logit - top) * log2_scale)
  int64_t top_k;   // 0: off
  double top_p;    // 1: off
  float min_p;     // 0: off
  uint64_t random; // the row's random word: its uniform numbers
};

// A thread's buffers, reused row after row (a row of 49,152 tokens: 200 KB of weights).
struct Scratch {
  std::vector<float> x, e, picked, candidate_weight;
  std::vector<int64_t> candidate;
  std::vector<double> block_sum;
};

Scratch& scratch(int64_t vocab) {
  static thread_local Scratch s;
  if (static_cast<int64_t>(s.e.size()) < vocab) {
    s.x.resize(vocab);
    s.e.resize(vocab);
    s.block_sum.resize(vocab / kBlock + 1);
  }
  return s;
}

// Uniform number `round` of a row in [0, 1): splitmix64 of the row's word and the round.
double uniform(uint64_t random, int round) {
  uint64_t z = random + static_cast<uint64_t>(round) * 0x9e3779b97f4a7c15ull;
  if (round > 0) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
  }
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

// The row's logits as float32, NaN read as -inf, and their largest value. A float32 row without a
// NaN is read where it lies.
template <typename scalar_t>
const float* load_row(const scalar_t* row, int64_t vocab, Scratch& s, float& top) {
  bool nan = false;
  top = max_of_row(row, vocab, nan);  // the largest non-NaN value: the same once NaNs read as -inf
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (!nan) return row;
  }
  float* x = s.x.data();
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = to_float(row[i]);
    x[i] = std::isnan(v) ? -kInf : v;
  }
  return x;
}

// 2^t for kLowestLog2 <= t <= 0 (lanes below it are zeroed by the caller): 2^round(t) times a degree-6
// polynomial in the rest (|f| <= 1/2, relative error about 1e-7), the power of two added to the
// exponent bits. Half the instructions of exp8 on these arguments (measured 1.6x faster a row).
inline __m256 exp2_nonpositive(__m256 t) {
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5403530393381608e-4f);  // ln(2)^k / k!, k = 6 .. 0
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}

// One lane of exp2_nonpositive, bit for bit (the same operations, rounded the same way).
inline float exp2_nonpositive(float t) {
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5403530393381608e-4f;
  for (float c : {1.3333558146428443e-3f, 9.6181291076284772e-3f, 5.5504108664821580e-2f, 2.4022650695910071e-1f,
                  6.9314718055994531e-1f, 1.0f}) {
    p = std::fma(p, f, c);
  }
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) * (1 << 23);
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

// The weight of logit x: 2^((x - top) * scale), scale = log2(e) / temperature; 0 below 2^kLowestLog2.
inline float weight_of(float x, float top, float scale) {
  const float t = (x - top) * scale;
  return t >= kLowestLog2 ? exp2_nonpositive(t) : 0.0f;
}

// out[i] = weight_of(x[i]) for i < n; returns their sum.
double weigh(const float* x, int64_t n, float top, float scale, float* out) {
  double total = 0.0;
  int64_t i = 0;
  const __m256 vtop = _mm256_set1_ps(top), vscale = _mm256_set1_ps(scale), lowest = _mm256_set1_ps(kLowestLog2);
  for (; i + kBlock <= n; i += kBlock) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = i; k < i + kBlock; k += 8) {
      const __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + k), vtop), vscale);
      // 0 below the lowest power (and where t is NaN: a -inf logit under a +inf-free top gives -inf).
      const __m256 w = _mm256_and_ps(_mm256_cmp_ps(t, lowest, _CMP_GE_OQ), exp2_nonpositive(t));
      _mm256_storeu_ps(out + k, w);
      acc = _mm256_add_ps(acc, w);
    }
    total += hsum8(acc);
  }
  for (; i < n; ++i) {
    out[i] = weight_of(x[i], top, scale);
    total += out[i];
  }
  return total;
}

// The weight of the tokens heavier than `weight` (e > weight).
double weight_above(const float* e, int64_t vocab, float weight) {
  double total = 0.0;
  int64_t i = 0;
  const __m256 v = _mm256_set1_ps(weight);
  for (; i + kBlock <= vocab; i += kBlock) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = i; k < i + kBlock; k += 8) {
      const __m256 w = _mm256_loadu_ps(e + k);
      acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_cmp_ps(w, v, _CMP_GT_OQ), w));
    }
    total += hsum8(acc);
  }
  for (; i < vocab; ++i) total += e[i] > weight ? e[i] : 0.0f;
  return total;
}

// The weights at or above `floor` (into s.picked).
std::vector<float>& weights_from(float floor, int64_t vocab, Scratch& s) {
  s.picked.clear();
  const float* e = s.e.data();
  int64_t i = 0;
  const __m256 v = _mm256_set1_ps(floor);
  for (; i + 8 <= vocab; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), v, _CMP_GE_OQ));
    for (; hit; hit &= hit - 1) s.picked.push_back(e[i + __builtin_ctz(hit)]);
  }
  for (; i < vocab; ++i) {
    if (e[i] >= floor) s.picked.push_back(e[i]);
  }
  return s.picked;
}

// The largest value v of `values` such that the values >= v add up to at least `need` (ties kept);
// `fallback` where rounding leaves their whole sum just short of it. A quickselect by weight: each
// round splits the values around a pivot and goes on in the part the threshold lies in.
float weighted_select(std::vector<float>& values, double need, float fallback) {
  auto begin = values.begin();
  size_t lo = 0, hi = values.size();
  double above = 0.0;
  while (hi - lo > 32) {
    const float a = values[lo], b = values[lo + (hi - lo) / 2], c = values[hi - 1];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // the median of three
    const auto heavier = std::partition(begin + lo, begin + hi, [pivot](float w) { return w > pivot; });
    const auto equal = std::partition(heavier, begin + hi, [pivot](float w) { return w == pivot; });
    double heavier_sum = 0.0, equal_sum = 0.0;
    for (auto it = begin + lo; it != heavier; ++it) heavier_sum += *it;
    for (auto it = heavier; it != equal; ++it) equal_sum += *it;
    if (above + heavier_sum >= need) {
      hi = heavier - begin;
    } else if (above + heavier_sum + equal_sum >= need) {
      return pivot;
    } else {
      above += heavier_sum + equal_sum;
      lo = equal - begin;
    }
  }
  std::sort(begin + lo, begin + hi, std::greater<float>());
  for (size_t i = lo; i < hi; ++i) {
    above += values[i];
    if (above >= need) return values[i];
  }
  return fallback;
}

// The k-th largest of values[0, n) (0 < k < n), using buffer.
float kth_largest(const float* values, int64_t k, int64_t n, std::vector<float>& buffer) {
  const float* e = values;
  const int64_t vocab = n;
  buffer.assign(e, e + k);
  std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<float>());
  float kth = buffer[k - 1];
  const size_t limit = static_cast<size_t>(std::max<int64_t>(2 * k, 256));
  int64_t i = k;
  for (; i + 8 <= vocab; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + i), _mm256_set1_ps(kth), _CMP_GT_OQ));
    if (hit == 0) continue;
    for (; hit; hit &= hit - 1) buffer.push_back(e[i + __builtin_ctz(hit)]);
    if (buffer.size() >= limit) {
      std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<float>());
      buffer.resize(k);
      kth = buffer[k - 1];
    }
  }
  for (; i < vocab; ++i) {
    if (e[i] > kth) buffer.push_back(e[i]);
  }
  std::nth_element(buffer.begin(), buffer.begin() + (k - 1), buffer.end(), std::greater<float>());
  return buffer[k - 1];
}

// The token whose running weight (over e >= tau, in vocabulary order) first passes u * their total;
// -1 where they weigh nothing.
int64_t draw_from(int64_t vocab, float tau, double u, Scratch& s) {
  const float* e = s.e.data();
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t end = std::min(vocab, (blk + 1) * kBlock);
    int64_t i = blk * kBlock;
    float sum = 0.0f;
    const __m256 vtau = _mm256_set1_ps(tau);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= end; i += 8) {
      const __m256 w = _mm256_loadu_ps(e + i);
      acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_cmp_ps(w, vtau, _CMP_GE_OQ), w));
    }
    sum = hsum8(acc);
    for (; i < end; ++i) sum += e[i] >= tau ? e[i] : 0.0f;
    s.block_sum[blk] = sum;
    total += sum;
  }
  if (!(total > 0.0)) return -1;
  const double target = u * total;
  double running = 0.0;
  int64_t blk = 0;
  while (blk + 1 < blocks && running + s.block_sum[blk] <= target) running += s.block_sum[blk++];
  int64_t last_kept = -1;
  for (int64_t i = blk * kBlock; i < std::min(vocab, (blk + 1) * kBlock); ++i) {
    if (e[i] < tau || e[i] == 0.0f) continue;
    running += e[i];
    last_kept = i;
    if (running > target) return i;
  }
  if (last_kept >= 0) return last_kept;  // the block's float sum rounded above its tokens' own
  for (int64_t i = vocab - 1; i >= 0; --i) {
    if (e[i] >= tau && e[i] > 0.0f) return i;
  }
  return -1;
}

// Top-k, with top-p and min-p among the k: the tokens at or above the k-th largest logit are collected in
// vocabulary order and only their weights computed; the rest weigh nothing after top-k.
int64_t draw_top_k(const float* x, int64_t vocab, float top, const RowFilters& f, Scratch& s) {
  const float kth_logit = kth_largest(x, f.top_k, vocab, s.picked);
  s.candidate.clear();
  s.picked.clear();  // the candidates' logits, then their weights (in place)
  const __m256 v = _mm256_set1_ps(kth_logit);
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), v, _CMP_GE_OQ));
    for (; hit; hit &= hit - 1) s.candidate.push_back(i + __builtin_ctz(hit));
  }
  for (; i < vocab; ++i) {
    if (x[i] >= kth_logit) s.candidate.push_back(i);
  }
  const int64_t n = static_cast<int64_t>(s.candidate.size());
  for (int64_t c : s.candidate) s.picked.push_back(x[c]);
  std::vector<float>& w = s.candidate_weight;
  w.resize(n);
  weigh(s.picked.data(), n, top, f.log2_scale, w.data());
  // The k-th largest of the candidates' weights: top-k keeps the candidates at or above it.
  s.picked.assign(w.begin(), w.end());
  std::nth_element(s.picked.begin(), s.picked.begin() + (f.top_k - 1), s.picked.end(), std::greater<float>());
  const float kth = s.picked[f.top_k - 1];
  float tau = std::max(f.min_p, kth);
  if (f.top_p < 1.0) {
    s.picked.clear();
    double held = 0.0;
    for (float weight : w) {
      if (weight >= kth) {
        s.picked.push_back(weight);
        held += weight;
      }
    }
    tau = std::max(tau, weighted_select(s.picked, f.top_p * held, kth));
  }
  double total = 0.0;
  for (float weight : w) total += weight >= tau ? weight : 0.0f;
  if (!(total > 0.0)) return -1;
  const double target = uniform(f.random, 0) * total;
  double running = 0.0;
  int64_t last_kept = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (w[j] < tau || w[j] == 0.0f) continue;
    running += w[j];
    last_kept = s.candidate[j];
    if (running > target) return last_kept;
  }
  return last_kept;  // the sum rounded just short of the target: the last kept token
}

// Top-p alone (with min-p's floor): rejection against pivots, then a selection if it takes long.
int64_t draw_top_p(int64_t vocab, double top_p, float floor, double total, uint64_t random, Scratch& s) {
  const double need = top_p * total;
  float tau = floor;
  for (int round = 0; round < kMaxRounds; ++round) {
    const int64_t token = draw_from(vocab, tau, uniform(random, round), s);
    if (token < 0) return token;
    const float weight = s.e[token];
    if (weight_above(s.e.data(), vocab, weight) < need) return token;
    tau = std::nextafter(weight, kInf);  // nothing at or below this weight is kept
  }
  // Every token top-p keeps is at or above tau; so is every token heavier than any of them.
  std::vector<float>& left = weights_from(tau, vocab, s);
  tau = std::max(tau, weighted_select(left, need, tau));
  return draw_from(vocab, tau, uniform(random, kMaxRounds), s);
}

template <typename scalar_t>
int64_t sample_row(const scalar_t* row, int64_t vocab, const RowFilters& f) {
  Scratch& s = scratch(vocab);
  float top = 0.0f;
  const float* x = load_row(row, vocab, s, top);
  if (top == -kInf) return -1;  // every token masked (or NaN): nothing can be drawn
  if (top == kInf) {
    // Tokens at +inf share all the probability (the limit of their softmax); the rest get none.
    for (int64_t i = 0; i < vocab; ++i) s.e[i] = x[i] == kInf ? 1.0f : 0.0f;
    return draw_from(vocab, 1.0f, uniform(f.random, 0), s);
  }
  if (f.top_k > 0 && f.top_k < vocab) return draw_top_k(x, vocab, top, f, s);
  const double total = weigh(x, vocab, top, f.log2_scale, s.e.data());
  const float tau = f.min_p;
  if (f.top_p < 1.0) {
    return draw_top_p(vocab, f.top_p, tau, total, f.random, s);
  }
  return draw_from(vocab, tau, uniform(f.random, 0), s);
}

}  // namespace

std::vector<int64_t> sample_rows(const torch::Tensor& logits, const std::vector<double>& temperature,
                                 const std::vector<int64_t>& top_k, const std::vector<double>& top_p,
                                 const std::vector<double>& min_p, const std::vector<uint64_t>& random) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.size(1) > 0,
              "logits must be a CPU [rows, vocab] tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const auto* v : {&temperature, &top_p, &min_p}) {
    TORCH_CHECK(static_cast<int64_t>(v->size()) == rows, "sample_rows takes one value per row");
  }
  TORCH_CHECK(static_cast<int64_t>(top_k.size()) == rows && static_cast<int64_t>(random.size()) == rows,
              "sample_rows takes one top_k and one random word per row");
  const torch::Tensor contiguous = logits.contiguous();
  std::vector<int64_t> tokens(rows);
  PAGECLI_DISPATCH(contiguous.scalar_type(), "sample_rows", [&] {
    const scalar_t* base = contiguous.data_ptr<scalar_t>();
    parallel_shared_items(rows, 1, [&](int64_t r) {
      const RowFilters f{static_cast<float>(kLog2E / temperature[r]), top_k[r], top_p[r], static_cast<float>(min_p[r]),
                         random[r]};
      tokens[r] = sample_row(base + r * vocab, vocab, f);
    });
  });
  return tokens;
}

}  // namespace pagecli
