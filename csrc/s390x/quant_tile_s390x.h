// IBM Z (z14 VXE and later) specialisation of the quantized linear tile (see
// common/quant_tile.h).
//
// A panel's 16 features are four 4-lane int32 registers ("quads"). The
// vector facility has no dot-product instruction and no mixed-sign multiply,
// so weights enter as signed bytes: 4-bit values (0..15) as they are, 8-bit
// values as u - 128 (XOR of the top bit) with the sum started at
// 128 * sum(x). For 4 consecutive k of a quad against 4 bytes of x
// (replicated by one load, VLREP):
//   VMEB / VMAOB   even and odd byte products, added: 16-bit pair sums
//   VMAEH / VMAOH  pair sums times 1 into the int32 lanes
// Every partial sum is exact: an 8-bit pair is at most 2 * 128 * 127 = 32512.
// A 4-bit pair is at most 2 * 15 * 127 = 3810, so 4-bit sums stay in 16 bits
// for a whole block (8 pairs, 30480) and widen once.
// The f32 epilogue is the portable tile's step by step (VFMASB is fused like
// std::fma), so every variant produces the same bits. z14 has no vector f16
// conversion (exact integer steps here instead of the scalar routine) and no
// int32 -> f32 conversion (z15's VCEFB): sums here are below 2^22 in
// magnitude (|u - z| <= 255, |x| <= 127, 32 terms), so adding them to the
// bits of 1.5 * 2^23 and subtracting 1.5 * 2^23 converts exactly.
//
// Registers (32 of 128 bits): one or two rows keep all 16 features; three or
// four rows run the panel as two halves of 8 features (as the NEON tile).
#pragma once
#if defined(__VEC__) && defined(__ARCH__) && __ARCH__ >= 12
#include <vecintrin.h>

#include <cstring>

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

template <int Bits, bool Min, bool G16>
struct VxeQuantTile {
    static_assert(!(Min && G16), "group 16 comes with zero points only (Q6_K)");
    static constexpr const char *kName = "vxe";
    static constexpr int kMaxRows = 4;

    // Quad q (features 4q..4q+3) of the values for k = 16h + 4j .. +3, as signed bytes.
    static vxe::i8x16 operand(const uint8_t *qb, int h, int j, int q) {
        if constexpr (Bits == 8) {
            return (vxe::i8x16)(vec_xl(64 * (4 * h + j) + 16 * q, qb) ^ (unsigned char)0x80);
        } else {
            const vxe::u8x16 v = vec_xl(64 * j + 16 * q, qb);
            return (vxe::i8x16)(h ? v >> 4 : v & (unsigned char)15);
        }
    }

    // Features 4*q0 .. 4*(q0 + NQ) - 1 of the panel against MR rows.
    template <int MR, int NQ>
    static void part(const QuantRows &x, const QuantPanel &w, float *acc, int q0) {
        using namespace vxe;
        f32x4 a[MR][NQ];
        for (int r = 0; r < MR; ++r)
            for (int q = 0; q < NQ; ++q) a[r][q] = vec_splats(0.0f);
        int64_t g = 0, in_group = 0;
        for (int64_t b = 0; b < w.blocks; ++b) {
            const uint8_t *qb = w.qs + b * block_bytes(Bits);
            // Few rows (decode) stream the weight from memory: fetch every line of the block 8 blocks ahead.
            if constexpr (MR <= 2) {
                for (int64_t l = 0; l < block_bytes(Bits); l += 256) __builtin_prefetch(qb + 8 * block_bytes(Bits) + l);
            }
            // 8-bit: int32 sums, started at 128 * sum(x). 4-bit: 16-bit pair sums, widened at the epilogue.
            i32x4 s[MR][NQ];
            i16x8 p[MR][NQ];
            for (int h = 0; h < 2; ++h) {
                if (h == 0 || G16) {
                    for (int r = 0; r < MR; ++r) {
                        const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
                        const int32_t bias = Bits == 8 ? 128 * (G16 ? s16[h] : s16[0] + s16[1]) : 0;
                        for (int q = 0; q < NQ; ++q) s[r][q] = vec_splats(bias), p[r][q] = vec_splats((short)0);
                    }
                }
                for (int j = 0; j < 4; ++j) {
                    i8x16 xb[MR];
                    for (int r = 0; r < MR; ++r) xb[r] = splat4(x.q + r * x.q_stride + b * kBlock + 16 * h + 4 * j);
                    for (int q = 0; q < NQ; ++q) {
                        const i8x16 u = operand(qb, h, j, q0 + q);
                        for (int r = 0; r < MR; ++r) {
                            if constexpr (Bits == 8) s[r][q] = widen(s[r][q], pairs(vec_splats((short)0), u, xb[r]));
                            else p[r][q] = pairs(p[r][q], u, xb[r]);
                        }
                    }
                }
                if (!G16 && h == 0) continue;  // one epilogue per block: both halves in one sum
                const int64_t gg = G16 ? 2 * b + h : g;
                for (int q = 0; q < NQ; ++q) {
                    const int64_t at = gg * kLanes + 4 * (q0 + q);
                    const f32x4 d = half4(w.d + at);
                    for (int r = 0; r < MR; ++r) {
                        const i32x4 sum4 = Bits == 8 ? s[r][q] : widen(s[r][q], p[r][q]);
                        const f32x4 ddx = d * vec_splats(x.dx[r * x.b_stride + b]);
                        if constexpr (Min) {
                            a[r][q] = vec_madd(to_float(sum4), ddx, a[r][q]);
                            a[r][q] = vec_madd(half4(w.m + at), vec_splats(x.sx[r * x.b_stride + b]), a[r][q]);
                        } else {
                            const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
                            const int32_t sum = G16 ? s16[h] : s16[0] + s16[1];
                            a[r][q] = vec_madd(to_float(sum4 - bytes4(w.z + at) * vec_splats(sum)), ddx, a[r][q]);
                        }
                    }
                }
            }
            if (!G16 && ++in_group == w.bpg) in_group = 0, ++g;
        }
        for (int r = 0; r < MR; ++r)
            for (int q = 0; q < NQ; ++q) vec_xst(a[r][q], 0, acc + r * kLanes + 4 * (q0 + q));
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
    using Tile = VxeQuantTile<Bits, Min, G16>;
};

}  // namespace cpuinfer::quant
#endif
