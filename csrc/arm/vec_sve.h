// SVE vector layer: vector-length agnostic, so width() is read at run time
// (svcntw()) and vf wraps a sizeless type used only as a value.
#pragma once
#include <arm_sve.h>
#include "../common/dtype.h"

namespace cpuinfer::vec {

// Register budget of the common tiles (32 registers): query rows per attention
// tile (attention_tile.h), x rows per linear panel tile (panel_kernel.h).
constexpr int kAttnRows = 16;
constexpr int kPanelRows = 12;

constexpr const char *kName = "sve";
using vf = svfloat32_t;

inline svbool_t all() { return svptrue_b32(); }
inline int width() { return int(svcntw()); }
inline vf zero() { return svdup_n_f32(0.f); }
inline vf splat(float x) { return svdup_n_f32(x); }

inline vf load(const float *p) { return svld1_f32(all(), p); }
inline void store(float *p, vf a) { svst1_f32(all(), p, a); }

inline vf load(const bf16_t *p) {
    svuint32_t w = svld1uh_u32(all(), reinterpret_cast<const uint16_t *>(p));
    return svreinterpret_f32_u32(svlsl_n_u32_x(all(), w, 16));
}
inline void store(bf16_t *p, vf a) {
    svuint32_t u = svreinterpret_u32_f32(a);
    svuint32_t lsb = svand_n_u32_x(all(), svlsr_n_u32_x(all(), u, 16), 1);
    svuint32_t r = svlsr_n_u32_x(all(), svadd_u32_x(all(), svadd_n_u32_x(all(), u, 0x7fff), lsb), 16);
    svbool_t nan = svcmpuo_f32(all(), a, a);
    r = svsel_u32(nan, svorr_n_u32_x(all(), svlsr_n_u32_x(all(), u, 16), 0x40), r);
    svst1h_u32(all(), reinterpret_cast<uint16_t *>(p), r);
}

inline vf load(const f16_t *p) {
    // Load halves into the even 16-bit lanes of each 32-bit container, widen.
    svuint32_t w = svld1uh_u32(all(), reinterpret_cast<const uint16_t *>(p));
    return svcvt_f32_f16_x(all(), svreinterpret_f16_u32(w));
}
inline void store(f16_t *p, vf a) {
    svfloat16_t h = svcvt_f16_f32_x(all(), a);
    svst1h_u32(all(), reinterpret_cast<uint16_t *>(p), svreinterpret_u32_f16(h));
}
// fp8 e5m2 is the top byte of an f16: one byte per 32-bit container,
// shifted into the high half of its low 16 bits, then widened like f16.
inline vf load(const fp8_e5m2_t *p) {
    svuint32_t w = svld1ub_u32(all(), reinterpret_cast<const uint8_t *>(p));
    return svcvt_f32_f16_x(all(), svreinterpret_f16_u32(svlsl_n_u32_x(all(), w, 8)));
}

inline vf add(vf a, vf b) { return svadd_f32_x(all(), a, b); }
inline vf sub(vf a, vf b) { return svsub_f32_x(all(), a, b); }
inline vf mul(vf a, vf b) { return svmul_f32_x(all(), a, b); }
inline vf div(vf a, vf b) { return svdiv_f32_x(all(), a, b); }
inline vf fma(vf a, vf b, vf c) { return svmla_f32_x(all(), c, a, b); }
inline vf min(vf a, vf b) { return svmin_f32_x(all(), a, b); }
inline vf max(vf a, vf b) { return svmax_f32_x(all(), a, b); }
inline vf abs(vf a) { return svabs_f32_x(all(), a); }
inline vf copysign(vf mag, vf sign) {
    svuint32_t s = svdup_n_u32(0x80000000u);
    svuint32_t m = svreinterpret_u32_f32(mag), g = svreinterpret_u32_f32(sign);
    return svreinterpret_f32_u32(svorr_u32_x(all(), svbic_u32_x(all(), m, s), svand_u32_x(all(), g, s)));
}
inline vf round(vf a) { return svrintn_f32_x(all(), a); }
inline vf pow2i(vf n) {
    svint32_t e = svadd_n_s32_x(all(), svcvt_s32_f32_x(all(), n), 127);
    return svreinterpret_f32_s32(svlsl_n_s32_x(all(), e, 23));
}
inline float reduce_add(vf a) { return svaddv_f32(all(), a); }
inline float reduce_max(vf a) { return svmaxv_f32(all(), a); }

}  // namespace cpuinfer::vec
