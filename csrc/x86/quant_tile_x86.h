// x86 specialisation of the quantized linear tile (see common/quant_tile.h).
//
// A panel's 16 features are 16 int32 lanes: one zmm on AVX-512, two ymm on
// AVX2. Each 64-byte operand holds 4 consecutive k of every feature, so a
// row of x contributes one 4-byte broadcast per operand:
// - AVX512-VNNI (avx512bf16, amx): VPDPBUSD, 64 u8 x s8 products per instruction.
// - AVX2 (avx2, avx512 without VNNI): VPMADDUBSW then VPMADDWD against ones,
//   the same sums in two steps. VPMADDUBSW saturates its 16-bit pair sums, which
//   values of up to 6 bits (63 * 127 * 2) never reach; 8-bit values are split
//   into nibbles, each product exact, the high one weighted by 16.
// 5- and 6-bit values are rebuilt from their nibbles and high-bit planes
// (quant_tile.h) with one shift, AND and OR per operand, shared by the rows.
// The integer sums are exact and the f32 epilogue is the portable tile's,
// step by step, so every variant produces the same bits.
// Under CPUINFER_SIMDE_EMULATION (the C++ test program's avx512 run) the
// same code runs on SIMDe: VPDPBUSD on avx512bf16, the AMX-INT8 tile on amx
// (on emulation/amx_emulation.h's tile model), the AVX2 tile on avx512.
#pragma once
#if defined(CPUINFER_SIMDE_EMULATION) || defined(__AVX512VNNI__) || defined(__AVX2__)
#if !defined(CPUINFER_SIMDE_EMULATION)
#include <immintrin.h>
#endif

#include <cstring>

#include "bf16_x86.h"

