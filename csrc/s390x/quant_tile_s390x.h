// IBM Z (z14 VXE and later) specialisation of the quantized linear tile (see
// common/quant_tile.h).
//
// A panel's 16 features are four 4-lane int32 registers ("quads"). The
// vector facility has no dot-product instruction and no mixed-sign multiply,
// so weights enter as signed bytes: 4- to 6-bit values (0..63) as they are, 8-bit
// values as u - 128 (XOR of the top bit) with the sum started at
// 128 * sum(x). For 4 consecutive k of a quad against 4 bytes of x
// (replicated by one load, VLREP):
//   VMEB / VMAOB   even and odd byte products, added: 16-bit pair sums
//   VMAEH / VMAOH  pair sums times 1 into the int32 lanes
// Every partial sum is exact: an 8-bit pair is at most 2 * 128 * 127 = 32512.
// A 4-bit pair is at most 2 * 15 * 127 = 3810, so 4-bit sums stay in 16 bits
// for a whole block (8 pairs, 30480) and widen once; 5- and 6-bit pairs
// widen every step, as 8-bit ones do.
// The f32 epilogue is the portable tile's step by step (VFMASB is fused like
// std::fma), so every variant produces the same bits. z14 has no vector f16
// conversion (exact integer steps here instead of the scalar routine) and no
// int32 -> f32 conversion (z15's VCEFB): sums here are below 2^22 in
// magnitude (|u - z| <= 255, |x| <= 127, 32 terms), so adding them to the
// bits of 1.5 * 2^23 and subtracting 1.5 * 2^23 converts exactly.
//
// Registers (32 of 128 bits): per row and quad an f32 accumulator and a sum.
// One row takes all 16 features in one pass over K, two rows 8 features per
// pass, three or four rows 4 (the largest parts GCC keeps in registers,
// read from its code); every pass shares its weight operands by all rows.
#pragma once
#if defined(__VEC__) && defined(__ARCH__) && __ARCH__ >= 12
#include <vecintrin.h>

#include <cstring>
#include <type_traits>

// The tile's loops run over template constants (rows, quads), fully unrolled so
// that their arrays of registers can live in registers.
#define CPUINFER_QUANT_UNROLL _Pragma("GCC unroll 16")
#define CPUINFER_QUANT_INLINE [[gnu::always_inline]] inline

namespace cpuinfer::quant {

namespace vxe {
typedef __vector signed char i8x16;
typedef __vector unsigned char u8x16;
typedef __vector signed short i16x8;
typedef __vector unsigned short u16x8;
typedef __vector signed int i32x4;
typedef __vector unsigned int u32x4;
typedef __vector unsigned long long u64x2;
typedef __vector float f32x4;

// 4 f16 -> f32, exact (subnormals, infinities and NaN as half_bits_to_f32).
inline f32x4 half4(const f16_t *p) {
    unsigned long long v;
    std::memcpy(&v, p, 8);
    const u32x4 h = vec_unpackh((u16x8)vec_splats(v));
    const u32x4 em = h & 0x7fffu, sign = (h & 0x8000u) << 16, bits = em << 13;
    // Normal and subnormal halves: the bits as a float, scaled by 2^112 (exact).
    const u32x4 scaled = (u32x4)((f32x4)bits * vec_splats(0x1p112f));
    const u32x4 special = bits | 0x7f800000u;  // infinity / NaN
    return (f32x4)(vec_sel(scaled, special, vec_cmpge(em, vec_splats(0x7c00u))) | sign);
}
// 4 u8 -> int32.
inline i32x4 bytes4(const uint8_t *p) {
    unsigned int v;
    std::memcpy(&v, p, 4);
    return (i32x4)vec_unpackh(vec_unpackh((u8x16)vec_splats(v)));
}
// 4 bytes of x in every 32-bit lane.
inline i8x16 splat4(const int8_t *p) {
    int v;
    std::memcpy(&v, p, 4);
    return (i8x16)vec_splats(v);
}
// float(s) for |s| < 2^22 (see the header comment).
inline f32x4 to_float(i32x4 s) {
#if __ARCH__ >= 13
    return __builtin_convertvector(s, f32x4);
#else
    return (f32x4)((u32x4)s + 0x4b400000u) - vec_splats(12582912.0f);
#endif
}
// Even and odd byte products added into 16-bit pair sums: p + u[2i] x[2i] + u[2i+1] x[2i+1].
inline i16x8 pairs(i16x8 p, i8x16 u, i8x16 x) { return vec_moadd(u, x, vec_meadd(u, x, p)); }
// s + the 4-byte sums (two pairs per 32-bit lane).
inline i32x4 widen(i32x4 s, i16x8 p) {
    const i16x8 one = vec_splats((short)1);
    return vec_moadd(p, one, vec_meadd(p, one, s));
}
}  // namespace vxe

template <int Bits, bool Min, bool G16, bool Fp4 = false>
struct VxeQuantTile : UnrolledRows<VxeQuantTile<Bits, Min, G16, Fp4>, 4> {
    static_assert(!(Min && G16), "group 16 comes with zero points only (Q6_K)");
    static_assert(!Fp4 || (Bits == 4 && !Min && !G16), "MXFP4 is 4-bit codes in groups of 32");
    static constexpr const char *kName = "vxe";
    // A running sum of one row and quad: 16-bit pair sums widened at the epilogue (4-bit: a block's 8 pairs
    // stay below 2^15), else int32 (a 5-bit block's 8 pairs could reach 2 * 8 * 31 * 127; MXFP4's u of up
    // to 24, 2 * 8 * 24 * 127).
    static constexpr bool kShortSums = Bits == 4 && !Fp4;
    using Sum = std::conditional_t<kShortSums, vxe::i16x8, vxe::i32x4>;

