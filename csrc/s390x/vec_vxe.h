// IBM Z vector layer (z14 VXE and later): 4 f32 lanes per register, two per
// vf. Big-endian: bf16/f16 widening works on integer values, never on bytes.
#pragma once
#include <vecintrin.h>
#include "../common/dtype.h"

namespace cpuinfer::vec {

// Register budget of the common tiles (32 registers): query rows per attention
// tile (attention_tile.h), x rows per linear panel tile (panel_kernel.h).
constexpr int kAttnRows = 16;
constexpr int kPanelRows = 12;

constexpr const char *kName = "vxe";
constexpr int kW = 8;
typedef __vector float f4;
typedef __vector unsigned int u4;
typedef __vector signed int s4;
typedef __vector unsigned short u8;
struct vf { f4 lo, hi; };

inline int width() { return kW; }
inline vf splat(float x) { return {vec_splats(x), vec_splats(x)}; }
inline vf zero() { return splat(0.f); }

inline vf load(const float *p) { return {vec_xl(0, p), vec_xl(16, p)}; }
inline void store(float *p, vf a) { vec_xst(a.lo, 0, p); vec_xst(a.hi, 16, p); }

inline vf load(const bf16_t *p) {
    u8 w = vec_xl(0, reinterpret_cast<const unsigned short *>(p));
    u4 lo = vec_unpackh(w), hi = vec_unpackl(w);  // zero-extending widen of lanes 0-3, 4-7
    return {(f4)(lo << 16), (f4)(hi << 16)};
}
inline u4 bf16_round(f4 a) {
    u4 u = (u4)a;
    u4 lsb = (u >> 16) & 1u;
    u4 r = (u + 0x7fffu + lsb) >> 16;
    u4 qnan = (u >> 16) | 0x40u;
    return vec_sel(qnan, r, (u4)vec_cmpeq(a, a));
}
inline void store(bf16_t *p, vf a) {
    u8 packed = vec_pack(bf16_round(a.lo), bf16_round(a.hi));  // keeps the low 16 bits of each lane
    vec_xst(packed, 0, reinterpret_cast<unsigned short *>(p));
}

// No f16 vector conversion on z14/z15: go through the exact scalar routine.
inline vf load(const f16_t *p) {
    float t[8];
    for (int i = 0; i < 8; ++i) t[i] = to_f32(p[i]);
    return load(t);
}
inline void store(f16_t *p, vf a) {
    float t[8];
    store(t, a);
    for (int i = 0; i < 8; ++i) p[i] = from_f32<f16_t>(t[i]);
}
// fp8 e5m2 (top byte of an f16): no f16 vector conversion here either.
inline vf load(const fp8_e5m2_t *p) {
    float t[8];
    for (int i = 0; i < 8; ++i) t[i] = to_f32(p[i]);
    return load(t);
}

// GCC's <vecintrin.h> has no vec_add/sub/mul/div/sl/sr: the z/Architecture
// vector interface uses the C operators on vector types for those.
inline vf add(vf a, vf b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline vf sub(vf a, vf b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline vf mul(vf a, vf b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline vf div(vf a, vf b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline vf fma(vf a, vf b, vf c) { return {vec_madd(a.lo, b.lo, c.lo), vec_madd(a.hi, b.hi, c.hi)}; }
inline vf min(vf a, vf b) { return {vec_min(a.lo, b.lo), vec_min(a.hi, b.hi)}; }
inline vf max(vf a, vf b) { return {vec_max(a.lo, b.lo), vec_max(a.hi, b.hi)}; }
inline vf abs(vf a) { return {vec_abs(a.lo), vec_abs(a.hi)}; }
inline f4 copysign4(f4 mag, f4 sign) { return vec_sel(mag, sign, vec_splats(0x80000000u)); }
inline vf copysign(vf mag, vf sign) { return {copysign4(mag.lo, sign.lo), copysign4(mag.hi, sign.hi)}; }
inline vf round(vf a) { return {vec_rint(a.lo), vec_rint(a.hi)}; }
inline f4 pow2i4(f4 n) {
    // n is integral; the f32 -> i32 vector convert is z15-only, so let the
    // compiler pick (one instruction on vxe2, lane by lane on z14).
    s4 e = __builtin_convertvector(n, s4) + 127;
    return (f4)(e << 23);
}
inline vf pow2i(vf n) { return {pow2i4(n.lo), pow2i4(n.hi)}; }
inline float reduce_add(vf a) {
    f4 s = a.lo + a.hi;
    return s[0] + s[1] + s[2] + s[3];
}
inline float reduce_max(vf a) {
    f4 s = vec_max(a.lo, a.hi);
    float m = s[0];
    for (int i = 1; i < 4; ++i) m = s[i] > m ? s[i] : m;
    return m;
}

}  // namespace cpuinfer::vec