namespace cpuinfer::quant {

inline int32_t load4(const int8_t *p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(CPUINFER_SIMDE_AVX512BF16)
#define CPUINFER_QUANT_VNNI 1
#endif
#if (defined(__AMX_INT8__) && defined(CPUINFER_QUANT_VNNI)) || defined(CPUINFER_SIMDE_AMX)
#define CPUINFER_QUANT_AMX 1
#endif

#if defined(CPUINFER_QUANT_VNNI)
// 16 lanes in one zmm.
struct Lanes {
    static constexpr const char *kName = "avx512vnni";
    static constexpr int kMaxRows = 8;
    using I = __m512i;
    using F = __m512;
    static I load64(const uint8_t *p) { return _mm512_loadu_si512(p); }
    static I low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
    static I high4(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
    static I izero() { return _mm512_setzero_si512(); }
    // MXFP4 codes (0..15 in each byte) -> their u (quant_tile.h's kFp4U), one byte shuffle.
    static I fp4(I c) {
        return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i *>(kFp4U))), c);
    }
    // The 16 f32 scales 2^(e - 128) of 16 E8M0 bytes (quant_tile.h's fp4_scale: the exponent field is e - 1).
    static F pow2(const uint8_t *e) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(e)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23));
    }
    // u | (p moved up by L bits, or down by -L, in every byte) & mask. 16-bit shifts: what crosses a byte edge
    // lands outside the masks used (quant_tile.h's planes: bit 4, or bits 4-5 moved at most 2 down).
    template <int L>
    static I with_high(I u, I p, uint8_t mask) {
        const I moved = L > 0 ? _mm512_slli_epi16(p, L) : L < 0 ? _mm512_srli_epi16(p, -L) : p;
        return _mm512_ternarylogic_epi32(u, moved, _mm512_set1_epi8(char(mask)), 0xf8);  // u | (moved & mask)
    }
    template <int Bits>
    static I dot(I acc, I u, int32_t x4) { return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(x4)); }
    static I add(I a, I b) { return _mm512_add_epi32(a, b); }
    // a - z * s, z the 16 zero points (u8).
    static I sub_zero(I a, const uint8_t *z, int32_t s) {
        I zv = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(z)));
        return _mm512_sub_epi32(a, _mm512_mullo_epi32(zv, _mm512_set1_epi32(s)));
    }
    static I sub(I a, int32_t v) { return _mm512_sub_epi32(a, _mm512_set1_epi32(v)); }
    static F fzero() { return _mm512_setzero_ps(); }
    static F half(const f16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); }
    static F to_float(I a) { return _mm512_cvtepi32_ps(a); }
    static F mul(F a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F fma(F a, float b, F c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), c); }
    static void store(float *p, F a) { _mm512_storeu_ps(p, a); }
};
#else
// 16 lanes in two ymm (features 0-7, 8-15).
struct Lanes {
    static constexpr const char *kName = "avx2";
    static constexpr int kMaxRows = 4;
    struct I { __m256i a, b; };
    struct F { __m256 a, b; };
    static I load64(const uint8_t *p) {
        return {_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + 32))};
    }
    static __m256i and15(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
    static I low4(I v) { return {and15(v.a), and15(v.b)}; }
    static I high4(I v) { return {and15(_mm256_srli_epi16(v.a, 4)), and15(_mm256_srli_epi16(v.b, 4))}; }
    static I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
    // MXFP4 codes -> their u (see the AVX-512 one).
    static I fp4(I c) {
        const __m256i t = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i *>(kFp4U)));
        return {_mm256_shuffle_epi8(t, c.a), _mm256_shuffle_epi8(t, c.b)};
    }
    static F pow2(const uint8_t *e) {
        auto eight = [](const uint8_t *p) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
            return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23));
        };
        return {eight(e), eight(e + 8)};
    }
    // u | (p moved up by L bits, or down by -L, in every byte) & mask (see the AVX-512 one).
    template <int L>
    static __m256i with_high(__m256i u, __m256i p, uint8_t mask) {
        const __m256i moved = L > 0 ? _mm256_slli_epi16(p, L) : L < 0 ? _mm256_srli_epi16(p, -L) : p;
        return _mm256_or_si256(u, _mm256_and_si256(moved, _mm256_set1_epi8(char(mask))));
    }
    template <int L>
    static I with_high(I u, I p, uint8_t mask) { return {with_high<L>(u.a, p.a, mask), with_high<L>(u.b, p.b, mask)}; }
    // Sums of 4 products u * x per 32-bit lane, for u < 64 (no saturation: 2 * 63 * 127 < 2^15).
    static __m256i dot4(__m256i u, __m256i x) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
    }
    template <int Bits>
    static I dot(I acc, I u, int32_t x4) {
        const __m256i x = _mm256_set1_epi32(x4);
        if constexpr (kNarrow<Bits>) {
            return {_mm256_add_epi32(acc.a, dot4(u.a, x)), _mm256_add_epi32(acc.b, dot4(u.b, x))};
        } else {
            auto one = [&](__m256i c, __m256i v) {
                const __m256i lo = dot4(and15(v), x), hi = dot4(and15(_mm256_srli_epi16(v, 4)), x);
                return _mm256_add_epi32(c, _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4)));
            };
            return {one(acc.a, u.a), one(acc.b, u.b)};
        }
    }
    static I add(I x, I y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
    static I sub_zero(I x, const uint8_t *z, int32_t s) {
        const __m256i sv = _mm256_set1_epi32(s);
        __m256i za = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(z)));
        __m256i zb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(z + 8)));
        return {_mm256_sub_epi32(x.a, _mm256_mullo_epi32(za, sv)), _mm256_sub_epi32(x.b, _mm256_mullo_epi32(zb, sv))};
    }
    static I sub(I x, int32_t v) {
        const __m256i vv = _mm256_set1_epi32(v);
        return {_mm256_sub_epi32(x.a, vv), _mm256_sub_epi32(x.b, vv)};
    }
    static F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static F half(const f16_t *p) {
        return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))),
                _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p + 8)))};
    }
    static F to_float(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
    static F mul(F x, float y) {
        const __m256 v = _mm256_set1_ps(y);
        return {_mm256_mul_ps(x.a, v), _mm256_mul_ps(x.b, v)};
    }
    static F fma(F x, F y, F c) { return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)}; }
    static F fma(F x, float y, F c) {
        const __m256 v = _mm256_set1_ps(y);
        return {_mm256_fmadd_ps(x.a, v, c.a), _mm256_fmadd_ps(x.b, v, c.b)};
    }
    static void store(float *p, F x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
};
#endif

