// AVX2 + FMA + F16C vector layer: 8 f32 lanes in a ymm register.
#pragma once
#include <immintrin.h>
#include "../common/dtype.h"

namespace cpuinfer::vec {

// Register budget of the common tiles (16 registers: 8 attention rows; 2 * 5 panel accumulators + 2 weights + a broadcast (6 rows made GCC spill, halving the bf16 tile)): query rows per attention
// tile (attention_tile.h), x rows per linear panel tile (panel_kernel.h).
constexpr int kAttnRows = 8;
constexpr int kPanelRows = 5;

constexpr const char *kName = "avx2";
constexpr int kW = 8;
struct vf { __m256 v; };

inline int width() { return kW; }
inline vf zero() { return {_mm256_setzero_ps()}; }
inline vf splat(float x) { return {_mm256_set1_ps(x)}; }

inline vf load(const float *p) { return {_mm256_loadu_ps(p)}; }
inline void store(float *p, vf a) { _mm256_storeu_ps(p, a.v); }
#define CPUINFER_VEC_STREAM_STORE 1
inline void stream(float *p, vf a) { _mm256_stream_ps(p, a.v); }
inline void stream_fence() { _mm_sfence(); }

inline vf load(const bf16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
// Round to nearest even into the high 16 bits of each lane (the low 16 are
// garbage); NaN -> quiet NaN, matching torch.
inline __m256i round_bf16_high(vf a) {
    __m256i u = _mm256_castps_si256(a.v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
}
inline void store(bf16_t *p, vf a) {
    __m256i r = _mm256_srli_epi32(round_bf16_high(a), 16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_castsi256_si128(packed));
}

// bf16 pairs (see vec.h: load2a/load2b/store2) hold the even elements in a
// and the odd ones in b: a bf16 is the high half of an f32, so 16 bf16 in one
// ymm are 8 odd f32 as they stand and 8 even f32 after a 16-bit shift. No
// widening shuffle on load, no pack or permute on store. (Loading a and b
// separately costs nothing: the compiler merges the two identical loads.)
inline vf load2a(const bf16_t *p) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)), 16))};
}
inline vf load2b(const bf16_t *p) {
    __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return {_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))))};
}
inline void store2(bf16_t *p, vf a, vf b) {
    __m256i even = _mm256_srli_epi32(round_bf16_high(a), 16);
    __m256i odd = _mm256_and_si256(round_bf16_high(b), _mm256_set1_epi32(int(0xffff0000u)));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(p), _mm256_or_si256(even, odd));
}

// f32 rows to and from the bf16 pair order (even elements, then odd, per 16).
inline void pair_order(float *x, int64_t n, const bf16_t *) {
    for (int64_t i = 0; i + 2 * kW <= n; i += 2 * kW) {
        __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + i + kW);
        // x0 x2 x8 x10 | x4 x6 x12 x14, then the 64-bit pairs into order
        __m256 even = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
        __m256 odd = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
        _mm256_storeu_ps(x + i, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xd8)));
        _mm256_storeu_ps(x + i + kW, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xd8)));
    }
}
inline void natural_order(float *x, int64_t n, const bf16_t *) {
    for (int64_t i = 0; i + 2 * kW <= n; i += 2 * kW) {
        __m256 even = _mm256_loadu_ps(x + i), odd = _mm256_loadu_ps(x + i + kW);
        __m256 lo = _mm256_unpacklo_ps(even, odd);  // x0 x1 x2 x3 | x8 x9 x10 x11
        __m256 hi = _mm256_unpackhi_ps(even, odd);  // x4 x5 x6 x7 | x12 x13 x14 x15
        _mm256_storeu_ps(x + i, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(x + i + kW, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}

inline vf load(const f16_t *p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)))}; }
inline void store(f16_t *p, vf a) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// fp8 e5m2 is the top byte of an f16: widen bytes into the high half of
// 16-bit lanes and convert exactly with F16C.
inline vf load(const fp8_e5m2_t *p) {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p));
    return {_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8))};
}

// 16 at once in the bf16 pair order (even elements in a, odd in b): each
// 16-bit lane holds an odd element's f16 in its high byte and an even one's
// in its low byte, so one mask or one shift makes 8 f16 of either, with no
// widening shuffle. Measured ~9% less fp8 decode time than widening first
// (KV in cache).
inline vf load2a(const fp8_e5m2_t *p) {
    return {_mm256_cvtph_ps(_mm_slli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)), 8))};
}
inline vf load2b(const fp8_e5m2_t *p) {
    __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    return {_mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16(int16_t(0xff00))))};
}
inline void pair_order(float *x, int64_t n, const fp8_e5m2_t *) { pair_order(x, n, static_cast<const bf16_t *>(nullptr)); }
inline void natural_order(float *x, int64_t n, const fp8_e5m2_t *) { natural_order(x, n, static_cast<const bf16_t *>(nullptr)); }

inline vf add(vf a, vf b) { return {_mm256_add_ps(a.v, b.v)}; }
inline vf sub(vf a, vf b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline vf mul(vf a, vf b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline vf div(vf a, vf b) { return {_mm256_div_ps(a.v, b.v)}; }
inline vf fma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline vf min(vf a, vf b) { return {_mm256_min_ps(a.v, b.v)}; }
inline vf max(vf a, vf b) { return {_mm256_max_ps(a.v, b.v)}; }
inline vf abs(vf a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
inline vf copysign(vf mag, vf sign) {
    __m256 s = _mm256_set1_ps(-0.0f);
    return {_mm256_or_ps(_mm256_andnot_ps(s, mag.v), _mm256_and_ps(s, sign.v))};
}
inline vf round(vf a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline vf pow2i(vf n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
// A loaded value that several FMAs use, kept in a register: GCC otherwise
// folds the load into each FMA's memory operand, one load per use.
#define CPUINFER_VEC_IN_REGISTER 1
inline vf in_register(vf v) {
    asm("" : "+x"(v.v));
    return v;
}
// ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)).
inline float reduce_add(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
// Four sums at once, each in reduce_add's order (the same bits): attention
// reduces a key's score with reduce_add or reduce_add4 depending on how many
// rows share its tile, so any other order made a query row's output depend on
// its batch (a prefill row against the same row decoded alone).
#define CPUINFER_VEC_REDUCE_ADD4 1
inline void reduce_add4(vf a, vf b, vf c, vf d, float *out) {
    // [a0+a4 .. a3+a7 | b0+b4 .. b3+b7] and the same for c, d
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a.v, b.v, 0x20), _mm256_permute2f128_ps(a.v, b.v, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c.v, d.v, 0x20), _mm256_permute2f128_ps(c.v, d.v, 0x31));
    // (s0 + s2, s1 + s3) of each: [a02 a13 c02 c13 | b02 b13 d02 d13]
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_hadd_ps(s, s);  // [a c a c | b d b d]
    _mm_storeu_ps(out, _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline float reduce_max(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

}  // namespace cpuinfer::vec
