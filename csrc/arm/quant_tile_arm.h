// Arm NEON specialisation of the quantized linear tile (see common/quant_tile.h).
//
// A panel's 16 features are four int32x4 registers ("quads" of 4 features).
// Each 64-byte operand holds 4 consecutive k of every feature, so its 16
// bytes of one quad against 4 bytes of x is one dot-product instruction,
// the x bytes taken by lane from a register holding a 16-k half of the row:
// - i8mm (neon_bf16, apple_m2): USDOT, u8 weights times s8 x, as they are.
// - dotprod only (neon, apple_m1): SDOT (both signed). 4- to 6-bit values
//   (0..63) are already valid int8. 8-bit values enter as u - 128 (one EOR of the
//   top bit, shared by the tile's rows) and the accumulator starts at
//   128 * sum(x), which the activation rows carry: the same exact int32.
// The f32 epilogue is the portable tile's, step by step (FMLA is fused like
// std::fma), so every variant produces the same bits.
//
// Registers (32 of 128 bits): per row 4 f32 and 4 int32 accumulators plus 2 x
// registers for all 16 features. One or two rows take all 16 features in one
// pass over K; three or four rows run the panel as two passes of 8 features,
// so that their accumulators fit, and each pass's weight operands (and their
// nibble split / EOR) are shared by all its rows. (GCC 12 still keeps a few
// accumulators in L1 at two to four rows: one load and store per block each.)
#pragma once
#if defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>

// The tile's loops run over template constants (rows, quads), fully unrolled so
// that their arrays of registers can live in registers.
#define CPUINFER_QUANT_UNROLL _Pragma("GCC unroll 16")
#define CPUINFER_QUANT_INLINE [[gnu::always_inline]] inline

namespace cpuinfer::quant {

template <int Bits, bool Min, bool G16, bool Fp4 = false>
struct NeonQuantTile : UnrolledRows<NeonQuantTile<Bits, Min, G16, Fp4>, 4> {
    static_assert(!(Min && G16), "group 16 comes with zero points only (Q6_K)");
    static_assert(!Fp4 || (Bits == 4 && !Min && !G16), "MXFP4 is 4-bit codes in groups of 32");
#if defined(__ARM_FEATURE_MATMUL_INT8)
    static constexpr const char *kName = "neon_i8mm";
    static constexpr bool kUnsignedDot = true;
#else
    static constexpr const char *kName = "neon_dotprod";
    static constexpr bool kUnsignedDot = false;
#endif
    // 8-bit values through SDOT are u - 128: each half's sum is short by 128 * sum(x).
    static constexpr bool kBias = Bits == 8 && !kUnsignedDot;

    // Quad q (features 4q..4q+3) of the values for k = 16H + 4J .. +3, as the dot product takes them
    // (5- and 6-bit values: the nibble with its high bits from the block's plane, quant_tile.h).
    template <int H, int J>
    CPUINFER_QUANT_INLINE static uint8x16_t operand(const uint8_t *qb, int q) {
        if constexpr (Bits == 8) {
            const uint8x16_t v = vld1q_u8(qb + 64 * (4 * H + J) + 16 * q);
            return kBias ? veorq_u8(v, vdupq_n_u8(0x80)) : v;
        } else {
            const uint8x16_t v = vld1q_u8(qb + 64 * J + 16 * q);
            const uint8x16_t nib = H ? vshrq_n_u8(v, 4) : vandq_u8(v, vdupq_n_u8(15));
            if constexpr (Fp4) {  // MXFP4 codes -> u (quant_tile.h's kFp4U): one table lookup
                return vqtbl1q_u8(vld1q_u8(kFp4U), nib);
            } else if constexpr (Bits == 4) {
                return nib;
            } else {
                constexpr int kUp = 4 - plane_bit<Bits>(H, J);
                const uint8x16_t p = vld1q_u8(qb + plane_offset<Bits>(H) + 16 * q);
                uint8x16_t moved = p;
                if constexpr (kUp > 0) moved = vshlq_n_u8(p, kUp > 0 ? kUp : 1);
                else if constexpr (kUp < 0) moved = vshrq_n_u8(p, kUp < 0 ? -kUp : 1);
                return vorrq_u8(nib, vandq_u8(moved, vdupq_n_u8(plane_mask<Bits>())));
            }
        }
    }

