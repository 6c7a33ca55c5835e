// Memory for the weights the products stream: 2 MB pages where Linux gives them (weight_memory.cpp).
//
// Why: decode reads every weight once per token, at the memory's read bandwidth. In 4 KB pages a
// 270 MB model is 66,000 pages, each a TLB miss and a page walk, and the hardware prefetchers
// start afresh at every page; madvise(MADV_HUGEPAGE) lets the kernel back the same bytes with 2 MB
// pages (transparent huge pages, in Linux's default "madvise" mode). On the Zen 4 development
// machine a plain read loop read 12% faster from 2 MB pages than from 4 KB ones (512 MiB, passes
// alternating in one process). torch allocates weights in 4 KB pages unless THP_MEM_ALLOC_ENABLE is
// set before it starts, and then only blocks of 2 MB and more.
//
// The packers put their panels here, and pagecli.models.weight_forms moves the weights products read as
// they lie (AMX, float32 models, the avx2 level) here too: small tensors share 64 MB regions (each
// advised once), large ones get a region of their own; a region is unmapped when the last tensor in
// it is freed. The KV pool is left in 4 KB pages: one sequence touches every layer's K and V, and in
// 2 MB pages its first token would make 120 MB of the embedded model's pool resident.
// PAGECLI_HUGE_PAGES=0 allocates as torch does (for A/B runs); where madvise is refused, the pages
// stay 4 KB and nothing else changes.

#pragma once

#include <ATen/core/Tensor.h>

namespace pagecli {

// Whether weight_zeros uses advised regions (PAGECLI_HUGE_PAGES is not 0/false/no/off).
bool huge_pages_wanted();

// A zero-filled contiguous CPU tensor for packed weights, in huge-page-advised memory.
at::Tensor weight_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

// src copied into weight_zeros memory (contiguous, same shape and dtype).
at::Tensor weight_copy(const at::Tensor& src);

}  // namespace pagecli
