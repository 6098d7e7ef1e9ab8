// x86 specialisation of the 16-bit-activation quantized tile (see
// common/quant_wide.h): bf16 runs on AVX512-BF16 (avx512bf16, amx).
//
// The weight's integer values become exact bf16 operands of VDPBF16PS with
// two bitwise steps and no conversion: a 4-bit value n, moved to bits 3-6 of
// its byte with bit 7 set and the byte 0x41 above it, is the bf16 word of
// 16 + n (exponent 2^4, mantissa n / 16). 8-bit values go as two nibbles,
// the high one under 0x43 (256 + 16 n), so a byte u reads as 272 + u. The
// products x * (offset + u) are exact in f32 (8 by 9 significant bits), and
// per group of the weight the f32 sums S meet the group's scale once:
//   zero point:  acc = fma(d, S - (offset + z) * sum_x, acc)
//   minimum:     acc = fma(d, S - offset * sum_x, acc); acc = fma(m, sum_x, acc)
// with sum_x the row's f32 sum of x over the group (WideRows::gsum). So the
// weight is used at its exact value (no bf16 rounding of d * (u - z)), x as
// the bf16 run holds it.
//
// Operands: a 64-byte VPDPBUSD operand (16 features x 4 k, quant_tile.h)
// unpacks with 0x41 / 0x43 into two VDPBF16PS operands per 128-bit lane l:
// the low half's dwords are (feature 4l, k 0-1), (4l, k 2-3), (4l+1, k 0-1),
// (4l+1, k 2-3), the high half's the same for 4l+2, 4l+3; a row's 4 bf16 of
// x broadcast as one 64-bit element line up with both. At the end of a group
// the two halves fold into the 16 features in order. Every row takes the same
// steps whatever the row count (kMaxRows rows share each widened operand), so
// a row's result does not depend on its batch.
#pragma once
#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)
#include <cstring>
#include <type_traits>

#include "bf16_x86.h"

namespace cpuinfer::quant {

template <int Bits, bool Min>
struct Bf16WideTile : UnrolledRows<Bf16WideTile<Bits, Min>, 8, WideRows<bf16_t>> {
    static_assert(Bits == 4 || Bits == 8, "4- or 8-bit values");
    using X = bf16_t;
    static constexpr bool kSums = true;
    static constexpr const char *kName = "avx512bf16";
    static constexpr float kOffset = Bits == 4 ? 16.0f : 272.0f;

    // Nibbles (low: bits 0-3 of each byte, else 4-7) at bits 3-6 with bit 7 set.
    template <bool High>
    static __m512i nibbles(__m512i v) {
        const __m512i moved = High ? _mm512_srli_epi16(v, 1) : _mm512_slli_epi16(v, 3);
        return _mm512_ternarylogic_epi32(moved, _mm512_set1_epi8(0x78), _mm512_set1_epi8(char(0x80)), 0xEA);  // a & b | c
    }

    // One operand's products for every row: nib from nibbles(), top 0x41 or 0x43, xk the operand's first k.
    template <int MR>
    static void products(__m512i nib, char top, const WideRows<bf16_t> &x, int64_t xk, __m512 (&lo)[MR],
                         __m512 (&hi)[MR]) {
        const __m512i t = _mm512_set1_epi8(top);
        const __m512bh wl = x86::as_bh(_mm512_unpacklo_epi8(nib, t)), wh = x86::as_bh(_mm512_unpackhi_epi8(nib, t));
        for (int r = 0; r < MR; ++r) {
            int64_t q;
            std::memcpy(&q, x.x + r * x.x_stride + xk, 8);
            const __m512bh xb = x86::as_bh(_mm512_set1_epi64(q));
            lo[r] = _mm512_dpbf16_ps(lo[r], xb, wl);
            hi[r] = _mm512_dpbf16_ps(hi[r], xb, wh);
        }
    }

    template <int MR>
    static void tile(const WideRows<bf16_t> &x, const QuantPanel &w, float *acc) {
        __m512 a[MR], lo[MR], hi[MR];
        for (int r = 0; r < MR; ++r) a[r] = lo[r] = hi[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < w.blocks; ++b) {
            const uint8_t *qb = w.qs + b * block_bytes(Bits);
            if constexpr (MR <= 2) {  // decode streams the weight from memory: 8 blocks ahead, as the int8 tile
                for (int64_t l = 0; l < block_bytes(Bits); l += 64) __builtin_prefetch(qb + 8 * block_bytes(Bits) + l);
            }
            const int64_t k0 = b * kBlock;
            if constexpr (Bits == 4) {
                for (int j = 0; j < 4; ++j) {  // word j: k 4j.. in its low nibbles, 16 + 4j.. in its high ones
                    const __m512i v = _mm512_loadu_si512(qb + 64 * j);
                    products<MR>(nibbles<false>(v), 0x41, x, k0 + 4 * j, lo, hi);
                    products<MR>(nibbles<true>(v), 0x41, x, k0 + 16 + 4 * j, lo, hi);
                }
            } else {
                for (int j = 0; j < 8; ++j) {  // operand j: k 4j..
                    const __m512i v = _mm512_loadu_si512(qb + 64 * j);
                    products<MR>(nibbles<false>(v), 0x41, x, k0 + 4 * j, lo, hi);
                    products<MR>(nibbles<true>(v), 0x43, x, k0 + 4 * j, lo, hi);
                }
            }
            if ((b + 1) % w.bpg != 0) continue;
            // The group's end: fold, scale, and start the next group's sums.
            const int64_t g = b / w.bpg;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(w.d + g * kLanes)));
            __m512 off = _mm512_set1_ps(kOffset), m = off;
            if constexpr (Min) {
                m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(w.m + g * kLanes)));
            } else {
                const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i *>(w.z + g * kLanes));
                off = _mm512_add_ps(off, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(z)));
            }
            for (int r = 0; r < MR; ++r) {
                const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(lo[r], hi[r], _MM_SHUFFLE(2, 0, 2, 0)),
                                               _mm512_shuffle_ps(lo[r], hi[r], _MM_SHUFFLE(3, 1, 3, 1)));
                const __m512 sx = _mm512_set1_ps(x.gsum[r * x.g_stride + g]);
                a[r] = _mm512_fmadd_ps(d, _mm512_fnmadd_ps(off, sx, s), a[r]);
                if constexpr (Min) a[r] = _mm512_fmadd_ps(m, sx, a[r]);
                lo[r] = hi[r] = _mm512_setzero_ps();
            }
        }
        for (int r = 0; r < MR; ++r) _mm512_storeu_ps(acc + r * kLanes, a[r]);
    }
};

// This build's 16-bit-activation tiles: bf16 runs on VDPBF16PS, f16 and f32 on the portable f32 tile.
template <>
struct WideSelect<void> {
    template <typename T, int Bits, bool Min>
    using Tile = std::conditional_t<std::is_same_v<T, bf16_t>, Bf16WideTile<Bits, Min>, WideTile<Bits, Min>>;
};

}  // namespace cpuinfer::quant
#endif
