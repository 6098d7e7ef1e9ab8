// The kernel core: plain C++ entry points on raw pointers, with no Python.
// The binding layer (csrc/bindings/) validates shapes, dtypes and strides and
// then calls these; the C++ test program (tests/cpp/) calls them directly.
// Strides are in elements; the innermost dimension is always contiguous.
#pragma once
#include <cstdint>
#include "dtype.h"

namespace cpuinfer {

// out[r] = in[r] / sqrt(mean(in[r]^2) + eps) * weight, computed in f32.
void rms_norm(DType dt, void *out, int64_t out_stride, const void *in, int64_t in_stride, const void *weight,
              int64_t rows, int64_t hidden, float eps);

// residual[r] += x[r] (rounded to dt); x[r] = rms_norm(residual[r]). In place.
void fused_add_rms_norm(DType dt, void *x, int64_t x_stride, void *residual, int64_t res_stride,
                        const void *weight, int64_t rows, int64_t hidden, float eps);

// Rotates the first rot_dim features of every head of q and k (k may be null)
// in place. cos_sin has rows [cos(rot_dim/2) | sin(rot_dim/2)] per position, of
// type cache_dt (f32 or dt). neox: pairs (i, i + rot_dim/2); else (2i, 2i+1).
void rotary_embedding(DType dt, const int64_t *positions, int64_t tokens, void *q, int64_t q_stride,
                      int64_t q_heads, void *k, int64_t k_stride, int64_t k_heads, int64_t head_size,
                      const void *cos_sin, DType cache_dt, int64_t rot_dim, bool neox);

enum class Activation : int { silu = 0, gelu = 1, gelu_tanh = 2 };

// out[r, i] = act(in[r, i]) * in[r, d + i] for i < d.
void act_and_mul(DType dt, Activation act, void *out, int64_t out_stride, const void *in, int64_t in_stride,
                 int64_t rows, int64_t d);

// Name of the vector layer compiled in (e.g. "avx2"), and its f32 lanes.
const char *vector_layer();
int vector_width();

}  // namespace cpuinfer