template <int Bits, bool Min, bool G16, bool Fp4 = false>
struct IsaQuantTile : UnrolledRows<IsaQuantTile<Bits, Min, G16, Fp4>, Lanes::kMaxRows> {
    static_assert(!(Min && G16), "group 16 comes with zero points only (Q6_K)");
    static_assert(!Fp4 || (Bits == 4 && !Min && !G16), "MXFP4 is 4-bit codes in groups of 32");
    static constexpr const char *kName = Lanes::kName;
    using I = typename Lanes::I;
    using F = typename Lanes::F;

    // The f32 epilogue of one row's block (quant_tile.h's numerics, step by step): s0 / s1 the integer sums
    // of k 0-15 / 16-31 (G16), or s the block's sum (the other forms); g0 the block's group.
    static F finish_g16(F a, I s0, I s1, const QuantRows &x, const QuantPanel &w, int64_t g0, int r, int64_t b) {
        const float dx = x.dx[r * x.b_stride + b];
        const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
        a = Lanes::fma(Lanes::to_float(Lanes::sub_zero(s0, w.z + g0 * kLanes, s16[0])),
                       Lanes::mul(Lanes::half(w.d + g0 * kLanes), dx), a);
        return Lanes::fma(Lanes::to_float(Lanes::sub_zero(s1, w.z + (g0 + 1) * kLanes, s16[1])),
                          Lanes::mul(Lanes::half(w.d + (g0 + 1) * kLanes), dx), a);
    }
    static F finish(F a, I s, F d0, const QuantRows &x, const QuantPanel &w, int64_t g0, int r, int64_t b) {
        const float dx = x.dx[r * x.b_stride + b];
        if constexpr (Fp4) {
            const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
            return Lanes::fma(Lanes::to_float(Lanes::sub(s, kFp4Zero * (s16[0] + s16[1]))), Lanes::mul(d0, dx), a);
        } else if constexpr (Min) {
            a = Lanes::fma(Lanes::to_float(s), Lanes::mul(d0, dx), a);
            return Lanes::fma(Lanes::half(w.m + g0 * kLanes), x.sx[r * x.b_stride + b], a);
        } else {
            const int32_t *s16 = x.s16 + r * 2 * x.b_stride + 2 * b;
            return Lanes::fma(Lanes::to_float(Lanes::sub_zero(s, w.z + g0 * kLanes, s16[0] + s16[1])),
                              Lanes::mul(d0, dx), a);
        }
    }

    // Group g's 16 scales: f16 d, or MXFP4's from the E8M0 bytes in z.
    static F scale(const QuantPanel &w, int64_t g) {
        if constexpr (Fp4) return Lanes::pow2(w.z + g * kLanes);
        else return Lanes::half(w.d + g * kLanes);
    }

    // Operand J's two values (k 4J.. and 16 + 4J..) of a 4-, 5- or 6-bit block as bytes (quant_tile.h).
    template <int J>
    static void narrow_pair(const uint8_t *qb, I (&u)[8]) {
        const I v = Lanes::load64(qb + 64 * J);
        u[J] = Lanes::low4(v);
        u[J + 4] = Lanes::high4(v);
        if constexpr (Bits > 4) {
            const I p0 = Lanes::load64(qb + plane_offset<Bits>(0)), p1 = Lanes::load64(qb + plane_offset<Bits>(1));
            u[J] = Lanes::template with_high<4 - plane_bit<Bits>(0, J)>(u[J], p0, plane_mask<Bits>());
            u[J + 4] = Lanes::template with_high<4 - plane_bit<Bits>(1, J)>(u[J + 4], p1, plane_mask<Bits>());
        }
    }
    // The block's 8 operands, values as bytes.
    static void operands(const uint8_t *qb, I (&u)[8]) {
        if constexpr (Bits == 8) {
            for (int j = 0; j < 8; ++j) u[j] = Lanes::load64(qb + 64 * j);
        } else {
            narrow_pair<0>(qb, u);
            narrow_pair<1>(qb, u);
            narrow_pair<2>(qb, u);
            narrow_pair<3>(qb, u);
            if constexpr (Fp4)
                for (auto &v : u) v = Lanes::fp4(v);
        }
    }

