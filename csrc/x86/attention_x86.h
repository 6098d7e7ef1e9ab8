// x86 fast paths for the QK^T and PV tiles of paged attention, used when the
// query and the KV cache are both bf16, and on amx for bf16 queries on an
// fp8_e5m2 cache too (products of bf16 values are exact in f32, so these
// paths only change the summation order):
//   avx512bf16: QK^T with VDPBF16PS (pairs of bf16 multiplied and summed into
//               f32) on keys transposed once per block, 16 keys to a vector; PV
//               on the vector layer's f32 FMAs (attention_tile.h)
//   amx:        every unit (any row count; head sizes that are multiples of 32)
//               as flash attention on AMX-BF16 tiles, QK^T and PV, the softmax
//               weights in two bf16 terms; other head sizes (80) as avx512bf16
// Under CPUINFER_SIMDE_EMULATION (the C++ test program on CPUs without
// AVX-512) the same code runs on SIMDe and on a software model of the AMX
// tiles (amx_emulation.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../common/vec.h"
#include "bf16_x86.h"

#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)
#define CPUINFER_ATTN_DPBF16 1
#endif
#if defined(__AMX_BF16__) || defined(CPUINFER_SIMDE_AMX)
#define CPUINFER_ATTN_AMX 1
#endif


namespace cpuinfer::attn {

#if defined(CPUINFER_ATTN_DPBF16)
using x86::as_bh;

// 32 bf16 at p (or 16, zero-extended, for the last chunk of D = 80).
inline __m512i load_bf16x32(const bf16_t *p, int64_t n) {
    if (n >= 32) return _mm512_loadu_si512(reinterpret_cast<const void *>(p));
    return _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)), 0);
}

// 16 x 16 32-bit transpose of r[0..15] in place. (The AMX path's flash_pack
// uses it too: amx builds always have AVX512-BF16.)
inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // Each 128-bit lane now holds a transposed 4 x 4 block; two rounds of
    // 128-bit shuffles put the blocks in place.
    for (int i = 0; i < 8; ++i) {
        const int a = (i / 4) * 8 + i % 4, b = a + 4;
        t[a] = _mm512_shuffle_i32x4(r[a], r[b], 0x88);
        t[b] = _mm512_shuffle_i32x4(r[a], r[b], 0xdd);
    }
    for (int i = 0; i < 8; ++i) {
        const int a = i, b = i + 8;
        r[a] = _mm512_shuffle_i32x4(t[a], t[b], 0x88);
        r[b] = _mm512_shuffle_i32x4(t[a], t[b], 0xdd);
    }
}

// QK^T on VDPBF16PS with the keys transposed, 16 keys to a vector: one
// VDPBF16PS per query row and d-pair (the row's pair broadcast) adds that pair
// to 16 keys' scores at once, and no score needs a horizontal sum. The keys of
// a block are transposed once (pack_keys_dpbf16) and serve every tile of the
// unit's rows. (Computing each score as a dot product along d, as before, took
// a 16-lane reduction per score: about 8 instructions beside its D / 32
// VDPBF16PS.) Every row count takes this path, decode included, so a row's
// score has the same summation order, and bits, whatever its batch.

// The kt layout of a block's keys: for 16-key group g (keys 16g .. 16g + 15
// of the block) and d-pair p < D / 2, one vector of the 16 keys' pairs
// (k[2p], k[2p + 1]) at kt + (g * D / 2 + p) * 16.
inline int64_t packed_keys_size(int64_t D, int64_t bs) { return bs / 16 * (D / 2) * 16; }

// Packs the groups of a block's keys (k: its first key row) that hold keys
// [j0, j1). Whole groups, since block sizes are multiples of 16: the keys of
// the first and last group outside [j0, j1) (before j0, past the sequence's
// end, the partition or the causal limit) are packed too, from the block's
// memory; their scores are never read.
inline void pack_keys_dpbf16(const bf16_t *k, int64_t D, int64_t j0, int64_t j1, uint32_t *kt) {
    const int64_t P = D / 2;
    for (int64_t g = j0 / 16; g * 16 < j1; ++g) {
        const bf16_t *kg = k + g * 16 * D;
        uint32_t *dst = kt + g * P * 16;
        for (int64_t p0 = 0; p0 < P; p0 += 16) {
            const int64_t np = std::min<int64_t>(16, P - p0);  // 16, or 8 for D = 80's last pairs
            __m512i r[16];
            for (int i = 0; i < 16; ++i) r[i] = load_bf16x32(kg + i * D + 2 * p0, 2 * np);
            transpose16(r);
            for (int64_t i = 0; i < np; ++i) _mm512_storeu_si512(dst + (p0 + i) * 16, r[i]);
        }
    }
}

// A query row's d-pair p, as the 32-bit lane VDPBF16PS multiplies.
inline int32_t query_pair(const bf16_t *q, int64_t p) {
    int32_t v;
    std::memcpy(&v, q + 2 * p, sizeof v);
    return v;
}