    // Quad q (features 4q..4q+3) of the values for k = 16H + 4J .. +3, as signed bytes (5- and 6-bit values:
    // the nibble with its high bits from the block's plane, quant_tile.h).
    template <int H, int J>
    CPUINFER_QUANT_INLINE static vxe::i8x16 operand(const uint8_t *qb, int q) {
        if constexpr (Bits == 8) {
            return (vxe::i8x16)(vec_xl(64 * (4 * H + J) + 16 * q, qb) ^ (unsigned char)0x80);
        } else {
            const vxe::u8x16 v = vec_xl(64 * J + 16 * q, qb);
            vxe::u8x16 u = H ? v >> 4 : v & (unsigned char)15;
            if constexpr (Fp4) {  // MXFP4 codes -> u (quant_tile.h's kFp4U): VPERM indexes the table's 16 bytes
                vxe::u8x16 t;  // (copied: GCC 12 has an internal error on vec_xl of the constexpr table)
                std::memcpy(&t, kFp4U, sizeof t);
                u = vec_perm(t, t, u);
            }
            if constexpr (Bits > 4) {
                constexpr int kUp = 4 - plane_bit<Bits>(H, J);
                const vxe::u8x16 p = vec_xl(plane_offset<Bits>(H) + 16 * q, qb);
                const vxe::u8x16 moved = kUp > 0 ? p << (kUp > 0 ? kUp : 0) : p >> (kUp < 0 ? -kUp : 0);
                u = u | (moved & (unsigned char)plane_mask<Bits>());
            }
            return (vxe::i8x16)u;
        }
    }
    CPUINFER_QUANT_INLINE static Sum add(Sum s, vxe::i8x16 u, vxe::i8x16 x) {
        if constexpr (kShortSums) return vxe::pairs(s, u, x);
        else return vxe::widen(s, vxe::pairs(vec_splats((short)0), u, x));
    }
    CPUINFER_QUANT_INLINE static vxe::i32x4 total(Sum s) {
        if constexpr (kShortSums) return vxe::widen(vec_splats(0), s);
        else return s;
    }

    // The sums' start for half H of block b (both halves without G16): 8-bit values are u - 128.
    template <int MR, int NQ, int H>
    CPUINFER_QUANT_INLINE static void start(const QuantRows &x, int64_t b, Sum (&s)[MR][NQ]) {
        CPUINFER_QUANT_UNROLL
        for (int r = 0; r < MR; ++r) {
            const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
            Sum v;
            if constexpr (Bits == 8) v = vec_splats(128 * (G16 ? s16[H] : s16[0] + s16[1]));
            else if constexpr (kShortSums) v = vec_splats((short)0);
            else v = vec_splats(0);
            CPUINFER_QUANT_UNROLL
            for (int q = 0; q < NQ; ++q) s[r][q] = v;
        }
    }

    // s[r][q] += the quads' values of k = 16H + 4J .. +3 against row r's x.
    template <int MR, int NQ, int Q0, int H, int J>
    CPUINFER_QUANT_INLINE static void step(const QuantRows &x, int64_t b, const uint8_t *qb, Sum (&s)[MR][NQ]) {
        vxe::i8x16 xb[MR];
        CPUINFER_QUANT_UNROLL
        for (int r = 0; r < MR; ++r) xb[r] = vxe::splat4(x.q + r * x.q_stride + b * kBlock + 16 * H + 4 * J);
        CPUINFER_QUANT_UNROLL
        for (int q = 0; q < NQ; ++q) {
            const vxe::i8x16 u = operand<H, J>(qb, Q0 + q);
            CPUINFER_QUANT_UNROLL
            for (int r = 0; r < MR; ++r) s[r][q] = add(s[r][q], u, xb[r]);
        }
    }

    template <int MR, int NQ, int Q0, int H>
    CPUINFER_QUANT_INLINE static void half_block(const QuantRows &x, int64_t b, const uint8_t *qb, Sum (&s)[MR][NQ]) {
        step<MR, NQ, Q0, H, 0>(x, b, qb, s);
        step<MR, NQ, Q0, H, 1>(x, b, qb, s);
        step<MR, NQ, Q0, H, 2>(x, b, qb, s);
        step<MR, NQ, Q0, H, 3>(x, b, qb, s);
    }