    template <int MR>
    static void tile(const QuantRows &x, const QuantPanel &w, float *acc) {
        F a[MR];
        for (int r = 0; r < MR; ++r) a[r] = Lanes::fzero();
        int64_t g = 0, in_group = 0;
        for (int64_t b = 0; b < w.blocks; ++b) {
            const uint8_t *qb = w.qs + b * block_bytes(Bits);
            // Few rows (decode) stream the weight from memory: fetch every line of the block 8 blocks ahead.
            if constexpr (MR <= 2) {
                for (int64_t l = 0; l < block_bytes(Bits); l += 64) __builtin_prefetch(qb + 8 * block_bytes(Bits) + l);
            }
            I u[8];
            operands(qb, u);
            const int64_t g0 = G16 ? 2 * b : g;
            const F d0 = scale(w, g0);
            for (int r = 0; r < MR; ++r) {
                const int8_t *xq = x.q + r * x.q_stride + b * kBlock;
                I s0 = Lanes::izero(), s1 = Lanes::izero();
                for (int j = 0; j < 4; ++j) s0 = Lanes::template dot<Bits>(s0, u[j], load4(xq + 4 * j));
                for (int j = 4; j < 8; ++j) s1 = Lanes::template dot<Bits>(s1, u[j], load4(xq + 4 * j));
                if constexpr (G16) {
                    a[r] = finish_g16(a[r], s0, s1, x, w, g0, r, b);
                } else {
                    a[r] = finish(a[r], Lanes::add(s0, s1), d0, x, w, g0, r, b);
                }
            }
            if (!G16 && ++in_group == w.bpg) in_group = 0, ++g;
        }
        for (int r = 0; r < MR; ++r) Lanes::store(acc + r * kLanes, a[r]);
    }
};

#if defined(CPUINFER_QUANT_AMX)
// amx: AMX-INT8 for 16 rows at a time. x's rows are an A tile as they lie
// (16 rows x the block's 32 int8, q_stride apart) and a panel's block is a
// B tile (8 rows of 4 k x 16 features, the VPDPBUSD operand layout; 4-bit
// blocks unpacked to bytes first). One TDPBSUD (signed x, unsigned u) gives
// the block's 16 x 16 integer sums (two, over k 0-15 and 16-31, for G16);
// they pass through memory to the AVX-512 epilogue of IsaQuantTile, the same
// steps on the same exact integers, so the bits are those of every other
// tile and a row's result does not depend on the tile its batch takes.
// Measured on Sapphire Rapids (quant prefill, 2 threads): see README.
template <int Bits, bool Min, bool G16, bool Fp4 = false>
struct AmxQuantTile {
    using Vnni = IsaQuantTile<Bits, Min, G16, Fp4>;
    using F = typename Lanes::F;
    static constexpr int kMaxRows = 16;
    static constexpr int kReadRows = 16;  // reads 16 rows of x from its start whatever mr (QuantizedX pads)
    static constexpr int kAmxMinRows = 5;  // fewer rows (decode) take the VPDPBUSD tile
    static constexpr const char *kName = "amx-int8";
    // One 16-row group per chunk: the driver's tasks then take one group through panel after panel, its
    // A tiles (16 rows x K int8) staying in L1 while the weight streams (A tiles loaded from L2 stalled
    // the products: 1.25x at M = 512, K = 576 with this).
    static constexpr int64_t kChunkBytes = 0;
    static constexpr int kKBytes = G16 ? 16 : 32;  // k per product

