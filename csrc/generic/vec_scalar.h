// Portable vector layer: plain C++ on 8-lane arrays. Runs on every CPU of
// every architecture; the compiler may vectorise it with the baseline ISA.
#pragma once
#include <cmath>
#include "../common/dtype.h"

namespace cpuinfer::vec {

// Register budget of the common tiles (portable): query rows per attention
// tile (attention_tile.h), x rows per linear panel tile (panel_kernel.h).
constexpr int kAttnRows = 8;
constexpr int kPanelRows = 6;

constexpr const char *kName = "scalar";
constexpr int kW = 8;
struct vf { float v[kW]; };

inline int width() { return kW; }
inline vf zero() { vf r; for (int i = 0; i < kW; ++i) r.v[i] = 0.f; return r; }
inline vf splat(float x) { vf r; for (int i = 0; i < kW; ++i) r.v[i] = x; return r; }
template <typename T> inline vf load(const T *p) {
    vf r; for (int i = 0; i < kW; ++i) r.v[i] = to_f32(p[i]); return r;
}
template <typename T> inline void store(T *p, vf a) {
    for (int i = 0; i < kW; ++i) p[i] = from_f32<T>(a.v[i]);
}

#define CPUINFER_SCALAR_BINOP(name, expr) \
    inline vf name(vf a, vf b) { vf r; for (int i = 0; i < kW; ++i) { float x = a.v[i], y = b.v[i]; r.v[i] = (expr); } return r; }
CPUINFER_SCALAR_BINOP(add, x + y)
CPUINFER_SCALAR_BINOP(sub, x - y)
CPUINFER_SCALAR_BINOP(mul, x * y)
CPUINFER_SCALAR_BINOP(div, x / y)
CPUINFER_SCALAR_BINOP(min, y < x ? y : x)
CPUINFER_SCALAR_BINOP(max, y > x ? y : x)
CPUINFER_SCALAR_BINOP(copysign, std::copysign(x, y))
#undef CPUINFER_SCALAR_BINOP

// std::fma is exact, which without a hardware FMA (baseline x86-64) means a
// slow libm call per element; the portable layer only needs a*b+c.
#if defined(FP_FAST_FMAF)
inline vf fma(vf a, vf b, vf c) { vf r; for (int i = 0; i < kW; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return r; }
#else
inline vf fma(vf a, vf b, vf c) { vf r; for (int i = 0; i < kW; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
#endif
inline vf abs(vf a) { vf r; for (int i = 0; i < kW; ++i) r.v[i] = std::fabs(a.v[i]); return r; }
// Ties to even via the 2^23 trick (exact in the default rounding mode): std::nearbyint
// is a libm call per element on baseline x86-64.
inline float round1(float x) {
    float a = std::fabs(x);
    if (a < 8388608.f) a = (a + 8388608.f) - 8388608.f;
    return std::copysign(a, x);
}
inline vf round(vf a) { vf r; for (int i = 0; i < kW; ++i) r.v[i] = round1(a.v[i]); return r; }
inline vf pow2i(vf n) {
    vf r; for (int i = 0; i < kW; ++i) r.v[i] = bits_f32(uint32_t(int32_t(n.v[i]) + 127) << 23); return r;
}
inline float reduce_add(vf a) { float s = 0.f; for (int i = 0; i < kW; ++i) s += a.v[i]; return s; }
inline float reduce_max(vf a) { float m = a.v[0]; for (int i = 1; i < kW; ++i) m = a.v[i] > m ? a.v[i] : m; return m; }

}  // namespace cpuinfer::vec