    template <int J>
    CPUINFER_QUANT_INLINE static int32x4_t dot(int32x4_t s, uint8x16_t u, int8x16_t x) {
#if defined(__ARM_FEATURE_MATMUL_INT8)
        return vusdotq_laneq_s32(s, u, x, J);
#else
        return vdotq_laneq_s32(s, vreinterpretq_s8_u8(u), x, J);
#endif
    }

    // The int32 sums' start for half H of block b (both halves without G16).
    template <int MR, int NQ, int H>
    CPUINFER_QUANT_INLINE static void start(const QuantRows &x, int64_t b, int32x4_t (&s)[MR][NQ]) {
        CPUINFER_QUANT_UNROLL
        for (int r = 0; r < MR; ++r) {
            const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
            const int32x4_t v = vdupq_n_s32(kBias ? 128 * (G16 ? s16[H] : s16[0] + s16[1]) : 0);
            CPUINFER_QUANT_UNROLL
            for (int q = 0; q < NQ; ++q) s[r][q] = v;
        }
    }

    // s[r][q] += the quads' values of k = 16H + 4J .. +3 against row r's x.
    template <int MR, int NQ, int Q0, int H, int J>
    CPUINFER_QUANT_INLINE static void step(const uint8_t *qb, const int8x16_t (&xv)[MR][2], int32x4_t (&s)[MR][NQ]) {
        CPUINFER_QUANT_UNROLL
        for (int q = 0; q < NQ; ++q) {
            const uint8x16_t u = operand<H, J>(qb, Q0 + q);
            CPUINFER_QUANT_UNROLL
            for (int r = 0; r < MR; ++r) s[r][q] = dot<J>(s[r][q], u, xv[r][H]);
        }
    }

    template <int MR, int NQ, int Q0, int H>
    CPUINFER_QUANT_INLINE static void half_block(const uint8_t *qb, const int8x16_t (&xv)[MR][2], int32x4_t (&s)[MR][NQ]) {
        step<MR, NQ, Q0, H, 0>(qb, xv, s);
        step<MR, NQ, Q0, H, 1>(qb, xv, s);
        step<MR, NQ, Q0, H, 2>(qb, xv, s);
        step<MR, NQ, Q0, H, 3>(qb, xv, s);
    }

    // The f32 steps for group gg (quant_tile.h's order), after half H of block b.
    template <int MR, int NQ, int Q0, int H>
    CPUINFER_QUANT_INLINE static void epilogue(const QuantRows &x, const QuantPanel &w, int64_t b, int64_t gg,
                         const int32x4_t (&s)[MR][NQ], float32x4_t (&a)[MR][NQ]) {
        CPUINFER_QUANT_UNROLL
        for (int q = 0; q < NQ; ++q) {
            const int64_t at = gg * kLanes + 4 * (Q0 + q);
            const float32x4_t d = Fp4 ? pow2_4(w.z + at) : half4(w.d + at);
            if constexpr (Min) {
                const float32x4_t m = half4(w.m + at);
                CPUINFER_QUANT_UNROLL
                for (int r = 0; r < MR; ++r) {
                    const float32x4_t ddx = vmulq_n_f32(d, x.dx[r * x.b_stride + b]);
                    a[r][q] = vfmaq_f32(a[r][q], vcvtq_f32_s32(s[r][q]), ddx);
                    a[r][q] = vfmaq_n_f32(a[r][q], m, x.sx[r * x.b_stride + b]);
                }
            } else {
                const int32x4_t z = Fp4 ? vdupq_n_s32(kFp4Zero) : zero_points4(w.z + at);
                CPUINFER_QUANT_UNROLL
                for (int r = 0; r < MR; ++r) {
                    const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
                    const int32_t sum = G16 ? s16[H] : s16[0] + s16[1];
                    const float32x4_t ddx = vmulq_n_f32(d, x.dx[r * x.b_stride + b]);
                    a[r][q] = vfmaq_f32(a[r][q], vcvtq_f32_s32(vmlsq_n_s32(s[r][q], z, sum)), ddx);
                }
            }
        }
    }

