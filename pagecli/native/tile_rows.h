// A register tile's row count, known at run time, made a compile-time constant: each tile size is its own
// compiled kernel, its accumulators an array the compiler keeps in registers (panel_f32.h's and panel_i16.h's
// tiles).

#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>

namespace pagecli {

// f(std::integral_constant<int, R>()) for R = rows, 1 <= rows <= kMaxRows: kernels for 1 to kMaxRows rows
// are compiled, and no others.
template <int kMaxRows, int R = 1, typename F>
void with_rows_upto(int64_t rows, const F& f) {
  if constexpr (R <= kMaxRows) {
    if (rows == R) return f(std::integral_constant<int, R>());
    return with_rows_upto<kMaxRows, R + 1>(rows, f);
  } else {
    TORCH_CHECK(false, "panel product: no tile of ", rows, " rows (tiles of 1 to ", kMaxRows, ")");
  }
}

}  // namespace pagecli
