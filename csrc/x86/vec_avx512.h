// AVX-512 (F/BW/DQ/VL) vector layer: 16 f32 lanes in a zmm register. With
// AVX512-BF16 (avx512bf16 and amx variants) bf16 stores use the hardware
// round-to-nearest-even conversion.
//
// CPUINFER_SIMDE_EMULATION (CMake option, tests only): the same code on SIMDe's
// portable AVX-512 implementation, so that the C++ test program checks this
// layer's logic on machines without AVX-512.
#pragma once
#if defined(CPUINFER_SIMDE_EMULATION)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include "emulation/simde_avx512_shim.h"
#else
#include <immintrin.h>
#endif
#include <type_traits>

#include "../common/dtype.h"

namespace cpuinfer::vec {

// Register budget of the common tiles (32 registers): query rows per attention
// tile (attention_tile.h), x rows per linear panel tile (panel_kernel.h).
constexpr int kAttnRows = 16;
constexpr int kPanelRows = 12;

constexpr const char *kName = "avx512";
constexpr int kW = 16;
struct vf { __m512 v; };

inline int width() { return kW; }
inline vf zero() { return {_mm512_setzero_ps()}; }
inline vf splat(float x) { return {_mm512_set1_ps(x)}; }

inline vf load(const float *p) { return {_mm512_loadu_ps(p)}; }
inline void store(float *p, vf a) { _mm512_storeu_ps(p, a.v); }
#if !defined(CPUINFER_SIMDE_EMULATION)  // (SIMDe has no streaming stores: the defaults' plain ones)
#define CPUINFER_VEC_STREAM_STORE 1
inline void stream(float *p, vf a) { _mm512_stream_ps(p, a.v); }
inline void stream_fence() { _mm_sfence(); }
#endif

inline vf load(const bf16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline void store(bf16_t *p, vf a) {
#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), (__m256i)_mm512_cvtneps_pbh(a.v));
#else
    __m512i u = _mm512_castps_si512(a.v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtepi32_epi16(r));
#endif
}

inline vf load(const f16_t *p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)))}; }
inline void store(f16_t *p, vf a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// fp8 e5m2 is the top byte of an f16: widen and convert exactly.
inline vf load(const fp8_e5m2_t *p) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    return {_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8))};
}

inline vf add(vf a, vf b) { return {_mm512_add_ps(a.v, b.v)}; }
inline vf sub(vf a, vf b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline vf mul(vf a, vf b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline vf div(vf a, vf b) { return {_mm512_div_ps(a.v, b.v)}; }
inline vf fma(vf a, vf b, vf c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline vf min(vf a, vf b) { return {_mm512_min_ps(a.v, b.v)}; }
inline vf max(vf a, vf b) { return {_mm512_max_ps(a.v, b.v)}; }
inline vf abs(vf a) { return {_mm512_abs_ps(a.v)}; }
inline vf copysign(vf mag, vf sign) {
    __m512i s = _mm512_set1_epi32(int(0x80000000u));
    // ternary logic 0xca: s ? sign : mag, bitwise
    return {_mm512_castsi512_ps(_mm512_ternarylogic_epi32(s, _mm512_castps_si512(sign.v), _mm512_castps_si512(mag.v), 0xca))};
}
inline vf round(vf a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline vf pow2i(vf n) {
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
// A loaded value that several FMAs use, kept in a register: GCC otherwise
// folds the load into each FMA's memory operand, one load per use.
#if !defined(CPUINFER_SIMDE_EMULATION)
#define CPUINFER_VEC_IN_REGISTER 1
inline vf in_register(vf v) {
    asm("" : "+v"(v.v));
    return v;
}
#endif
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a.v); }
// Sums in one fixed order, written out (not _mm512_reduce_add_ps, whose tree
// is the compiler's): halve to 256 bits (y_i = x_i + x_{i+8}), then
// ((y0 + y4) + (y2 + y6)) + ((y1 + y5) + (y3 + y7)). reduce_add4 gives each of
// its four sums the same bits: attention reduces a key's score with either,
// depending on how many rows share its tile, and a query row's output must
// not depend on its batch (a prefill row against the same row decoded alone).
inline __m256 fold256(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
inline float reduce_add(vf a) {
    const __m256 y = fold256(a.v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define CPUINFER_VEC_REDUCE_ADD4 1
inline void reduce_add4(vf a, vf b, vf c, vf d, float *out) {
    const __m256 ya = fold256(a.v), yb = fold256(b.v), yc = fold256(c.v), yd = fold256(d.v);
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(ya, yb, 0x20), _mm256_permute2f128_ps(ya, yb, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(yc, yd, 0x20), _mm256_permute2f128_ps(yc, yd, 0x31));
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_hadd_ps(s, s);  // [a c a c | b d b d]
    _mm_storeu_ps(out, _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// reduce_add of 16 vectors at once (x: 16 rows of 16 floats), each sum with
// reduce_add's bits: its tree, stage by stage, transposed. Stage 1 adds the
// upper 256 bits to the lower (two vectors per result), stage 2 the upper 128
// of each half, stage 3 the upper 64 of each 128, stage 4 the odd lane to the
// even one; key k's sum lands in lane 4 (k % 4) + k / 4. 15 adds and ~32
// shuffles for 16 sums, against ~6 instructions a sum one by one: the QK
// reductions were half of qk_tile's samples in a decode at SmolLM2's heads
// (3 rows a KV head, fp8 cache). Measured there, 4096 keys, one thread's CPU
// time, alternating builds: 0.175-0.178 -> 0.162-0.163 ms with the KV in
// cache, 0.233-0.239 -> 0.223-0.228 ms streamed from memory.
#define CPUINFER_VEC_REDUCE_ADD16 1
constexpr int kReduceKeys = 16;
inline void reduce_add16(const float *x, float *out) {
    // 128-bit lane shuffles through the integer form (the same instruction class; SIMDe lacks the float one).
    auto lanes = [](__m512 a, __m512 b, auto imm) {
        return _mm512_castsi512_ps(_mm512_shuffle_i32x4(_mm512_castps_si512(a), _mm512_castps_si512(b), imm()));
    };
    using lo = std::integral_constant<int, 0x44>;
    using hi = std::integral_constant<int, 0xEE>;
    using even = std::integral_constant<int, 0x88>;
    using odd = std::integral_constant<int, 0xDD>;
    __m512 c[8], d[4], g[2];
    for (int m = 0; m < 8; ++m) {
        const __m512 a = _mm512_loadu_ps(x + 32 * m), b = _mm512_loadu_ps(x + 32 * m + 16);
        c[m] = _mm512_add_ps(lanes(a, b, lo{}), lanes(a, b, hi{}));
    }
    for (int p = 0; p < 4; ++p) d[p] = _mm512_add_ps(lanes(c[2 * p], c[2 * p + 1], even{}), lanes(c[2 * p], c[2 * p + 1], odd{}));
    for (int r = 0; r < 2; ++r)
        g[r] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * r], d[2 * r + 1], 0x44),
                             _mm512_shuffle_ps(d[2 * r], d[2 * r + 1], 0xEE));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, s));
}

}  // namespace cpuinfer::vec
