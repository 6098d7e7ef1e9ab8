// Internal to the kernel core: the packed-weight kernel that linear() calls
// (linear_packed.cpp), and the row-major one it falls back to.
#pragma once
#include <cstdint>

#include "dtype.h"

namespace cpuinfer {

// out[m, n] for n < panels * linear_pack_cols(), from the packed panels of weight.
void linear_panels(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
                   const void *bias, int64_t M, int64_t panels, int64_t K);

// The same for a row-major weight [N, K] (linear.cpp).
void linear_row_major(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
                      const void *bias, int64_t M, int64_t N, int64_t K);

}  // namespace cpuinfer
