// Arm NEON specialisation of the quantized linear tile (see common/quant_tile.h).
//
// A panel's 16 features are 4 int32x4 lanes groups ("quads" of 4 features).
// Each 64-byte operand holds 4 consecutive k of every feature, so its 16
// bytes of one quad against 4 bytes of x is one dot-product instruction,
// the x bytes taken by lane from a register holding a 16-k half of the row:
// - i8mm (neon_bf16, apple_m2): USDOT, u8 weights times s8 x, as they are.
// - dotprod only (neon, apple_m1): SDOT (both signed). 4-bit values (0..15)
//   are already valid int8. 8-bit values enter as u - 128 (one EOR of the
//   top bit, shared by the tile's rows) and the accumulator starts at
//   128 * sum(x), which the activation rows carry: the same exact int32.
// The f32 epilogue is the portable tile's, step by step (FMLA is fused like
// std::fma), so every variant produces the same bits.
//
// Registers (32 of 128 bits): per row 4 f32 and 4 int32 accumulators plus 2 x
// registers for all 16 features. One or two rows keep all 16 features (20 or
// 28 registers with the weight operands); three or four rows run the panel as
// two halves of 8 features, so the accumulators still fit and the weight
// operands (and their nibble split / EOR) are shared by all the rows.
#pragma once
#if defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>

namespace cpuinfer::quant {

template <int Bits, bool Min, bool G16>
struct NeonQuantTile {
    static_assert(!(Min && G16), "group 16 comes with zero points only (Q6_K)");
#if defined(__ARM_FEATURE_MATMUL_INT8)
    static constexpr const char *kName = "neon_i8mm";
    static constexpr bool kUnsignedDot = true;
#else
    static constexpr const char *kName = "neon_dotprod";
    static constexpr bool kUnsignedDot = false;
#endif
    static constexpr int kMaxRows = 4;
    // 8-bit values through SDOT are u - 128: each half's sum is short by 128 * sum(x).
    static constexpr bool kBias = Bits == 8 && !kUnsignedDot;

    // Quad q (features 4q..4q+3) of the values for k = 16h + 4j .. +3, as the dot product takes them.
    static uint8x16_t operand(const uint8_t *qb, int h, int j, int q) {
        if constexpr (Bits == 8) {
            const uint8x16_t v = vld1q_u8(qb + 64 * (4 * h + j) + 16 * q);
            return kBias ? veorq_u8(v, vdupq_n_u8(0x80)) : v;
        } else {
            const uint8x16_t v = vld1q_u8(qb + 64 * j + 16 * q);
            return h ? vshrq_n_u8(v, 4) : vandq_u8(v, vdupq_n_u8(15));
        }
    }

    template <int J>
    static int32x4_t dot(int32x4_t s, uint8x16_t u, int8x16_t x) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
        return vusdotq_laneq_s32(s, u, x, J);
#else
        return vdotq_laneq_s32(s, vreinterpretq_s8_u8(u), x, J);
#endif
    }

    // s[r][q] += the quads' values of k = 16h + 4J .. +3 against row r's x.
    template <int MR, int NQ, int J>
    static void step(const uint8_t *qb, int h, int q0, const int8x16_t (&xv)[MR][2], int32x4_t (&s)[MR][NQ]) {
        for (int q = 0; q < NQ; ++q) {
            const uint8x16_t u = operand(qb, h, J, q0 + q);
            for (int r = 0; r < MR; ++r) s[r][q] = dot<J>(s[r][q], u, xv[r][h]);
        }
    }