    // Tiles 0-1 and 6-7: C (16 x 16 int32); 2-3: A (16 rows x kKBytes); 4-5: B (kKBytes / 4 rows x 64 bytes).
    static const x86::TileConfig &config() {
        static const x86::TileConfig cfg = [] {
            x86::TileConfig c;
            std::memset(&c, 0, sizeof c);
            c.palette = 1;
            for (int t : {0, 1, 6, 7}) c.rows[t] = 16, c.colsb[t] = 64;
            for (int t = 2; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = kKBytes;
            for (int t = 4; t < 6; ++t) c.rows[t] = kKBytes / 4, c.colsb[t] = 64;
            return c;
        }();
        return cfg;
    }
    static void begin() { x86::load_tile_config(config()); }
    static void end() { x86::release_tiles(); }

    // 4- to 6-bit values with zero points are unpacked as signed u - z (in [-63, 63]), so TDPBSSD gives
    // s - z * sum itself, the integer the epilogue would form, and the epilogue skips that step (half its work).
    static constexpr bool kSigned = kNarrow<Bits> && !Min;

    // The 64-byte B row operand of a group's zero points: z of feature f in bytes 4f..4f+3.
    static __m512i zero_points(const uint8_t *z) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(z)));
        return _mm512_mullo_epi32(v, _mm512_set1_epi32(0x01010101));
    }

    static int64_t group_of(const QuantPanel &w, int64_t b) { return G16 ? 2 * b : b / w.bpg; }

    // Block b's B tile rows: the packed block itself (8-bit), or unpacked into u (4 to 6 bits).
    static const uint8_t *b_rows(const QuantPanel &w, int64_t b, uint8_t *u) {
        const uint8_t *qb = w.qs + b * block_bytes(Bits);
        if constexpr (Bits == 8) {
            (void)u;
            return qb;
        } else {
            const int64_t g0 = group_of(w, b);
            __m512i z0 = _mm512_setzero_si512(), z1 = z0;
            if constexpr (Fp4) {
                z0 = z1 = _mm512_set1_epi8(char(kFp4Zero));
            } else if constexpr (kSigned) {
                z0 = zero_points(w.z + g0 * kLanes);
                z1 = G16 ? zero_points(w.z + (g0 + 1) * kLanes) : z0;
            }
            __m512i ops[8];
            Vnni::operands(qb, ops);
            for (int j = 0; j < 4; ++j) {
                _mm512_store_si512(u + 64 * j, _mm512_sub_epi8(ops[j], z0));
                _mm512_store_si512(u + 256 + 64 * j, _mm512_sub_epi8(ops[j + 4], z1));
            }
            return u;
        }
    }

    // Block b's integer sums of the 16 rows into c[0] (and c[1], k 16-31, for G16). Even blocks use tiles
    // 0 / 2 / 4 (C / A / B; G16 also 1 / 3 / 5), odd ones 1 / 3 / 5 (G16: 6-7 / 2-3 / 4-5), so that a block's
    // products need not wait for the previous block's store of the same tile (TDP's latency is several
    // times its throughput). Tile numbers are immediates, hence the macro.