    // The f32 steps for group gg (quant_tile.h's order), after half H of block b.
    template <int MR, int NQ, int Q0, int H>
    CPUINFER_QUANT_INLINE static void epilogue(const QuantRows &x, const QuantPanel &w, int64_t b, int64_t gg,
                                               const Sum (&s)[MR][NQ], vxe::f32x4 (&a)[MR][NQ]) {
        using namespace vxe;
        CPUINFER_QUANT_UNROLL
        for (int q = 0; q < NQ; ++q) {
            const int64_t at = gg * kLanes + 4 * (Q0 + q);
            const f32x4 d = Fp4 ? (f32x4)((bytes4(w.z + at) - 1) << 23) : half4(w.d + at);  // MXFP4: fp4_scale
            if constexpr (Min) {
                const f32x4 m = half4(w.m + at);
                CPUINFER_QUANT_UNROLL
                for (int r = 0; r < MR; ++r) {
                    const f32x4 ddx = d * vec_splats(x.dx[r * x.b_stride + b]);
                    a[r][q] = vec_madd(to_float(total(s[r][q])), ddx, a[r][q]);
                    a[r][q] = vec_madd(m, vec_splats(x.sx[r * x.b_stride + b]), a[r][q]);
                }
            } else {
                const i32x4 z = Fp4 ? vec_splats(kFp4Zero) : bytes4(w.z + at);
                CPUINFER_QUANT_UNROLL
                for (int r = 0; r < MR; ++r) {
                    const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
                    const int32_t sum = G16 ? s16[H] : s16[0] + s16[1];
                    const f32x4 ddx = d * vec_splats(x.dx[r * x.b_stride + b]);
                    a[r][q] = vec_madd(to_float(total(s[r][q]) - z * vec_splats(sum)), ddx, a[r][q]);
                }
            }
        }
    }

    // Features 4*Q0 .. 4*(Q0 + NQ) - 1 of the panel against MR rows.
    template <int MR, int NQ, int Q0>
    static void part(const QuantRows &x, const QuantPanel &w, float *acc) {
        vxe::f32x4 a[MR][NQ];
        CPUINFER_QUANT_UNROLL
        for (int r = 0; r < MR; ++r) {
            CPUINFER_QUANT_UNROLL
            for (int q = 0; q < NQ; ++q) a[r][q] = vec_splats(0.0f);
        }
        int64_t g = 0, in_group = 0;
        for (int64_t b = 0; b < w.blocks; ++b) {
            const uint8_t *qb = w.qs + b * block_bytes(Bits);
            // Few rows (decode) stream the weight from memory: fetch every line of the block 8 blocks ahead.
            if constexpr (MR <= 2) {
                for (int64_t l = 0; l < block_bytes(Bits); l += 256) __builtin_prefetch(qb + 8 * block_bytes(Bits) + l);
            }
            Sum s[MR][NQ];
            start<MR, NQ, 0>(x, b, s);
            half_block<MR, NQ, Q0, 0>(x, b, qb, s);
            if constexpr (G16) {  // one group per half
                epilogue<MR, NQ, Q0, 0>(x, w, b, 2 * b, s, a);
                start<MR, NQ, 1>(x, b, s);
                half_block<MR, NQ, Q0, 1>(x, b, qb, s);
                epilogue<MR, NQ, Q0, 1>(x, w, b, 2 * b + 1, s, a);
            } else {  // both halves in one sum (4-bit: 8 pairs of at most 1905 per 16-bit lane)
                half_block<MR, NQ, Q0, 1>(x, b, qb, s);
                epilogue<MR, NQ, Q0, 1>(x, w, b, g, s, a);
                if (++in_group == w.bpg) in_group = 0, ++g;
            }
        }
        CPUINFER_QUANT_UNROLL
        for (int r = 0; r < MR; ++r) {
            CPUINFER_QUANT_UNROLL
            for (int q = 0; q < NQ; ++q) vec_xst(a[r][q], 0, acc + r * kLanes + 4 * (Q0 + q));
        }
    }

    // The panel as parts of NQ quads from quad Q0 on.
    template <int MR, int NQ, int Q0 = 0>
    static void parts(const QuantRows &x, const QuantPanel &w, float *acc) {
        part<MR, NQ, Q0>(x, w, acc);
        if constexpr (Q0 + NQ < 4) parts<MR, NQ, Q0 + NQ>(x, w, acc);
    }

    // Quads per part for MR rows: the most whose sums and accumulators GCC keeps in the 32 registers
    // without spilling in the loop (read from the generated code).
    template <int MR>
    static void tile(const QuantRows &x, const QuantPanel &w, float *acc) {
        parts<MR, MR == 1 ? 4 : MR == 2 ? 2 : 1>(x, w, acc);
    }
};

// This build's tile (common/quant_tile.h).
template <>
struct TileSelect<void> {
    template <int Bits, bool Min, bool G16, bool Fp4 = false>
    using Tile = VxeQuantTile<Bits, Min, G16, Fp4>;
};

}  // namespace cpuinfer::quant
#undef CPUINFER_QUANT_UNROLL
#undef CPUINFER_QUANT_INLINE
#endif
