// Test-only: AVX-512 intrinsics the vector layer uses that SIMDe 0.7.x
// (Debian 12's libsimde-dev) does not provide, written lane by lane from
// Intel's pseudo-code, on top of SIMDe's types. Only included with
// CPUINFER_SIMDE_EMULATION (the C++ test program's emulated avx512 run).
#pragma once
#include <simde/x86/f16c.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef __mmask16
typedef simde__mmask16 __mmask16;
#endif
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#ifndef _MM_FROUND_TO_NEAREST_INT
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#endif

namespace cpuinfer::simde_shim {

template <typename T, int N>
struct Lanes {
    T v[N];
};
inline Lanes<float, 16> f32(simde__m512 a) { Lanes<float, 16> r; simde_mm512_storeu_ps(r.v, a); return r; }
inline simde__m512 from(const Lanes<float, 16> &l) { return simde_mm512_loadu_ps(l.v); }
template <typename T, int N, typename V>
inline Lanes<T, N> ints(V a) { Lanes<T, N> r; std::memcpy(r.v, &a, sizeof r.v); return r; }
template <typename V, typename T, int N>
inline V pack(const Lanes<T, N> &l) { V r; std::memcpy(&r, l.v, sizeof r); return r; }

// VPMOVZXWD zmm, ymm: 16 unsigned 16-bit -> 32-bit.
inline simde__m512i cvtepu16_epi32(simde__m256i a) {
    auto in = ints<uint16_t, 16>(a);
    Lanes<uint32_t, 16> out;
    for (int i = 0; i < 16; ++i) out.v[i] = in.v[i];
    return pack<simde__m512i>(out);
}
// VPMOVDW ymm, zmm: truncate 32-bit lanes to 16 bits.
inline simde__m256i cvtepi32_epi16(simde__m512i a) {
    auto in = ints<uint32_t, 16>(a);
    Lanes<uint16_t, 16> out;
    for (int i = 0; i < 16; ++i) out.v[i] = uint16_t(in.v[i]);
    return pack<simde__m256i>(out);
}
// VPMOVZXBD zmm, xmm: 16 unsigned bytes -> 32-bit.
inline simde__m512i cvtepu8_epi32(simde__m128i a) {
    auto in = ints<uint8_t, 16>(a);
    Lanes<uint32_t, 16> out;
    for (int i = 0; i < 16; ++i) out.v[i] = in.v[i];
    return pack<simde__m512i>(out);
}
// VCVTDQ2PS with the default (round to nearest even) mode.
inline simde__m512 cvtepi32_ps(simde__m512i a) {
    auto in = ints<int32_t, 16>(a);
    Lanes<float, 16> out;
    for (int i = 0; i < 16; ++i) out.v[i] = float(in.v[i]);
    return from(out);
}
// VFMADD: one rounding, as the hardware does (SIMDe without native FMA multiplies, rounds, then adds; the
// quantized tiles' epilogues must give the portable tile's std::fma bits).
inline simde__m512 fmadd_ps(simde__m512 a, simde__m512 b, simde__m512 c) {
    auto x = f32(a), y = f32(b), z = f32(c);
    for (int i = 0; i < 16; ++i) z.v[i] = std::fma(x.v[i], y.v[i], z.v[i]);
    return from(z);
}
inline simde__m256 fmadd_ps(simde__m256 a, simde__m256 b, simde__m256 c) {
    float x[8], y[8], z[8];
    simde_mm256_storeu_ps(x, a);
    simde_mm256_storeu_ps(y, b);
    simde_mm256_storeu_ps(z, c);
    for (int i = 0; i < 8; ++i) z[i] = std::fma(x[i], y[i], z[i]);
    return simde_mm256_loadu_ps(z);
}
// VCVTPS2DQ with the default (round to nearest even) mode.
inline simde__m512i cvtps_epi32(simde__m512 a) {
    auto in = f32(a);
    Lanes<int32_t, 16> out;
    for (int i = 0; i < 16; ++i) out.v[i] = int32_t(std::nearbyint(in.v[i]));
    return pack<simde__m512i>(out);
}
// VCVTPH2PS / VCVTPS2PH: two 8-lane halves through SIMDe's F16C.
inline simde__m512 cvtph_ps(simde__m256i a) {
    auto h = ints<uint16_t, 16>(a);
    Lanes<float, 16> out;
    simde_mm256_storeu_ps(out.v, simde_mm256_cvtph_ps(simde_mm_loadu_si128(h.v)));
    simde_mm256_storeu_ps(out.v + 8, simde_mm256_cvtph_ps(simde_mm_loadu_si128(h.v + 8)));
    return from(out);
}
inline simde__m256i cvtps_ph(simde__m512 a) {
    auto in = f32(a);
    Lanes<uint16_t, 16> out;
    simde_mm_storeu_si128(out.v, simde_mm256_cvtps_ph(simde_mm256_loadu_ps(in.v), SIMDE_MM_FROUND_TO_NEAREST_INT));
    simde_mm_storeu_si128(out.v + 8,
                          simde_mm256_cvtps_ph(simde_mm256_loadu_ps(in.v + 8), SIMDE_MM_FROUND_TO_NEAREST_INT));
    return pack<simde__m256i>(out);
}
inline float reduce_add_ps(simde__m512 a) {
    auto in = f32(a);
    float s = 0;
    for (float x : in.v) s += x;
    return s;
}
inline float reduce_max_ps(simde__m512 a) {
    auto in = f32(a);
    float m = in.v[0];
    for (float x : in.v) m = x > m ? x : m;
    return m;
}

#if defined(CPUINFER_SIMDE_AVX512BF16)
// VCVTNEPS2BF16: round to nearest even, NaN -> quiet NaN, denormal inputs as zero.
inline simde__m256i cvtneps_pbh(simde__m512 a) {
    auto in = f32(a);
    Lanes<uint16_t, 16> out;
    for (int i = 0; i < 16; ++i) {
        uint32_t u;
        std::memcpy(&u, &in.v[i], 4);
        if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
        out.v[i] = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40)
                                                   : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return pack<simde__m256i>(out);
}
// VCVTNE2PS2BF16: b's 16 values, then a's, each as VCVTNEPS2BF16 rounds them.
inline simde__m512i cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    const simde__m256i lo = cvtneps_pbh(b), hi = cvtneps_pbh(a);
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(lo), hi, 1);
}
#endif

}  // namespace cpuinfer::simde_shim

