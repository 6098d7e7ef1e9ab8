// The register tile of the quantized linear layer (linear_quant.cpp): MR rows
// of int8-quantized x against one panel (16 output features) of a quantized
// weight, over all of K.
//
// Weight panel (QuantMatrix in kernels.h): for every block of 32 k, the 16
// features' unsigned values u, 4 consecutive k of one feature in 4 bytes, the
// 16 features side by side (64 bytes per 4 k: the operand of one VPDPBUSD,
// whose 16 int32 lanes are the 16 features). Operand (h, j) holds
// k = 16h + 4j .. 16h + 4j + 3; its byte i = 4f + t is feature f's k = 16h + 4j + t.
// - 8-bit values: the 8 operands one after the other (512 bytes).
// - 4-bit values share bytes: byte (j, f, t) of a block holds operand
//   (0, j)'s value in its low nibble and operand (1, j)'s in its high nibble,
//   so one AND and one shift give two 64-byte operands (256 bytes).
// - 5- and 6-bit values: their low 4 bits as the 4-bit block, then their high
//   bits in 64-byte planes that line up with the operands byte for byte: 5-bit
//   operand (h, j) finds bit 4 of its values at bit 4h + j of plane 0; 6-bit
//   operand (h, j) finds bits 4-5 at bits 2j, 2j + 1 of plane h (320 and 384
//   bytes). A shift, an AND and an OR per operand rebuild the bytes, and the
//   block is bits / 8 of a byte per value, as in the file.
// Per group of `group` k and feature: a scale d (f16) and either a zero point
// z (u8: w = d * (u - z)) or a minimum m (f16: w = d * u + m).
// - MXFP4 (the Fp4 tiles; OCP microscaling FP4, gpt-oss's experts): 4-bit
//   E2M1 codes as the 4-bit block, and per group of 32 one E8M0 exponent
//   byte e in z, no d: 4.25 bits a weight, as the file has them. The tiles
//   map each code through kFp4U to u = 2 * value + 12 (0..24, one byte-shuffle
//   per operand) and run the zero-point form with z = 12 and d = 2^(e - 128),
//   an f32 made from e's bits (fp4_scale): the same integers and the same f32
//   steps as that form with an f16 d, so the same bits.
//
// x (QuantRows): each row quantized per block of 32 k to int8 with one f32
// scale dx = amax / 127 (as llama.cpp's q8 activations), plus the integer sum
// of each 16-k half (the zero-point correction) and dx * sum (the minimum
// term). The same quantization whatever M, so a row's result does not depend
// on its batch.
//
// Numerics, identical in every implementation of the tile (so every variant
// gives the same bits): per block, the integer dot products s of each half
// are exact; then, in this order, per group g covering the block,
//   zero point:  acc = fma(float(s - z * sum_x), d * dx, acc)
//   minimum:     acc = fma(float(s), d * dx, acc); acc = fma(m, dx * sum_x, acc)
// (group 16: one such step per half, else one per block).
//
// QuantTile<Bits, Min, G16> is the portable tile (plain loops the compiler
// vectorizes); a vector layer's quant hook may bring its own (kName says
// which): csrc/x86/quant_tile_x86.h (AMX-INT8 from 5 rows up, VPDPBUSD on
// AVX512-VNNI, VPMADDUBSW on AVX2), csrc/arm/quant_tile_arm.h (NEON USDOT
// with i8mm, else SDOT), csrc/arm/quant_tile_sve.h (SVE SDOT),
// csrc/s390x/quant_tile_s390x.h (VXE byte multiply-and-add).
// tests/cpp/test_quant.cpp holds each to the portable tile's bits.
// A tile may read up to kTileReadRows rows of x from where its call starts,
// whatever its row count: the x buffer is padded for that. TileDefaults
// gives a tile the driver's begin()/end() and kChunkBytes; UnrolledRows its
// run(mr) over a tile<MR> per row count.
#pragma once
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "dtype.h"

