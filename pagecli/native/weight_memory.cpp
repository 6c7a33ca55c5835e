// weight_memory.h: regions of anonymous memory advised for 2 MB pages, handed out to packed weights.

#include "weight_memory.h"

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

namespace pagecli {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kRegionBytes = size_t{64} << 20;    // what small tensors share
constexpr size_t kOwnRegionBytes = size_t{16} << 20;  // from this size, a tensor gets its own region
constexpr size_t kAlign = 64;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// One mapping, 2 MB aligned, unmapped with the last tensor that lies in it.
struct Region {
  char* base = nullptr;
  size_t bytes = 0;
  ~Region() {
    if (base) munmap(base, bytes);
  }
};

// A mapping of `bytes` (a multiple of 2 MB) starting on a 2 MB boundary, advised; null if mmap fails.
std::shared_ptr<Region> map_region(size_t bytes) {
  const size_t padded = bytes + kHugePage;
  void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  char* start = static_cast<char*>(raw);
  char* aligned = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(start), kHugePage));
  if (aligned > start) munmap(start, aligned - start);
  char* end = aligned + bytes;
  if (start + padded > end) munmap(end, start + padded - end);
#ifdef MADV_HUGEPAGE
  madvise(aligned, bytes, MADV_HUGEPAGE);  // refused (no THP in this kernel): 4 KB pages, all else the same
#endif
  auto region = std::make_shared<Region>();
  region->base = aligned;
  region->bytes = bytes;
  return region;
}

// The region small tensors are being placed in, and how far it is used (fresh mappings read as zero,
// and nothing is placed twice, so every handed-out range is still zero).
struct SharedRegion {
  std::mutex lock;
  std::weak_ptr<Region> region;
  size_t used = 0;
};

SharedRegion& shared_region() {
  static SharedRegion shared;
  return shared;
}

}  // namespace

bool huge_pages_wanted() {
  const char* value = std::getenv("PAGECLI_HUGE_PAGES");
  if (!value) return true;
  std::string v(value);
  for (auto& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return !(v == "0" || v == "false" || v == "no" || v == "off");
}

at::Tensor weight_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (bytes == 0 || !huge_pages_wanted()) return at::zeros(sizes, options);
  std::shared_ptr<Region> region;
  size_t offset = 0;
  if (bytes >= kOwnRegionBytes) {
    region = map_region(round_up(bytes, kHugePage));
  } else {
    SharedRegion& shared = shared_region();
    std::lock_guard<std::mutex> guard(shared.lock);
    region = shared.region.lock();
    if (!region || shared.used + bytes > region->bytes) {
      region = map_region(kRegionBytes);
      shared.region = region;
      shared.used = 0;
    }
    offset = shared.used;
    if (region) shared.used = round_up(shared.used + bytes, kAlign);
  }
  if (!region) return at::zeros(sizes, options);
  return at::from_blob(region->base + offset, sizes, [region](void*) mutable { region.reset(); }, options);
}

at::Tensor weight_copy(const at::Tensor& src) {
  auto dst = weight_zeros(src.sizes(), src.scalar_type());
  dst.copy_(src);
  return dst;
}

}  // namespace pagecli
