// The quantized linear layer's tile for weight-only formats (QuantMatrix::act16:
// GPTQ, AWQ, compressed-tensors W4A16 / W8A16): x stays in the run's 16-bit type
// (or f32), and each block of the packed weight is widened in registers, or a
// 2 KB scratch per call, where the rows use it. Nothing is dequantized in
// memory: the weight is read at its own width, as the integer tiles read it.
//
// x (WideRows): the rows as the tile reads them (X: f32 for the portable tile,
// bf16 for a bf16 dot-product tile), and per row and group of the weight the
// f32 sum of the row's x over the group (tiles that keep the zero point or
// minimum out of the products need it; kSums says whether the driver makes it).
//
// Numerics. Every tile here is one function of the row and the weight: the
// same steps in the same order whatever the row count, so a row's result does
// not depend on its batch (unlike the int8 tiles, two variants may differ in
// the last bits, as the bf16 GEMM's do).
// - WideTile (portable, and the tile for f16 / f32 runs everywhere): the
//   weight's value w = d * (u - z), or d * u + m, exact in f32 (an f16 scale
//   times an integer below 2^8), and out = the f32 multiply-add chain of x * w
//   in the packed k order: what torch's float32 product on the dequantized
//   weight computes, up to its summation order.
// - x86's bf16 tile (csrc/x86/quant_wide_x86.h): the integer values as exact
//   bf16 operands of VDPBF16PS, the group's scale and zero point applied once
//   per group.
// The x86 hook specialises WideSelect<void> (the same pattern as TileSelect).
#pragma once
#include <cmath>
#include <cstdint>

#include "dtype.h"

namespace cpuinfer::quant {

template <typename X>
struct WideRows {
    const X *x;           // [rows][x_stride], in the weight's k order
    const float *gsum;    // [rows][g_stride]: per group, the f32 sum of the row's x (null unless the tile has kSums)
    int64_t x_stride, g_stride;
    static constexpr int64_t kElemBytes = int64_t(sizeof(X));
    WideRows from(int64_t m) const { return {x + m * x_stride, gsum ? gsum + m * g_stride : nullptr, x_stride, g_stride}; }
};

// a * b + c, fused where the target has a hardware FMA (a libm call otherwise, as vec_scalar.h says).
inline float madd(float a, float b, float c) {
#if defined(FP_FAST_FMAF)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

template <int Bits, bool Min>
struct WideTile : TileDefaults {
    using X = float;
    static constexpr bool kSums = false;
    static constexpr int kMaxRows = 4;
    static constexpr const char *kName = "portable-f32";

    // acc[r * 16 + f] = sum over k of x[r][k] * w[f][k], r < mr.
    static void run(int mr, const WideRows<float> &x, const QuantPanel &w, float *acc) {
        float a[kMaxRows][kLanes] = {};
        alignas(64) uint8_t u[kLanes][kBlock];
        alignas(64) float wk[kBlock][kLanes];  // the block's values, k-major: a row's step is 16 lanes
        for (int64_t b = 0; b < w.blocks; ++b) {
            unpack_block<Bits>(w.qs + b * block_bytes(Bits), u);
            const int64_t g = b / w.bpg;
            for (int f = 0; f < kLanes; ++f) {
                const float d = to_f32(w.d[g * kLanes + f]);
                if constexpr (Min) {
                    const float m = to_f32(w.m[g * kLanes + f]);
                    for (int k = 0; k < kBlock; ++k) wk[k][f] = madd(d, float(u[f][k]), m);
                } else {
                    const int32_t z = w.z[g * kLanes + f];
                    for (int k = 0; k < kBlock; ++k) wk[k][f] = d * float(int32_t(u[f][k]) - z);
                }
            }
            for (int r = 0; r < mr; ++r) {
                const float *xr = x.x + r * x.x_stride + b * kBlock;
                for (int k = 0; k < kBlock; ++k)
                    for (int f = 0; f < kLanes; ++f) a[r][f] = madd(xr[k], wk[k][f], a[r][f]);
            }
        }
        for (int r = 0; r < mr; ++r)
            for (int f = 0; f < kLanes; ++f) acc[r * kLanes + f] = a[r][f];
    }
};

// The tile a run of type T takes on this build: WideTile, unless the vector layer's hook specialises this.
template <typename = void>
struct WideSelect {
    template <typename T, int Bits, bool Min>
    using Tile = WideTile<Bits, Min>;
};

}  // namespace cpuinfer::quant
