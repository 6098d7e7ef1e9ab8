// NEON (Advanced SIMD) vector layer: 4 f32 lanes, two registers per vf so
// that a loop step covers 8 elements like the other layers. fp16 arithmetic
// conversion comes from armv8.2-a+fp16; with +bf16 the bf16 stores use BFCVTN.
#pragma once
#include <arm_neon.h>
#include "../common/dtype.h"

namespace cpuinfer::vec {

// Register budget of the common tiles (a vf is two NEON registers): query rows per attention
// tile (attention_tile.h), x rows per linear panel tile (panel_kernel.h).
constexpr int kAttnRows = 8;
constexpr int kPanelRows = 6;

constexpr const char *kName = "neon";
constexpr int kW = 8;
struct vf { float32x4_t lo, hi; };

inline int width() { return kW; }
inline vf zero() { return {vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
inline vf splat(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }

inline vf load(const float *p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
inline void store(float *p, vf a) { vst1q_f32(p, a.lo); vst1q_f32(p + 4, a.hi); }

inline vf load(const bf16_t *p) {
    uint16x8_t w = vld1q_u16(reinterpret_cast<const uint16_t *>(p));
    return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(w), 16)),
            vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(w), 16))};
}
inline uint16x4_t bf16_round(float32x4_t a) {
    uint32x4_t u = vreinterpretq_u32_f32(a);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb), 16);
    uint32x4_t qnan = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
    uint32x4_t is_num = vceqq_f32(a, a);
    return vmovn_u32(vbslq_u32(is_num, r, qnan));
}
inline void store(bf16_t *p, vf a) {
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
    bfloat16x8_t b = vcvtq_high_bf16_f32(vcvtq_low_bf16_f32(a.lo), a.hi);
    vst1q_bf16(reinterpret_cast<bfloat16_t *>(p), b);
#else
    vst1q_u16(reinterpret_cast<uint16_t *>(p), vcombine_u16(bf16_round(a.lo), bf16_round(a.hi)));
#endif
}

inline vf load(const f16_t *p) {
    float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<const uint16_t *>(p)));
    return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
inline void store(f16_t *p, vf a) {
    float16x8_t h = vcvt_high_f16_f32(vcvt_f16_f32(a.lo), a.hi);
    vst1q_u16(reinterpret_cast<uint16_t *>(p), vreinterpretq_u16_f16(h));
}
// fp8 e5m2 is the top byte of an f16: shift bytes into the high half of
// 16-bit lanes and convert exactly.
inline vf load(const fp8_e5m2_t *p) {
    uint16x8_t w = vshll_n_u8(vld1_u8(reinterpret_cast<const uint8_t *>(p)), 8);
    float16x8_t h = vreinterpretq_f16_u16(w);
    return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}

inline vf add(vf a, vf b) { return {vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
inline vf sub(vf a, vf b) { return {vsubq_f32(a.lo, b.lo), vsubq_f32(a.hi, b.hi)}; }
inline vf mul(vf a, vf b) { return {vmulq_f32(a.lo, b.lo), vmulq_f32(a.hi, b.hi)}; }
inline vf div(vf a, vf b) { return {vdivq_f32(a.lo, b.lo), vdivq_f32(a.hi, b.hi)}; }
inline vf fma(vf a, vf b, vf c) { return {vfmaq_f32(c.lo, a.lo, b.lo), vfmaq_f32(c.hi, a.hi, b.hi)}; }
inline vf min(vf a, vf b) { return {vminq_f32(a.lo, b.lo), vminq_f32(a.hi, b.hi)}; }
inline vf max(vf a, vf b) { return {vmaxq_f32(a.lo, b.lo), vmaxq_f32(a.hi, b.hi)}; }
inline vf abs(vf a) { return {vabsq_f32(a.lo), vabsq_f32(a.hi)}; }
inline vf copysign(vf mag, vf sign) {
    uint32x4_t s = vdupq_n_u32(0x80000000u);
    return {vbslq_f32(s, sign.lo, mag.lo), vbslq_f32(s, sign.hi, mag.hi)};
}
inline vf round(vf a) { return {vrndnq_f32(a.lo), vrndnq_f32(a.hi)}; }
inline float32x4_t pow2i_q(float32x4_t n) {
    int32x4_t e = vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127));
    return vreinterpretq_f32_s32(vshlq_n_s32(e, 23));
}
inline vf pow2i(vf n) { return {pow2i_q(n.lo), pow2i_q(n.hi)}; }
inline float reduce_add(vf a) { return vaddvq_f32(vaddq_f32(a.lo, a.hi)); }
#define CPUINFER_VEC_REDUCE_ADD4 1
inline void reduce_add4(vf a, vf b, vf c, vf d, float *out) {
    float32x4_t ab = vpaddq_f32(vaddq_f32(a.lo, a.hi), vaddq_f32(b.lo, b.hi));
    float32x4_t cd = vpaddq_f32(vaddq_f32(c.lo, c.hi), vaddq_f32(d.lo, d.hi));
    vst1q_f32(out, vpaddq_f32(ab, cd));
}
inline float reduce_max(vf a) { return vmaxvq_f32(vmaxq_f32(a.lo, a.hi)); }

}  // namespace cpuinfer::vec
