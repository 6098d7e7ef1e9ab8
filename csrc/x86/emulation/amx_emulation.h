// Test-only software model of the AMX instructions our kernels use (tile
// config, load, store, zero; TDPBF16PS for paged attention and the bf16
// linear, TDPFP16PS for the f16 linear where a CPU has AMX-FP16, TDPBSSD /
// TDPBSUD for the quantized linear), so that the C++ test
// program checks the amx variant's tile code on CPUs without AMX. Written from
// Intel's pseudo-code; included only under CPUINFER_SIMDE_EMULATION.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../../common/dtype.h"

namespace cpuinfer::amx_emu {

struct State {
    uint8_t rows[8];
    uint16_t colsb[8];
    alignas(64) uint8_t data[8][16][64];
};
inline State &state() {
    thread_local State s;
    return s;
}

inline void load_config(const void *cfg, size_t) {
    const uint8_t *c = static_cast<const uint8_t *>(cfg);
    State &s = state();
    for (int t = 0; t < 8; ++t) {
        std::memcpy(&s.colsb[t], c + 16 + 2 * t, 2);
        s.rows[t] = c[48 + t];
    }
}
inline void zero(int t) { std::memset(state().data[t], 0, sizeof state().data[t]); }
inline void load(int t, const void *base, int64_t stride) {
    State &s = state();
    zero(t);
    for (int r = 0; r < s.rows[t]; ++r)
        std::memcpy(s.data[t][r], static_cast<const uint8_t *>(base) + r * stride, s.colsb[t]);
}
inline void store(int t, void *base, int64_t stride) {
    State &s = state();
    for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<uint8_t *>(base) + r * stride, s.data[t][r], s.colsb[t]);
}
inline float bf(const uint8_t *p) {
    uint16_t b;
    std::memcpy(&b, p, 2);
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1]  (f32 C, bf16 A, B).
inline void dpbf16ps(int c, int a, int b) {
    State &s = state();
    for (int m = 0; m < s.rows[c]; ++m)
        for (int n = 0; n < s.colsb[c] / 4; ++n) {
            float acc;
            std::memcpy(&acc, &s.data[c][m][4 * n], 4);
            for (int k = 0; k < s.colsb[a] / 4; ++k)
                acc += bf(&s.data[a][m][4 * k]) * bf(&s.data[b][k][4 * n]) +
                       bf(&s.data[a][m][4 * k + 2]) * bf(&s.data[b][k][4 * n + 2]);
            std::memcpy(&s.data[c][m][4 * n], &acc, 4);
        }
}

// C[m][n] += A[m][2k] B[k][2n], then += A[m][2k+1] B[k][2n+1], for k in
// order (f32 C, f16 A, B): each step an FMA rounded to nearest even, f16
// denormal inputs kept, f32 denormal results flushed to zero (Intel's
// TDPFP16PS). f16 products are exact in f32, so this is the f32 FMA chain.
inline void dpfp16ps(int c, int a, int b) {
    State &s = state();
    auto half = [](const uint8_t *p) {
        uint16_t h;
        std::memcpy(&h, p, 2);
        return half_bits_to_f32(h);
    };
    auto ftz = [](float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v; };
    for (int m = 0; m < s.rows[c]; ++m)
        for (int n = 0; n < s.colsb[c] / 4; ++n) {
            float acc;
            std::memcpy(&acc, &s.data[c][m][4 * n], 4);
            for (int k = 0; k < s.colsb[a] / 4; ++k) {
                acc = ftz(std::fma(half(&s.data[a][m][4 * k]), half(&s.data[b][k][4 * n]), acc));
                acc = ftz(std::fma(half(&s.data[a][m][4 * k + 2]), half(&s.data[b][k][4 * n + 2]), acc));
            }
            std::memcpy(&s.data[c][m][4 * n], &acc, 4);
        }
}

// C[m][n] += sum_k A[m][4k + i] * B[k][4n + i] over i < 4 (int32 C; A, B bytes, signed or not as named):
// TDPBSSD (both signed) and TDPBSUD (A signed, B unsigned), the quantized linear's tile.
template <bool BSigned>
inline void dpbs_d(int c, int a, int b) {
    State &s = state();
    for (int m = 0; m < s.rows[c]; ++m)
        for (int n = 0; n < s.colsb[c] / 4; ++n) {
            int32_t acc;
            std::memcpy(&acc, &s.data[c][m][4 * n], 4);
            for (int k = 0; k < s.colsb[a] / 4; ++k)
                for (int i = 0; i < 4; ++i) {
                    const int32_t x = int8_t(s.data[a][m][4 * k + i]);
                    const uint8_t w = s.data[b][k][4 * n + i];
                    acc += x * (BSigned ? int32_t(int8_t(w)) : int32_t(w));
                }
            std::memcpy(&s.data[c][m][4 * n], &acc, 4);
        }
}
}  // namespace cpuinfer::amx_emu

#define _tile_zero(t) ::cpuinfer::amx_emu::zero(t)
#define _tile_loadd(t, base, stride) ::cpuinfer::amx_emu::load(t, base, stride)
#define _tile_stream_loadd(t, base, stride) ::cpuinfer::amx_emu::load(t, base, stride)  // a cache hint only
#define _tile_stored(t, base, stride) ::cpuinfer::amx_emu::store(t, base, stride)
#define _tile_dpbf16ps(c, a, b) ::cpuinfer::amx_emu::dpbf16ps(c, a, b)
#define _tile_dpfp16ps(c, a, b) ::cpuinfer::amx_emu::dpfp16ps(c, a, b)
#define _tile_dpbssd(c, a, b) ::cpuinfer::amx_emu::dpbs_d<true>(c, a, b)
#define _tile_dpbsud(c, a, b) ::cpuinfer::amx_emu::dpbs_d<false>(c, a, b)
