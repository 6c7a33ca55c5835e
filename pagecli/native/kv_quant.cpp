// Writing K/V rows into a quantized cache (int8 or fp8 with a scale per row, kv_format.py): the
// bytes kv_format.quantize_rows gives, straight into the slots of the paged cache.

#include "kv_quant.h"

namespace pagecli {
namespace {

template <KvQuant F, typename scalar_t>
void store_rows(const torch::Tensor& rows, torch::Tensor& cache, const int64_t* slots) {
  const int64_t num_tokens = rows.size(0), kv_heads = rows.size(1), dim = rows.size(2);
  const int64_t row_bytes = dim + kKvScaleBytes, slot_bytes = kv_heads * row_bytes;
  const int64_t r_s0 = rows.stride(0), r_s1 = rows.stride(1);
  const scalar_t* src = rows.data_ptr<scalar_t>();
  uint8_t* base = static_cast<uint8_t*>(cache.data_ptr());
  // A decode step stores a row per sequence; a prefill, thousands: threads only for the latter.
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < kv_heads; ++h) {
        quantize_row<F>(src + t * r_s0 + h * r_s1, dim, base + slots[t] * slot_bytes + h * row_bytes);
      }
    }
  });
}

}  // namespace

void store_kv_quantized(torch::Tensor rows, torch::Tensor cache, torch::Tensor slots) {
  TORCH_CHECK(is_quantized_kv(cache.scalar_type()), "store_kv_quantized needs an int8 or uint8 (fp8) cache");
  TORCH_CHECK(rows.dim() == 3 && rows.stride(2) == 1, "rows must be [num_tokens, kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(2) == rows.size(1) &&
                  cache.size(3) == rows.size(2) + kKvScaleBytes,
              "cache must be contiguous [num_blocks, block_size, kv_heads, head_dim + 2] for these rows");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == rows.size(0),
              "slots must be contiguous int64, one per row");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < slots.size(0); ++t) TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " out of range");
  const bool int8 = kv_quant_of(cache.scalar_type()) == KvQuant::kInt8;
  PAGECLI_DISPATCH(rows.scalar_type(), "store_kv_quantized", [&] {
    if (int8) {
      store_rows<KvQuant::kInt8, scalar_t>(rows, cache, sp);
    } else {
      store_rows<KvQuant::kFp8, scalar_t>(rows, cache, sp);
    }
  });
}

}  // namespace pagecli