namespace cpuinfer::quant {

constexpr int kLanes = 16;  // output features per panel
constexpr int kBlock = 32;  // k per activation block
constexpr int kTileReadRows = 16;  // rows of x a tile call may read (see above)

// Bytes of one panel's block of 32 k.
constexpr int64_t block_bytes(int bits) { return int64_t(kLanes) * kBlock * bits / 8; }

// 5- and 6-bit blocks (see above): the nibble bytes, then the high-bit planes.
constexpr int kNibbleBytes = 256;
// Where operand (h, j)'s high bits are: its plane's offset in the block, their
// lowest bit in that plane's bytes, and the mask that keeps them once moved up
// to bit 4 (a left shift by 4 - plane_bit, or a right shift when negative).
template <int Bits>
constexpr int plane_offset(int h) { return kNibbleBytes + (Bits == 6 ? 64 * h : 0); }
template <int Bits>
constexpr int plane_bit(int h, int j) { return Bits == 5 ? 4 * h + j : 2 * j; }
template <int Bits>
constexpr uint8_t plane_mask() { return Bits == 5 ? 0x10 : 0x30; }
// Values below 2^6 are valid signed bytes and keep every dot product's pair
// sums within 16 bits (2 * 63 * 127); only 8-bit values need the tiles' care.
template <int Bits>
constexpr bool kNarrow = Bits < 8;

// MXFP4 (see above): u of each E2M1 code (sign in bit 3; twice the values 0, 0.5, 1, 1.5, 2, 3, 4, 6, plus 12).
constexpr int32_t kFp4Zero = 12;
alignas(16) inline constexpr uint8_t kFp4U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
// The f32 2^(e - 128) of an E8M0 byte, exact for e in 2..254 (what the loader accepts: quant_form_supported).
inline float fp4_scale(uint8_t e) {
    const uint32_t b = uint32_t(e - 1) << 23;
    float f;
    __builtin_memcpy(&f, &b, 4);
    return f;
}

// Quantized activation rows as the tile reads them (row r at offsets r * stride).
struct QuantRows {
    const int8_t *q;      // [rows][q_stride]: int8 values
    const float *dx;      // [rows][b_stride]: per-block scale
    const float *sx;      // [rows][b_stride]: dx * (sum of the block's q)
    const int32_t *s16;   // [rows][2 * b_stride]: sum of each 16-k half's q
    int64_t q_stride, b_stride;
    static constexpr int64_t kElemBytes = 1;
    // The rows from row m on.
    QuantRows from(int64_t m) const {
        return {q + m * q_stride, dx + m * b_stride, sx + m * b_stride, s16 + m * 2 * b_stride, q_stride, b_stride};
    }
};

// One panel of the weight.
struct QuantPanel {
    const uint8_t *qs;  // [blocks][block_bytes(bits)]
    const f16_t *d;     // [groups][16]
    const uint8_t *z;   // [groups][16] or null (minimum form)
    const f16_t *m;     // [groups][16] or null (zero-point form)
    int64_t blocks;     // K / 32
    int64_t bpg;        // blocks per group (group >= 32); unused with G16
};

// The 16 x 32 values of one block, unpacked to u[feature][k].
template <int Bits>
inline void unpack_block(const uint8_t *b, uint8_t u[kLanes][kBlock]) {
    static_assert(Bits == 4 || Bits == 5 || Bits == 6 || Bits == 8, "4, 5, 6 or 8-bit values");
    if constexpr (Bits == 8) {
        for (int j = 0; j < 8; ++j)
            for (int f = 0; f < kLanes; ++f)
                for (int t = 0; t < 4; ++t) u[f][4 * j + t] = b[(j * kLanes + f) * 4 + t];
    } else {
        for (int j = 0; j < 4; ++j)
            for (int f = 0; f < kLanes; ++f)
                for (int t = 0; t < 4; ++t) {
                    const int i = (j * kLanes + f) * 4 + t;
                    uint8_t lo = b[i] & 15, hi = b[i] >> 4;
                    if constexpr (Bits > 4) {
                        constexpr int kTop = (1 << (Bits - 4)) - 1;
                        lo |= ((b[plane_offset<Bits>(0) + i - 64 * j] >> plane_bit<Bits>(0, j)) & kTop) << 4;
                        hi |= ((b[plane_offset<Bits>(1) + i - 64 * j] >> plane_bit<Bits>(1, j)) & kTop) << 4;
                    }
                    u[f][4 * j + t] = lo;
                    u[f][4 * j + 16 + t] = hi;
                }
    }
}

// The inverse: u[f][k] (< 2^Bits) into the block's bytes b.
template <int Bits>
inline void pack_block(const uint8_t u[kLanes][kBlock], uint8_t *b) {
    if constexpr (Bits == 8) {
        for (int j = 0; j < 8; ++j)
            for (int f = 0; f < kLanes; ++f)
                for (int t = 0; t < 4; ++t) b[(j * kLanes + f) * 4 + t] = u[f][4 * j + t];
    } else {
        for (int64_t i = kNibbleBytes; i < block_bytes(Bits); ++i) b[i] = 0;
        for (int j = 0; j < 4; ++j)
            for (int f = 0; f < kLanes; ++f)
                for (int t = 0; t < 4; ++t) {
                    const int i = (j * kLanes + f) * 4 + t;
                    const uint8_t lo = u[f][4 * j + t], hi = u[f][4 * j + 16 + t];
                    b[i] = uint8_t((lo & 15) | ((hi & 15) << 4));
                    if constexpr (Bits > 4) {
                        b[plane_offset<Bits>(0) + i - 64 * j] |= uint8_t((lo >> 4) << plane_bit<Bits>(0, j));
                        b[plane_offset<Bits>(1) + i - 64 * j] |= uint8_t((hi >> 4) << plane_bit<Bits>(1, j));
                    }
                }
    }
}

// Calls f(std::integral_constant<int, bits>{}) for a supported value width.
template <typename F>
inline void with_bits(int bits, F &&f) {
    switch (bits) {
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// What the driver (linear_quant.cpp) asks of every tile, and what most need.
struct TileDefaults {
    // int8 x bytes per row chunk: a share of L2 next to the panel.
    static constexpr int64_t kChunkBytes = 192 * 1024;
    // Per thread, around a run of calls (a tile on matrix registers loads their configuration here).
    static void begin() {}
    static void end() {}
};

// run(mr, ...) for a tile written as Tile::tile<MR> per row count 1..MaxRows
// (rows in registers need the count at compile time).
template <typename Tile, int MaxRows, typename Rows = QuantRows>
struct UnrolledRows : TileDefaults {
    static constexpr int kMaxRows = MaxRows;
    static void run(int mr, const Rows &x, const QuantPanel &w, float *acc) {
        run_rows(mr, x, w, acc, std::make_integer_sequence<int, MaxRows>{});
    }

  private:
    template <int... I>
    static void run_rows(int mr, const Rows &x, const QuantPanel &w, float *acc, std::integer_sequence<int, I...>) {
        (void)((mr == I + 1 && (Tile::template tile<I + 1>(x, w, acc), true)) || ...);
    }
};

template <int Bits, bool Min, bool G16, bool Fp4 = false>
struct QuantTile : TileDefaults {
    static_assert(!(Min && G16), "group 16 comes with zero points only (Q6_K)");
    static_assert(!Fp4 || (Bits == 4 && !Min && !G16), "MXFP4 is 4-bit codes in groups of 32");
    static constexpr int kMaxRows = 4;
    static constexpr const char *kName = "portable";

    // acc[r * 16 + f] = the panel's feature f against row r of x, r < mr.
    static void run(int mr, const QuantRows &x, const QuantPanel &w, float *acc) {
        for (int i = 0; i < mr * kLanes; ++i) acc[i] = 0.0f;
        alignas(64) uint8_t u[kLanes][kBlock];
        int64_t g = 0, in_group = 0;
        for (int64_t b = 0; b < w.blocks; ++b) {
            unpack_block<Bits>(w.qs + b * block_bytes(Bits), u);
            if constexpr (Fp4)
                for (auto &row : u)
                    for (auto &v : row) v = kFp4U[v];
            for (int r = 0; r < mr; ++r) {
                const int8_t *xq = x.q + r * x.q_stride + b * kBlock;
                const float dx = x.dx[r * x.b_stride + b];
                const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
                float *a = acc + r * kLanes;
                int32_t s0[kLanes], s1[kLanes];
                for (int f = 0; f < kLanes; ++f) {
                    int32_t lo = 0, hi = 0;
                    for (int k = 0; k < 16; ++k) lo += int32_t(u[f][k]) * xq[k];
                    for (int k = 16; k < 32; ++k) hi += int32_t(u[f][k]) * xq[k];
                    s0[f] = lo;
                    s1[f] = hi;
                }
                if constexpr (G16) {
                    for (int h = 0; h < 2; ++h) {
                        const int64_t gg = 2 * b + h;
                        const int32_t *s = h ? s1 : s0;
                        for (int f = 0; f < kLanes; ++f) {
                            const float ddx = to_f32(w.d[gg * kLanes + f]) * dx;
                            a[f] = std::fma(float(s[f] - int32_t(w.z[gg * kLanes + f]) * s16[h]), ddx, a[f]);
                        }
                    }
                } else if constexpr (Min) {
                    const float sx = x.sx[r * x.b_stride + b];
                    for (int f = 0; f < kLanes; ++f) {
                        const float ddx = to_f32(w.d[g * kLanes + f]) * dx;
                        a[f] = std::fma(float(s0[f] + s1[f]), ddx, a[f]);
                        a[f] = std::fma(to_f32(w.m[g * kLanes + f]), sx, a[f]);
                    }
                } else {
                    const int32_t sum = s16[0] + s16[1];
                    for (int f = 0; f < kLanes; ++f) {
                        const uint8_t zb = w.z[g * kLanes + f];
                        const float ddx = (Fp4 ? fp4_scale(zb) : to_f32(w.d[g * kLanes + f])) * dx;
                        const int32_t z = Fp4 ? kFp4Zero : int32_t(zb);
                        a[f] = std::fma(float(s0[f] + s1[f] - z * sum), ddx, a[f]);
                    }
                }
            }
            if (!G16 && ++in_group == w.bpg) in_group = 0, ++g;
        }
    }
};

}  // namespace cpuinfer::quant

namespace cpuinfer::quant {
// The tile this build runs: the portable one, unless the vector layer's hook
// header specialises TileSelect<void> with its own.
template <typename = void>
struct TileSelect {
    template <int Bits, bool Min, bool G16, bool Fp4 = false>
    using Tile = QuantTile<Bits, Min, G16, Fp4>;
};
}  // namespace cpuinfer::quant

#include "quant_wide.h"

#if defined(CPUINFER_QUANT_HOOKS)
#include CPUINFER_QUANT_HOOKS
#endif

namespace cpuinfer::quant {
template <int Bits, bool Min, bool G16, bool Fp4 = false>
using Tile = typename TileSelect<>::template Tile<Bits, Min, G16, Fp4>;
// The 16-bit-activation tile (quant_wide.h) for a run of type T.
template <typename T, int Bits, bool Min>
using Wide = typename WideSelect<>::template Tile<T, Bits, Min>;
}  // namespace cpuinfer::quant