    // Features 4*Q0 .. 4*(Q0 + NQ) - 1 of the panel against MR rows. (Q0 a constant: every
    // operand is then at a fixed offset from the block's start.)
    template <int MR, int NQ, int Q0>
    static void part(const QuantRows &x, const QuantPanel &w, float *acc) {
        float32x4_t a[MR][NQ];
        CPUINFER_QUANT_UNROLL
        for (int r = 0; r < MR; ++r) {
            CPUINFER_QUANT_UNROLL
            for (int q = 0; q < NQ; ++q) a[r][q] = vdupq_n_f32(0.0f);
        }
        int64_t g = 0, in_group = 0;
        for (int64_t b = 0; b < w.blocks; ++b) {
            const uint8_t *qb = w.qs + b * block_bytes(Bits);
            // Few rows (decode) stream the weight from memory: fetch every line of the block 8 blocks ahead.
            if constexpr (MR <= 2) {
                for (int64_t l = 0; l < block_bytes(Bits); l += 64) __builtin_prefetch(qb + 8 * block_bytes(Bits) + l);
            }
            int8x16_t xv[MR][2];
            CPUINFER_QUANT_UNROLL
            for (int r = 0; r < MR; ++r) {
                const int8_t *xq = x.q + r * x.q_stride + b * kBlock;
                xv[r][0] = vld1q_s8(xq);
                xv[r][1] = vld1q_s8(xq + 16);
            }
            int32x4_t s[MR][NQ];
            start<MR, NQ, 0>(x, b, s);
            half_block<MR, NQ, Q0, 0>(qb, xv, s);
            if constexpr (G16) {  // one group per half
                epilogue<MR, NQ, Q0, 0>(x, w, b, 2 * b, s, a);
                start<MR, NQ, 1>(x, b, s);
                half_block<MR, NQ, Q0, 1>(qb, xv, s);
                epilogue<MR, NQ, Q0, 1>(x, w, b, 2 * b + 1, s, a);
            } else {  // both halves in one sum
                half_block<MR, NQ, Q0, 1>(qb, xv, s);
                epilogue<MR, NQ, Q0, 1>(x, w, b, g, s, a);
                if (++in_group == w.bpg) in_group = 0, ++g;
            }
        }
        CPUINFER_QUANT_UNROLL
        for (int r = 0; r < MR; ++r) {
            CPUINFER_QUANT_UNROLL
            for (int q = 0; q < NQ; ++q) vst1q_f32(acc + r * kLanes + 4 * (Q0 + q), a[r][q]);
        }
    }

    // 4 f16 -> f32 (exact).
    CPUINFER_QUANT_INLINE static float32x4_t half4(const f16_t *p) {
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t *>(p))));
    }
    // 4 E8M0 bytes -> their f32 2^(e - 128) (quant_tile.h's fp4_scale).
    CPUINFER_QUANT_INLINE static float32x4_t pow2_4(const uint8_t *p) {
        return vreinterpretq_f32_s32(vshlq_n_s32(vsubq_s32(zero_points4(p), vdupq_n_s32(1)), 23));
    }
    // 4 u8 -> int32.
    CPUINFER_QUANT_INLINE static int32x4_t zero_points4(const uint8_t *p) {
        uint32_t v;
        __builtin_memcpy(&v, p, 4);
        const uint16x8_t z = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(v)));
        return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(z)));
    }

    template <int MR>
    static void tile(const QuantRows &x, const QuantPanel &w, float *acc) {
        if constexpr (MR <= 2) {
            part<MR, 4, 0>(x, w, acc);
        } else {
            part<MR, 2, 0>(x, w, acc);
            part<MR, 2, 2>(x, w, acc);
        }
    }
};

// This build's tile (common/quant_tile.h).
template <>
struct TileSelect<void> {
    template <int Bits, bool Min, bool G16, bool Fp4 = false>
    using Tile = NeonQuantTile<Bits, Min, G16, Fp4>;
};

}  // namespace cpuinfer::quant
#undef CPUINFER_QUANT_UNROLL
#undef CPUINFER_QUANT_INLINE
#endif