// s[r * s_stride + 16 * g ..] for R rows and NG 16-key groups from g, from the packed keys.
template <int R, int NG>
inline void qk_groups_dpbf16(const bf16_t *q, int64_t D, const uint32_t *kt, int64_t g, float *s, int64_t s_stride) {
    const int64_t P = D / 2;
    __m512 acc[NG][R];
#pragma GCC unroll 4
    for (int n = 0; n < NG; ++n)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
    const uint32_t *k = kt + g * P * 16;
    for (int64_t p = 0; p < P; ++p) {
#pragma GCC unroll 4
        for (int n = 0; n < NG; ++n) {
            const __m512bh kv = as_bh(_mm512_loadu_si512(k + (n * P + p) * 16));
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r)
                acc[n][r] = _mm512_dpbf16_ps(acc[n][r], as_bh(_mm512_set1_epi32(query_pair(q + r * D, p))), kv);
        }
    }
#pragma GCC unroll 4
    for (int n = 0; n < NG; ++n)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * s_stride + (g + n) * 16, acc[n][r]);
}

// s[r * s_stride + j] = dot(q[r * D ..], key j) for j in [j0, j1) of a block packed by pack_keys_dpbf16, for
// bf16 query rows q (D a multiple of 16). Other lanes of the 16-key groups touched get scores too.
template <int R>
inline void qk_tile_dpbf16(const bf16_t *q, int64_t D, const uint32_t *kt, int64_t j0, int64_t j1, float *s,
                           int64_t s_stride) {
    // Groups at once, for more independent accumulator chains (NG x R, within the 32 registers) where the
    // tile's keys span that many groups; a tile of one group (block size 16) has R chains.
    constexpr int NG = R <= 2 ? 4 : R <= 8 ? 2 : 1;
    int64_t g = j0 / 16;
    const int64_t g1 = (j1 + 15) / 16;
    for (; g + NG <= g1; g += NG) qk_groups_dpbf16<R, NG>(q, D, kt, g, s, s_stride);
    for (; g < g1; ++g) qk_groups_dpbf16<R, 1>(q, D, kt, g, s, s_stride);
}
#endif

}  // namespace cpuinfer::attn

#if defined(CPUINFER_ATTN_AMX)
#include "attention_amx.h"
#endif

namespace cpuinfer::attn {

// The hooks of common/attention_tile.h this build fills.
#if defined(CPUINFER_ATTN_DPBF16)
template <>
struct QkBf16<bf16_t, bf16_t> {
    static constexpr bool kAvailable = true;
    static void pack(const bf16_t *k, int64_t D, int64_t bs, int64_t j0, int64_t j1, LineVector<uint32_t> &buf) {
        const int64_t n = packed_keys_size(D, bs);
        if (int64_t(buf.size()) < n) buf.resize(size_t(n));
        pack_keys_dpbf16(k, D, j0, j1, buf.data());
    }
    template <int R>
    static void run(const bf16_t *q, int64_t D, const uint32_t *kt, int64_t j0, int64_t j1, float *s, int64_t ss) {
        qk_tile_dpbf16<R>(q, D, kt, j0, j1, s, ss);
    }
};
#endif

#if defined(CPUINFER_ATTN_AMX)
// bf16 queries on a bf16 or an fp8_e5m2 cache (whose rows the packing widens to bf16 exactly).
struct WholeUnitAmx {
    // Every row count, decode included, so that a row's result does not depend
    // on its batch (the engine's greedy outputs rely on it, as on the GEMM's).
    static bool applies(int64_t, int64_t D) { return D % 32 == 0; }
    // Units of up to 512 rows: a unit packs the keys it sees once for all its tiles, and packing was 13% of
    // a 2048-token prefill layer at 64 rows (SmolLM2's heads, 2 threads: 10.0 -> 8.5 ms; 256 -> 512 rows
    // 7.4-7.6 -> 7.1-7.2 ms, 1024 no better). The plan halves it, down to 256, for a batch with fewer
    // units than 4 a thread (a 128-token prompt's 3 units of 384 rows ran 15% slower than 6 smaller ones).
    static constexpr int64_t kChunkRows = 512;
    template <typename KeyRow, typename ValueRow>
    static void run(const FlashUnit &u, KeyRow &&key, ValueRow &&value) {
        flash_unit_amx(u, key, value);
    }
};
template <>
struct WholeUnit<bf16_t, bf16_t> : WholeUnitAmx {};
template <>
struct WholeUnit<bf16_t, fp8_e5m2_t> : WholeUnitAmx {};
template <>
struct Impl<void> {
    static constexpr const char *kName = "amx";
};
#elif defined(CPUINFER_ATTN_DPBF16)
template <>
struct Impl<void> {
    static constexpr const char *kName = "avx512bf16";
};
#endif

}  // namespace cpuinfer::attn