#define CPUINFER_AMX_Q_PRODUCTS(C, A, B, C2, A2, B2)                             \
    {                                                                          \
        _tile_zero(C);                                                         \
        _tile_loadd(A, xa, x.q_stride);                                        \
        _tile_loadd(B, bt, 64);                                                \
        if constexpr (kSigned) _tile_dpbssd(C, A, B);                          \
        else _tile_dpbsud(C, A, B);                                            \
        _tile_stored(C, c[0], 64);                                             \
        if constexpr (G16) {                                                   \
            _tile_zero(C2);                                                    \
            _tile_loadd(A2, xa + 16, x.q_stride);                              \
            _tile_loadd(B2, bt + 256, 64);                                     \
            if constexpr (kSigned) _tile_dpbssd(C2, A2, B2);                   \
            else _tile_dpbsud(C2, A2, B2);                                     \
            _tile_stored(C2, c[1], 64);                                        \
        }                                                                      \
    }
    static void products(const QuantRows &x, int64_t b, const uint8_t *bt, int32_t (*c)[16][16]) {
        const int8_t *xa = x.q + b * kBlock;
        if (!(b & 1)) CPUINFER_AMX_Q_PRODUCTS(0, 2, 4, 1, 3, 5)
        else if constexpr (G16) CPUINFER_AMX_Q_PRODUCTS(6, 2, 4, 7, 3, 5)
        else CPUINFER_AMX_Q_PRODUCTS(1, 3, 5, 7, 3, 5)
    }
#undef CPUINFER_AMX_Q_PRODUCTS

    // The tile products run a block ahead of the epilogue, through two buffers each for the unpacked
    // weight and the sums: a tile load of bytes just written by vector stores, and vector loads of a
    // tile store's bytes, wait for those stores to reach L1 (measured: without this the three tile
    // instructions took 40% of the time, and AMX gained nothing over VPDPBUSD on Q4_1).
    static void run(int mr, const QuantRows &x, const QuantPanel &w, float *acc) {
        if (mr < kAmxMinRows) return Vnni::run(mr, x, w, acc);
        F a[16];
        for (int r = 0; r < 16; ++r) a[r] = Lanes::fzero();
        alignas(64) uint8_t ub[2][512];
        alignas(64) int32_t c[2][2][16][16];
        const int64_t n = w.blocks;
        products(x, 0, b_rows(w, 0, ub[0]), c[0]);
        const uint8_t *next = n > 1 ? b_rows(w, 1, ub[1]) : nullptr;
        for (int64_t b = 0; b < n; ++b) {
            if (b + 1 < n) products(x, b + 1, next, c[(b + 1) & 1]);
            if (b + 2 < n) next = b_rows(w, b + 2, ub[b & 1]);
            const int32_t (*cb)[16][16] = c[b & 1];
            const int64_t g0 = group_of(w, b);
            const F d0 = Vnni::scale(w, g0);
            const F d1 = G16 ? Vnni::scale(w, g0 + 1) : d0;
#pragma GCC unroll 16
            for (int r = 0; r < 16; ++r) {
                const __m512i s0 = _mm512_load_si512(cb[0][r]);
                if constexpr (kSigned) {  // the zero-point epilogue after its subtraction
                    const float dx = x.dx[r * x.b_stride + b];
                    a[r] = Lanes::fma(Lanes::to_float(s0), Lanes::mul(d0, dx), a[r]);
                    if constexpr (G16)
                        a[r] = Lanes::fma(Lanes::to_float(_mm512_load_si512(cb[1][r])), Lanes::mul(d1, dx), a[r]);
                } else if constexpr (G16) {
                    a[r] = Vnni::finish_g16(a[r], s0, _mm512_load_si512(cb[1][r]), x, w, g0, r, b);
                } else {
                    a[r] = Vnni::finish(a[r], s0, d0, x, w, g0, r, b);
                }
            }
        }
        for (int r = 0; r < mr; ++r) Lanes::store(acc + r * kLanes, a[r]);
    }
};
#endif

// This build's tile (common/quant_tile.h).
template <>
struct TileSelect<void> {
#if defined(CPUINFER_QUANT_AMX)
    template <int Bits, bool Min, bool G16, bool Fp4 = false>
    using Tile = AmxQuantTile<Bits, Min, G16, Fp4>;
#else
    template <int Bits, bool Min, bool G16, bool Fp4 = false>
    using Tile = IsaQuantTile<Bits, Min, G16, Fp4>;
#endif
};

}  // namespace cpuinfer::quant

#include "quant_wide_x86.h"
#endif
