// Internal to the kernel core: the packed-weight kernel that linear() calls
// (linear_packed.cpp), and the row-major one it falls back to.
#pragma once
#include <cstdint>

#include "dtype.h"

namespace cpuinfer {

// out[m, n] for n < panels * linear_pack_cols(), from the packed panels of weight.
// out_f32, rounded: see linear() in kernels.h.
void linear_panels(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
                   const void *bias, int64_t M, int64_t panels, int64_t K, bool out_f32, bool rounded = false);

// Rows of x per task for the panel GEMMs (this file's and linear_quant.cpp's):
// chunks of at most budget_bytes of x (row_bytes each), of equal size, and a
// multiple of the thread count of them while that leaves chunks of at least 2
// tiles of tile_rows, so that every thread gets the same rows (parallel_for
// splits the tasks into equal contiguous runs). Measured on 2 cores: unequal
// chunks (156, 156, 156, 44 rows at M = 512) cost ~20%.
int64_t row_chunk(int64_t M, int64_t row_bytes, int64_t tile_rows, int64_t budget_bytes);

// The same for a row-major weight [N, K] (linear.cpp).
void linear_row_major(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
                      const void *bias, int64_t M, int64_t N, int64_t K, bool out_f32);

}  // namespace cpuinfer
