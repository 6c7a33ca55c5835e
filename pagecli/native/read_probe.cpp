// A plain read of a buffer on every thread: the memory's read bandwidth, the ceiling that decode's
// products (which stream each weight once) are measured against (issue 24).
//
// torch's sum of a bf16 tensor widens and adds every value, and on Zen 4 reads at about two thirds of
// what this loop reads (31 against 45-50 GB/s on 2 cores), below the packed product on a large matrix:
// a fraction of it overstated the kernels. Here each thread XORs 64-byte lines into four independent
// accumulators (one vector instruction a load, no dependency chain to wait on), its units 256 KB of
// consecutive lines, handed out as every product kernel's are (work_share.h), with a prefetch into L2
// 4 KB ahead of the loads: on the slower Zen 4 instance (2 threads, 512 MiB, alternating runs) that
// read at 28-30 GB/s against 24.5-28 without it, where 2 or 8 KB ahead did as well and prefetching into
// L1 (1 or 4 KB ahead) no better than none. XOR does not depend on the order, so the result, returned
// so that the reads cannot be left out, is the buffer's XOR of its 64-bit words whichever thread read
// which unit (the tests check it against torch).

#include "read_probe.h"

#include "work_share.h"

#include <atomic>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagecli {
namespace {

constexpr int64_t kLineBytes = 64;
constexpr int64_t kUnitLines = 4096;  // 256 KB a unit
constexpr int64_t kAheadBytes = 4096;  // the prefetch's distance past the loads

// XOR of the 64-bit words of lines [begin, end) of p.
uint64_t xor_lines(const char* p, int64_t begin, int64_t end) {
  uint64_t out = 0;
#if defined(__AVX512F__)
  __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  int64_t i = begin;
  for (; i + 4 <= end; i += 4) {
    for (int j = 0; j < 4; ++j) {
      _mm_prefetch(p + (i + j) * kLineBytes + kAheadBytes, _MM_HINT_T1);  // past the buffer's end: a hint, never a fault
      a[j] = _mm512_xor_si512(a[j], _mm512_loadu_si512(p + (i + j) * kLineBytes));
    }
  }
  for (; i < end; ++i) a[0] = _mm512_xor_si512(a[0], _mm512_loadu_si512(p + i * kLineBytes));
  alignas(64) uint64_t words[8];
  _mm512_store_si512(reinterpret_cast<__m512i*>(words), _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]),
                                                                          _mm512_xor_si512(a[2], a[3])));
  for (uint64_t w : words) out ^= w;
#elif defined(__AVX2__)
  __m256i a[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t i = begin; i < end; ++i) {
    const char* line = p + i * kLineBytes;
    _mm_prefetch(line + kAheadBytes, _MM_HINT_T1);
    a[2 * (i & 1)] = _mm256_xor_si256(a[2 * (i & 1)], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
    a[2 * (i & 1) + 1] =
        _mm256_xor_si256(a[2 * (i & 1) + 1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32)));
  }
  alignas(32) uint64_t words[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(words),
                     _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3])));
  for (uint64_t w : words) out ^= w;
#else
  for (int64_t i = begin; i < end; ++i) {
    uint64_t words[kLineBytes / 8];
    std::memcpy(words, p + i * kLineBytes, kLineBytes);
    for (uint64_t w : words) out ^= w;
  }
#endif
  return out;
}

}  // namespace

int64_t read_probe(const torch::Tensor& buffer) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous(), "read_probe takes a contiguous CPU tensor");
  const int64_t bytes = buffer.numel() * buffer.element_size();
  TORCH_CHECK(bytes % kLineBytes == 0, "read_probe takes whole 64-byte lines (", bytes, " bytes)");
  const char* p = static_cast<const char*>(buffer.data_ptr());
  const int64_t lines = bytes / kLineBytes;
  std::atomic<uint64_t> result{0};
  parallel_shared((lines + kUnitLines - 1) / kUnitLines, [&](SharedWork::Cursor& cursor) {
    uint64_t mine = 0;
    for (int64_t u; (u = cursor.next()) >= 0;) {
      mine ^= xor_lines(p, u * kUnitLines, std::min(lines, (u + 1) * kUnitLines));
    }
    result.fetch_xor(mine, std::memory_order_relaxed);
  });
  return static_cast<int64_t>(result.load());
}

}  // namespace pagecli
