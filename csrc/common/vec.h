// The vector interface every kernel is written against.
//
// Each layer header (CPUINFER_VEC_HEADER, set per variant by CMake from
// cmake/isa_table.json's vec_layers) defines, in namespace cpuinfer::vec:
//   kAttnRows, kPanelRows   the common tiles' register budget (rows per tile)
//   vf                      a vector of f32 lanes (a plain value type)
//   int width()             lanes per vf (a runtime value: SVE is length-agnostic)
//   vf zero(), splat(float)
//   vf load(const T*), void store(T*, vf)   for T in float, bf16_t, f16_t
//   vf load(const fp8_e5m2_t*)              (exact widening; KV-cache reads)
//   add sub mul div fma(a,b,c)=a*b+c min max abs
//   copysign(mag, sign)     |mag| with the sign of sign
//   round(vf)               to nearest integer (ties to even)
//   pow2i(vf n)             2^n for integral n in [-126, 127]
//   float reduce_add(vf), reduce_max(vf)
//   in_register(v)          v, pinned in a register (a no-op by default; x86
//                           layers use it to stop the compiler folding one
//                           load into every FMA that uses it, which turns one
//                           load into several)
//   reduce_add4(a, b, c, d, float *out)  out[0..3] = the four sums (a default
//                           below; layers with a cheaper transposed reduction
//                           define CPUINFER_VEC_REDUCE_ADD4 and their own)
//   kReduceKeys, reduce_add16(const float *x, float *out)  out[k] = reduce_add of
//                           the vector at x + k * width() for k < 16, with its bits
//                           (the default below: 0, one reduce_add each; layers
//                           with a transposed 16-way reduction define
//                           CPUINFER_VEC_REDUCE_ADD16, kReduceKeys = 16 and their own)
//   vf load2a(const T*), vf load2b(const T*), void store2(T*, vf a, vf b)
//                           2*width() consecutive elements as two vectors (a, b),
//                           in a lane order the layer may choose per T (x86 keeps
//                           bf16 as even/odd elements, which saves the widening
//                           shuffles). Only for element-wise work where every
//                           operand goes through load2a/b and every result through
//                           store2. Two functions, not a struct of two vectors:
//                           SVE vectors are sizeless and cannot be members.
//                           Defaults below: load(p), load(p + width()).
//   pair_order / natural_order   f32 rows to and from that lane order (below)
//   stream(float*, vf), stream_fence()   a store that bypasses the caches (p
//                           aligned to the vector), for output written once
//                           and far larger than the caches, and the fence that
//                           orders such stores before the thread's next ones
//                           (defaults below: store(), nothing; layers with
//                           such stores define CPUINFER_VEC_STREAM_STORE and their own)
// Transcendentals (exp, erf, tanh) are built once below from these.
#pragma once
#include "dtype.h"

#if !defined(CPUINFER_VEC_HEADER)
#error "no vector layer selected: CMake must define CPUINFER_VEC_HEADER (see cmake/isa_table.json)"
#endif
#include CPUINFER_VEC_HEADER

// A platform's tuning constants (CPUINFER_TUNING_HEADER, from CMake: Apple's
// 128-byte lines), else these.
#if defined(CPUINFER_TUNING_HEADER)
#include CPUINFER_TUNING_HEADER
#else
namespace cpuinfer::tuning {
constexpr int kCacheLine = 64;
}  // namespace cpuinfer::tuning
#endif

namespace cpuinfer::vec {

// Layers overload these for the types where another lane order pays; a
// non-template overload wins over these templates.
template <typename T>
inline vf load2a(const T *p) { return load(p); }
template <typename T>
inline vf load2b(const T *p) { return load(p + width()); }
template <typename T>
inline void store2(T *p, vf a, vf b) { store(p, a); store(p + width(), b); }

#if !defined(CPUINFER_VEC_IN_REGISTER)
inline vf in_register(vf v) { return v; }
#endif

#if !defined(CPUINFER_VEC_STREAM_STORE)
inline void stream(float *p, vf a) { store(p, a); }
inline void stream_fence() {}
#endif

#if !defined(CPUINFER_VEC_REDUCE_ADD4)
inline void reduce_add4(vf a, vf b, vf c, vf d, float *out) {
    out[0] = reduce_add(a);
    out[1] = reduce_add(b);
    out[2] = reduce_add(c);
    out[3] = reduce_add(d);
}
#endif

#if !defined(CPUINFER_VEC_REDUCE_ADD16)
constexpr int kReduceKeys = 0;
inline void reduce_add16(const float *x, float *out) {
    for (int k = 0; k < 16; ++k) out[k] = reduce_add(load(x + k * width()));
}
#endif

// An f32 row that meets load2a/load2b(const C*) results lane by lane (a query row
// against keys, an accumulator against values) is kept in that lane order:
// pair_order permutes each whole 2*width() chunk of x[0, n) from natural
// order into it, natural_order undoes it (the tail stays natural). The C*
// argument only selects the element type. Identity unless the layer
// overloads load2a/load2b for C.
template <typename C>
inline void pair_order(float *, int64_t, const C *) {}
template <typename C>
inline void natural_order(float *, int64_t, const C *) {}

// exp(x) in f32: range reduction x = n*ln2 + r, |r| <= ln2/2, then a degree-6
// polynomial for e^r (Cephes expf coefficients); max relative error ~2 ulp.
inline vf exp(vf x) {
    x = min(max(x, splat(-87.3365448f)), splat(88.3762626f));
    vf n = round(mul(x, splat(1.44269504088896341f)));
    vf r = fma(n, splat(-0.693359375f), x);
    r = fma(n, splat(2.12194440e-4f), r);
    vf p = splat(1.9875691500e-4f);
    p = fma(p, r, splat(1.3981999507e-3f));
    p = fma(p, r, splat(8.3334519073e-3f));
    p = fma(p, r, splat(4.1665795894e-2f));
    p = fma(p, r, splat(1.6666665459e-1f));
    p = fma(p, r, splat(5.0000001201e-1f));
    p = fma(p, mul(r, r), add(r, splat(1.0f)));
    return mul(p, pow2i(n));
}

// erf(x): Abramowitz & Stegun 7.1.26 refined form, |error| < 1.5e-7.
inline vf erf(vf x) {
    vf a = abs(x);
    vf t = div(splat(1.0f), fma(a, splat(0.3275911f), splat(1.0f)));
    vf p = splat(1.061405429f);
    p = fma(p, t, splat(-1.453152027f));
    p = fma(p, t, splat(1.421413741f));
    p = fma(p, t, splat(-0.284496736f));
    p = fma(p, t, splat(0.254829592f));
    p = mul(p, t);
    vf e = exp(mul(mul(a, a), splat(-1.0f)));
    vf y = sub(splat(1.0f), mul(p, e));
    return copysign(y, x);
}

// tanh(x) = 1 - 2 / (1 + e^{2x}), odd-symmetrised for accuracy near zero.
inline vf tanh(vf x) {
    vf a = abs(x);
    vf e = exp(mul(a, splat(2.0f)));
    vf y = sub(splat(1.0f), div(splat(2.0f), add(e, splat(1.0f))));
    return copysign(y, x);
}

}  // namespace cpuinfer::vec
