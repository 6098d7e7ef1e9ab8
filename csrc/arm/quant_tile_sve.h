// SVE specialisation of the quantized linear tile (see common/quant_tile.h),
// vector-length agnostic.
//
// A 64-byte weight operand (4 k of the panel's 16 features) is taken in
// slices of S = min(VL, 64) bytes: 4 features per slice at 128 bits, 8 at
// 256, all 16 at 512. Wider vectors use their first 512 bits (predicated):
// filling them would put several k groups in one register, each needing its
// own x bytes and a reduction at the end, for hardware that does not exist.
// SDOT (indexed) picks its x lane within each 128-bit segment, so the row's
// 16-k half is replicated into every segment (LD1RQB) and each segment's 4
// features meet the same 4 x bytes at any VL.
//
// The sve variant has no i8mm (no USDOT): 4- to 6-bit values (0..63) are
// valid int8 as they are; 8-bit values enter as u - 128 (EOR of the top bit) and
// the sum starts at 128 * sum(x), as NEON's SDOT path does: the int32 sums
// are exact, and the f32 epilogue is the portable tile's step by step (FMLA
// is fused like std::fma), so every variant produces the same bits.
//
// SVE registers cannot be array elements, so rows are not register-blocked
// as on NEON: a slice's 8 weight operands of a block stay in registers,
// shared by every row, and a row's f32 accumulators live in acc (L1), read
// and written once per block. Any number of rows then fits the 32 registers.
#pragma once
#if defined(__ARM_FEATURE_SVE) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_sve.h>

namespace cpuinfer::quant {

template <int Bits, bool Min, bool G16, bool Fp4 = false>
struct SveQuantTile : TileDefaults {
    static_assert(!(Min && G16), "group 16 comes with zero points only (Q6_K)");
    static_assert(!Fp4 || (Bits == 4 && !Min && !G16), "MXFP4 is 4-bit codes in groups of 32");
    static constexpr const char *kName = "sve_dotprod";
    static constexpr int kMaxRows = 8;

    // n f16 -> f32 (exact), one per 32-bit lane.
    static svfloat32_t half(svbool_t pw, const f16_t *p) {
        const svuint32_t h = svld1uh_u32(pw, reinterpret_cast<const uint16_t *>(p));
        return svcvt_f32_f16_x(pw, svreinterpret_f16_u32(h));
    }
    static svint32_t zero_points(svbool_t pw, const uint8_t *p) {
        return svreinterpret_s32_u32(svld1ub_u32(pw, p));
    }
    // E8M0 bytes -> their f32 2^(e - 128) (quant_tile.h's fp4_scale).
    static svfloat32_t pow2(svbool_t pw, const uint8_t *p) {
        const svint32_t e = svsub_n_s32_x(pw, zero_points(pw, p), 1);
        return svreinterpret_f32_s32(svlsl_n_s32_x(pw, e, 23));
    }
    // The int32 start of a sum: 8-bit values through SDOT are u - 128, short by 128 * sum(x).
    static svint32_t start(int32_t sum_x) { return svdup_n_s32(Bits == 8 ? 128 * sum_x : 0); }
    // nib | the plane's bits from bit Low on, moved up to bit 4 (quant_tile.h).
    template <int Low>
    static svuint8_t with_high(svbool_t pb, svuint8_t nib, svuint8_t p) {
        svuint8_t moved = p;
        if constexpr (Low < 4) moved = svlsl_n_u8_x(pb, p, 4 - Low);
        else if constexpr (Low > 4) moved = svlsr_n_u8_x(pb, p, Low - 4);
        return svorr_u8_x(pb, nib, svand_n_u8_x(pb, moved, plane_mask<Bits>()));
    }
    static svint32_t dot4(svint32_t s, svint8_t u0, svint8_t u1, svint8_t u2, svint8_t u3, svint8_t x) {
        s = svdot_lane_s32(s, u0, x, 0);
        s = svdot_lane_s32(s, u1, x, 1);
        s = svdot_lane_s32(s, u2, x, 2);
        return svdot_lane_s32(s, u3, x, 3);
    }
    // a += float(s - z * sum_x) * (d * dx), or with minimums a += float(s) * (d * dx); a += m * sx.
    static svfloat32_t epilogue(svbool_t pw, svfloat32_t a, svint32_t s, svfloat32_t d, svint32_t z, svfloat32_t m,
                                int32_t sum_x, float dx, float sx) {
        const svfloat32_t ddx = svmul_n_f32_x(pw, d, dx);
        if constexpr (Min) {
            a = svmla_f32_x(pw, a, svcvt_f32_s32_x(pw, s), ddx);
            return svmla_n_f32_x(pw, a, m, sx);
        } else {
            return svmla_f32_x(pw, a, svcvt_f32_s32_x(pw, svmls_n_s32_x(pw, s, z, sum_x)), ddx);
        }
    }