#define _mm512_cvtepu16_epi32(a) ::cpuinfer::simde_shim::cvtepu16_epi32(a)
#define _mm512_cvtepi32_epi16(a) ::cpuinfer::simde_shim::cvtepi32_epi16(a)
#define _mm512_cvtps_epi32(a) ::cpuinfer::simde_shim::cvtps_epi32(a)
#define _mm512_cvtepu8_epi32(a) ::cpuinfer::simde_shim::cvtepu8_epi32(a)
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps(a, b, c) ::cpuinfer::simde_shim::fmadd_ps(a, b, c)
#undef _mm256_fmadd_ps
#define _mm256_fmadd_ps(a, b, c) ::cpuinfer::simde_shim::fmadd_ps(a, b, c)
#define _mm512_cvtepi32_ps(a) ::cpuinfer::simde_shim::cvtepi32_ps(a)
#define _mm512_cvtph_ps(a) ::cpuinfer::simde_shim::cvtph_ps(a)
#define _mm512_cvtps_ph(a, rounding) ::cpuinfer::simde_shim::cvtps_ph(a)
#define _mm512_reduce_add_ps(a) ::cpuinfer::simde_shim::reduce_add_ps(a)
#define _mm512_reduce_max_ps(a) ::cpuinfer::simde_shim::reduce_max_ps(a)
#if defined(CPUINFER_SIMDE_AVX512BF16)
#define _mm512_cvtneps_pbh(a) ::cpuinfer::simde_shim::cvtneps_pbh(a)
#define _mm512_cvtne2ps_pbh(a, b) ::cpuinfer::simde_shim::cvtne2ps_pbh(a, b)
#endif