    // Features 4*q0 .. 4*(q0 + NQ) - 1 of the panel against MR rows.
    template <int MR, int NQ>
    static void part(const QuantRows &x, const QuantPanel &w, float *acc, int q0) {
        float32x4_t a[MR][NQ];
        for (int r = 0; r < MR; ++r)
            for (int q = 0; q < NQ; ++q) a[r][q] = vdupq_n_f32(0.0f);
        int64_t g = 0, in_group = 0;
        for (int64_t b = 0; b < w.blocks; ++b) {
            const uint8_t *qb = w.qs + b * block_bytes(Bits);
            // Few rows (decode) stream the weight from memory: fetch every line of the block 8 blocks ahead.
            if constexpr (MR <= 2) {
                for (int64_t l = 0; l < block_bytes(Bits); l += 64) __builtin_prefetch(qb + 8 * block_bytes(Bits) + l);
            }
            int8x16_t xv[MR][2];
            for (int r = 0; r < MR; ++r) {
                const int8_t *xq = x.q + r * x.q_stride + b * kBlock;
                xv[r][0] = vld1q_s8(xq);
                xv[r][1] = vld1q_s8(xq + 16);
            }
            int32x4_t s[MR][NQ];
            for (int h = 0; h < 2; ++h) {
                if (h == 0 || G16) {
                    for (int r = 0; r < MR; ++r) {
                        const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
                        const int32_t bias = kBias ? 128 * (G16 ? s16[h] : s16[0] + s16[1]) : 0;
                        for (int q = 0; q < NQ; ++q) s[r][q] = vdupq_n_s32(bias);
                    }
                }
                step<MR, NQ, 0>(qb, h, q0, xv, s);
                step<MR, NQ, 1>(qb, h, q0, xv, s);
                step<MR, NQ, 2>(qb, h, q0, xv, s);
                step<MR, NQ, 3>(qb, h, q0, xv, s);
                if (!G16 && h == 0) continue;  // one epilogue per block: both halves in one sum
                const int64_t gg = G16 ? 2 * b + h : g;
                for (int q = 0; q < NQ; ++q) {
                    const int64_t at = gg * kLanes + 4 * (q0 + q);
                    const float32x4_t d = half4(w.d + at);
                    if constexpr (Min) {
                        const float32x4_t m = half4(w.m + at);
                        for (int r = 0; r < MR; ++r) {
                            const float32x4_t ddx = vmulq_n_f32(d, x.dx[r * x.b_stride + b]);
                            a[r][q] = vfmaq_f32(a[r][q], vcvtq_f32_s32(s[r][q]), ddx);
                            a[r][q] = vfmaq_n_f32(a[r][q], m, x.sx[r * x.b_stride + b]);
                        }
                    } else {
                        const int32x4_t z = zero_points4(w.z + at);
                        for (int r = 0; r < MR; ++r) {
                            const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
                            const int32_t sum = G16 ? s16[h] : s16[0] + s16[1];
                            const float32x4_t ddx = vmulq_n_f32(d, x.dx[r * x.b_stride + b]);
                            a[r][q] = vfmaq_f32(a[r][q], vcvtq_f32_s32(vmlsq_n_s32(s[r][q], z, sum)), ddx);
                        }
                    }
                }
            }
            if (!G16 && ++in_group == w.bpg) in_group = 0, ++g;
        }
        for (int r = 0; r < MR; ++r)
            for (int q = 0; q < NQ; ++q) vst1q_f32(acc + r * kLanes + 4 * (q0 + q), a[r][q]);
    }

    // 4 f16 -> f32 (exact).
    static float32x4_t half4(const f16_t *p) {
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t *>(p))));
    }
    // 4 u8 -> int32.
    static int32x4_t zero_points4(const uint8_t *p) {
        uint32_t v;
        __builtin_memcpy(&v, p, 4);
        const uint16x8_t z = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(v)));
        return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(z)));
    }

    template <int MR>
    static void tile(const QuantRows &x, const QuantPanel &w, float *acc) {
        if constexpr (MR <= 2) {
            part<MR, 4>(x, w, acc, 0);
        } else {
            part<MR, 2>(x, w, acc, 0);
            part<MR, 2>(x, w, acc, 2);
        }
    }

    static void run(int mr, const QuantRows &x, const QuantPanel &w, float *acc) {
        switch (mr) {
            case 1: tile<1>(x, w, acc); break;
            case 2: tile<2>(x, w, acc); break;
            case 3: tile<3>(x, w, acc); break;
            case 4: tile<4>(x, w, acc); break;
            default: break;
        }
    }
};

// This build's tile (common/quant_tile.h).
template <>
struct TileSelect<void> {
    template <int Bits, bool Min, bool G16>
    using Tile = NeonQuantTile<Bits, Min, G16>;
};

}  // namespace cpuinfer::quant
#endif
