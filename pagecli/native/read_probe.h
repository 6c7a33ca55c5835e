// The memory's read bandwidth, measured by a plain read loop on every thread (read_probe.cpp).

#pragma once

#include <torch/types.h>

#include <cstdint>

namespace pagecli {

// Reads every byte of `buffer` (contiguous, a whole number of 64-byte lines) once, over the
// threads of a parallel region; returns the XOR of its 64-bit words.
int64_t read_probe(const torch::Tensor& buffer);

}  // namespace pagecli