    static void run(int mr, const QuantRows &x, const QuantPanel &w, float *acc) {
        // Slice bytes: a power of two (so slices tile the 64-byte operand) up to min(VL, 64).
        int64_t sw = 16;
        while (sw < 64 && 2 * sw <= int64_t(svcntb())) sw *= 2;
        const svbool_t pb = svwhilelt_b8(int64_t(0), sw), pw = svwhilelt_b32(int64_t(0), sw / 4);
        const svbool_t all = svptrue_b8();
        const svuint8_t top = svdup_n_u8(0x80);
        for (int i = 0; i < mr * kLanes; ++i) acc[i] = 0.0f;
        int64_t g = 0, in_group = 0;
        for (int64_t b = 0; b < w.blocks; ++b) {
            const uint8_t *qb = w.qs + b * block_bytes(Bits);
            // Few rows (decode) stream the weight from memory: fetch every line of the block 8 blocks ahead.
            if (mr <= 2) {
                for (int64_t l = 0; l < block_bytes(Bits); l += 64) __builtin_prefetch(qb + 8 * block_bytes(Bits) + l);
            }
            const int64_t g0 = G16 ? 2 * b : g;
            for (int64_t off = 0; off < 64; off += sw) {
                // The slice's operands: u0..u3 for k 0..15 of the block, u4..u7 for k 16..31.
                svint8_t u0, u1, u2, u3, u4, u5, u6, u7;
                if constexpr (Bits == 8) {
                    auto ld = [&](int c) { return svreinterpret_s8_u8(sveor_u8_x(pb, svld1_u8(pb, qb + 64 * c + off), top)); };
                    u0 = ld(0), u1 = ld(1), u2 = ld(2), u3 = ld(3), u4 = ld(4), u5 = ld(5), u6 = ld(6), u7 = ld(7);
                } else {
                    const svuint8_t r0 = svld1_u8(pb, qb + off), r1 = svld1_u8(pb, qb + 64 + off),
                                    r2 = svld1_u8(pb, qb + 128 + off), r3 = svld1_u8(pb, qb + 192 + off);
                    auto lo = [&](svuint8_t v) { return svand_n_u8_x(pb, v, 15); };
                    auto hi = [&](svuint8_t v) { return svlsr_n_u8_x(pb, v, 4); };
                    svuint8_t n0 = lo(r0), n1 = lo(r1), n2 = lo(r2), n3 = lo(r3), n4 = hi(r0), n5 = hi(r1), n6 = hi(r2),
                              n7 = hi(r3);
                    if constexpr (Bits > 4) {  // the high bits from the block's planes (quant_tile.h)
                        const svuint8_t p0 = svld1_u8(pb, qb + plane_offset<Bits>(0) + off),
                                        p1 = svld1_u8(pb, qb + plane_offset<Bits>(1) + off);
                        n0 = with_high<plane_bit<Bits>(0, 0)>(pb, n0, p0), n1 = with_high<plane_bit<Bits>(0, 1)>(pb, n1, p0);
                        n2 = with_high<plane_bit<Bits>(0, 2)>(pb, n2, p0), n3 = with_high<plane_bit<Bits>(0, 3)>(pb, n3, p0);
                        n4 = with_high<plane_bit<Bits>(1, 0)>(pb, n4, p1), n5 = with_high<plane_bit<Bits>(1, 1)>(pb, n5, p1);
                        n6 = with_high<plane_bit<Bits>(1, 2)>(pb, n6, p1), n7 = with_high<plane_bit<Bits>(1, 3)>(pb, n7, p1);
                    }
                    if constexpr (Fp4) {  // MXFP4 codes -> u (quant_tile.h's kFp4U): TBL within the first 16 bytes
                        const svuint8_t t = svld1rq_u8(all, kFp4U);
                        n0 = svtbl_u8(t, n0), n1 = svtbl_u8(t, n1), n2 = svtbl_u8(t, n2), n3 = svtbl_u8(t, n3);
                        n4 = svtbl_u8(t, n4), n5 = svtbl_u8(t, n5), n6 = svtbl_u8(t, n6), n7 = svtbl_u8(t, n7);
                    }
                    auto s8 = [](svuint8_t v) { return svreinterpret_s8_u8(v); };
                    u0 = s8(n0), u1 = s8(n1), u2 = s8(n2), u3 = s8(n3), u4 = s8(n4), u5 = s8(n5), u6 = s8(n6), u7 = s8(n7);
                }
                const int64_t at = g0 * kLanes + off / 4;
                const svfloat32_t d0 = Fp4 ? pow2(pw, w.z + at) : half(pw, w.d + at);
                const svfloat32_t d1 = G16 ? half(pw, w.d + at + kLanes) : d0;
                const svint32_t z0 = Fp4 ? svdup_n_s32(kFp4Zero) : Min ? svdup_n_s32(0) : zero_points(pw, w.z + at);
                const svint32_t z1 = G16 ? zero_points(pw, w.z + at + kLanes) : z0;
                const svfloat32_t m = Min ? half(pw, w.m + at) : svdup_n_f32(0.0f);
                for (int r = 0; r < mr; ++r) {
                    const int8_t *xq = x.q + r * x.q_stride + b * kBlock;
                    const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
                    const float dx = x.dx[r * x.b_stride + b], sx = Min ? x.sx[r * x.b_stride + b] : 0.0f;
                    const svint8_t xl = svld1rq_s8(all, xq), xh = svld1rq_s8(all, xq + 16);
                    float *ar = acc + r * kLanes + off / 4;
                    svfloat32_t a = svld1_f32(pw, ar);
                    if constexpr (G16) {
                        a = epilogue(pw, a, dot4(start(s16[0]), u0, u1, u2, u3, xl), d0, z0, m, s16[0], dx, sx);
                        a = epilogue(pw, a, dot4(start(s16[1]), u4, u5, u6, u7, xh), d1, z1, m, s16[1], dx, sx);
                    } else {
                        const int32_t sum = s16[0] + s16[1];
                        const svint32_t s = dot4(dot4(start(sum), u0, u1, u2, u3, xl), u4, u5, u6, u7, xh);
                        a = epilogue(pw, a, s, d0, z0, m, sum, dx, sx);
                    }
                    svst1_f32(pw, ar, a);
                }
            }
            if (!G16 && ++in_group == w.bpg) in_group = 0, ++g;
        }
    }
};

// This build's tile (common/quant_tile.h).
template <>
struct TileSelect<void> {
    template <int Bits, bool Min, bool G16, bool Fp4 = false>
    using Tile = SveQuantTile<Bits, Min, G16, Fp4>;
};

}  // namespace cpuinfer::quant
#endif
