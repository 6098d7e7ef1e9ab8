// x86 specialisation of the packed linear tile (see common/panel_kernel.h).
//
// avx512bf16 / amx: bf16 weights (and f16 ones on AMX-FP16, below) are packed
// in pairs of k (kPair = 2), the layout VDPBF16PS reads: one zmm holds 16
// output features x 2 consecutive k.
// A row of x contributes the same pair (x[k], x[k+1]) to all 16 lanes, a
// 32-bit broadcast straight from x (no activation packing: the broadcast is
// the instruction's memory operand). Each instruction does 32 multiply-adds
// with one f32 rounding per pair of products; the order is fixed by k, so the
// result is deterministic and independent of MR.
// Under CPUINFER_SIMDE_EMULATION the same code runs on SIMDe.
#pragma once
#include <algorithm>
#include <cstring>

#include "../common/vec.h"
#include "bf16_x86.h"

#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)

namespace cpuinfer::panel {

using x86::as_bh;

// A register tile over panels packed in k-pairs (32 columns: a pair of k for
// 16 columns per zmm, two zmm per panel and pair). Per pair, Op::load reads
// what each panel in use contributes, and Op::mac adds one x row's pair times
// it to the slot's two accumulators (columns 0-15, 16-31). Each accumulator
// sees the pairs in k order whatever MR and NP, so a row's result does not
// depend on its batch.
template <typename Op>
struct PairTiles : RegisterTiles<PairTiles<Op>> {
    using T = typename Op::T;
    using X = T;  // x as it lies: a row's pair is read where it is used
    static constexpr int kPair = 2;
    static constexpr const char *kName = Op::kName;
    static constexpr bool kPairOrder = false;  // accumulators in natural column order

    template <int MR, int NP>
    static void tile(const T *x, int64_t xs, const T *w, int64_t ps, int64_t K, float *acc) {
        static_assert(MR >= 1 && MR <= kMaxRows && NP >= 1 && NP <= 4 && MR * NP <= 12, "tile shape");
        const T *w0 = w, *w1 = w + (NP > 1 ? ps : 0), *w2 = w + (NP > 2 ? 2 * ps : 0), *w3 = w + (NP > 3 ? 3 * ps : 0);
#define CPUINFER_DECL(s) __m512 c##s##a = _mm512_setzero_ps(), c##s##b = _mm512_setzero_ps();
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        const int64_t pairs = K / 2;
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t o = p * 64;  // a pair of k for 32 columns
            // Few rows (decode) stream the weight from memory: fetch ahead
            // as in the GEMV. With many rows the panel is already in cache.
            if constexpr (MR <= 4) {
                prefetch_stream(w0 + o, 128);
                if constexpr (NP > 1) prefetch_stream(w1 + o, 128);
                if constexpr (NP > 2) prefetch_stream(w2 + o, 128);
                if constexpr (NP > 3) prefetch_stream(w3 + o, 128);
            }
            typename Op::W b0 = Op::load(w0 + o), b1 = b0, b2 = b0, b3 = b0;
            if constexpr (NP > 1) b1 = Op::load(w1 + o);
            if constexpr (NP > 2) b2 = Op::load(w2 + o);
            if constexpr (NP > 3) b3 = Op::load(w3 + o);
#define CPUINFER_SLOT(s)                                                                  \
    if constexpr (s < MR * NP) {                                                          \
        constexpr int r = s / NP, q = s % NP;                                             \
        Op::mac(c##s##a, c##s##b, pick<q>(b0, b1, b2, b3), x + r * xs + 2 * p);           \
    }
            CPUINFER_PANEL_SLOTS(CPUINFER_SLOT)
#undef CPUINFER_SLOT
        }
#define CPUINFER_STORE(s)                             \
    if constexpr (s < MR * NP) {                      \
        _mm512_storeu_ps(acc + s * 32, c##s##a);      \
        _mm512_storeu_ps(acc + s * 32 + 16, c##s##b); \
    }
        CPUINFER_PANEL_SLOTS(CPUINFER_STORE)
#undef CPUINFER_STORE
    }

    static int64_t peak(int64_t iters, float *sink) { return Op::peak(iters, sink); }
};

// VDPBF16PS: a row's pair (x[k], x[k+1]) broadcast to all 16 lanes (a 32-bit
// broadcast straight from x), one instruction per 16 columns. The avx512bf16
// variant's bf16 kernel; the amx variant's for K not a multiple of 32.
struct DpBf16Op {
    using T = bf16_t;
    static constexpr const char *kName = "avx512bf16";
    struct W {
        __m512bh a, b;
    };
    static W load(const bf16_t *p) {
        return {as_bh(_mm512_loadu_si512(p)), as_bh(_mm512_loadu_si512(p + 32))};
    }
    static void mac(__m512 &ca, __m512 &cb, const W &w, const bf16_t *xp) {
        int32_t pair;
        std::memcpy(&pair, xp, 4);
        const __m512bh a = as_bh(_mm512_set1_epi32(pair));
        ca = _mm512_dpbf16_ps(ca, a, w.a);
        cb = _mm512_dpbf16_ps(cb, a, w.b);
    }

    // 12 independent VDPBF16PS chains (32 multiply-adds each per step).
    static int64_t peak(int64_t iters, float *sink) {
        const __m512bh a = as_bh(_mm512_set1_epi16(0x3000));  // bf16 ~4.7e-10
#define CPUINFER_DECL(i) __m512 c##i = _mm512_setzero_ps(); const __m512bh b##i = as_bh(_mm512_set1_epi16(0x3f80 + i));
        CPUINFER_PANEL_SLOTS(CPUINFER_DECL)
#undef CPUINFER_DECL
        for (int64_t it = 0; it < iters; ++it) {
#define CPUINFER_STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b##i);
            CPUINFER_PANEL_SLOTS(CPUINFER_STEP)
#undef CPUINFER_STEP
        }
        __m512 s = _mm512_setzero_ps();
#define CPUINFER_SUM(i) s = _mm512_add_ps(s, c##i);
        CPUINFER_PANEL_SLOTS(CPUINFER_SUM)
#undef CPUINFER_SUM
        *sink = _mm512_reduce_add_ps(s);
        return 12 * iters * 32;
    }
};
using DpBf16Tiles = PairTiles<DpBf16Op>;

#if defined(__AMX_BF16__) || defined(CPUINFER_SIMDE_AMX)

// amx's f16 tile when K is not a multiple of 32 (AMX-FP16's step): AVX-512
// FMAs on the same pair layout. A 64-byte load holds 16 columns x 2 k;
// VPMOVDW of its low and high halves gives the 16 columns' f16 at k and at
// k + 1, which widen exactly. Each column is the f32 FMA chain in k order, as
// on the AMX-FP16 tile and the portable tile.
struct PairFmaOp {
    using T = f16_t;
    static constexpr const char *kName = "avx512-pairs";
    struct W {
        __m512 even_a, odd_a, even_b, odd_b;  // columns 0-15 and 16-31 at k and k + 1
    };
    static void widen(const f16_t *p, __m512 &even, __m512 &odd) {
        const __m512i v = _mm512_loadu_si512(p);
        even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
        odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
    }
    static W load(const f16_t *p) {
        W w;
        widen(p, w.even_a, w.odd_a);
        widen(p + 32, w.even_b, w.odd_b);
        return w;
    }
    static void mac(__m512 &ca, __m512 &cb, const W &w, const f16_t *xp) {
        uint32_t pair;
        std::memcpy(&pair, xp, 4);
        const __m128 xf = _mm_cvtph_ps(_mm_cvtsi32_si128(int(pair)));
        const __m512 xe = _mm512_broadcastss_ps(xf), xo = _mm512_broadcastss_ps(_mm_movehdup_ps(xf));
        ca = _mm512_fmadd_ps(xe, w.even_a, ca);
        cb = _mm512_fmadd_ps(xe, w.even_b, cb);
        ca = _mm512_fmadd_ps(xo, w.odd_a, ca);
        cb = _mm512_fmadd_ps(xo, w.odd_b, cb);
    }
};

// The AMX product of a type's k-pairs, C += A * B on tiles (numbers as
// template arguments: GCC's _tile_* macros paste their arguments into the
// asm text, so they cannot take template constants).
// bf16: TDPBF16PS. K not a multiple of 32 takes the VDPBF16PS tile.
// f16: TDPFP16PS (AMX-FP16, Granite Rapids on), written as bytes since GCC 12
// and older assemblers do not know it: VEX.128.F2.0F38.W0 5C /r with C in
// ModRM.reg, A in ModRM.rm and B in VEX.vvvv (binutils 2.40 assembles
// `tdpfp16ps %tmm6, %tmm4, %tmm0` to c4 e2 4b 5c c4, as here). Each step is
// an f32 FMA rounded to nearest even, f16 denormals kept and f32 denormal
// results flushed; f16 products are exact in f32, so the sums are the FMA
// chain's bits (the portable tile's, the f16 path of every other variant).
template <typename T>
struct AmxDot;
template <>
struct AmxDot<bf16_t> {
    static constexpr const char *kName = "amx";
    using Fallback = DpBf16Tiles;
    template <int C, int A, int B>
    static void dp() {
        x86::tdpbf16ps<C, A, B>();
    }
};
template <>
struct AmxDot<f16_t> {
    static constexpr const char *kName = "amx-fp16";
    using Fallback = PairTiles<PairFmaOp>;
    template <int C, int A, int B>
    static void dp() {
#if defined(CPUINFER_SIMDE_EMULATION)
        _tile_dpfp16ps(C, A, B);
#else
        asm volatile(".byte 0xc4, 0xe2, %c0, 0x5c, %c1" ::"i"(((~B & 15) << 3) | 3), "i"(0xc0 | (C << 3) | A));
#endif
    }
};

// amx: AMX tiles (AMX-BF16 for bf16, AMX-FP16 for f16) on the same packed
// layout. A panel's 16 k-pairs x 16 columns are a B tile as they lie (rows of
// 64 bytes, 128 bytes apart); x is copied by pack_x into whole 16-row tiles,
// each k-step's 16 x 32 A tile one contiguous KB. A call takes up to 128 rows
// x one panel (32 columns):
//   for each block of K (k_block: at most kKBlock k, so that its <= 18 KB of
//   the panel stay in L1):
//     for each 32 rows: four C tiles (32 x 32) from acc (or zero), the
//     block's k-steps (2 A and 2 B tiles, 4 products each), C back to acc.
// Measured on one Sapphire Rapids core (2-core VM, one thread): tile loads
// are fast from L1 and slow from L2 (a KB per 16-25 ns, against ~8 ns from
// L1), so the panel must stay in L1 across the row groups: K blocks of 256
// gave 1.1-1.2x the unblocked loop at K = 1536-2048, the same at K = 576.
// K is cut into equal blocks, each block's C round trip amortised over as
// many k-steps as the L1 allows: at K = 576, two blocks of 288 instead of
// 256 + 256 + 64 ran SmolLM2's M = 2048 projections 4-8% faster (2 threads,
// builds alternating in one process); at K = 1536 both rules give 6 x 256,
// and blocks of 288 + ... + 96 there were 2% slower, of 384 10% slower.
// The A tiles of a block are each used by one k-step's two products and
// not again until the next panel, by when the L1 has cycled, so they are
// loaded with the streaming hint (TILELOADDT1), which keeps them from
// evicting the panel: measured, SmolLM2's projections, 2 threads,
// alternating builds: 1.05-1.1x at M = 64-128, 1.1-1.2x at 512-2048 (M =
// 2048: 5.80 -> 5.27 ms for the four; the hint on the weight's tiles in the
// streaming case below: no gain). With the output's stores left out (a
// timing hack) the four took 4.41 ms (4.92 without the hint): at 2048 rows
// the stores, each output line a miss to L3, cost ~15%, and prefetching
// those lines (into L1 or L2, or PREFETCHW), writing them between the next
// call's k-steps, or past the caches, gained nothing. Measured alone with
// random data (a C++ micro-benchmark, one core), this 2x2 loop runs at
// 64-73% of the in-register rate with both operands in L1 and ~60% with A
// from L2; the order of its loads and products (five tried) does not matter.
// Tried and dropped: double-buffered 16 x 32 tiles (the loads of one step
// overlapping the products of the other: 1.7x in a loop with everything in
// L1, no better inside the GEMM) and software prefetch of the A tiles (0.9x).
// Up to 16 rows, few() below (two panels a call, the tiles configured to the
// rows). Up to 32 rows (small batches: one row group, so the
// panel is read once per call, from memory in a model's forward) the panel
// streams instead: the next k-step's 2 KB prefetched, and no K blocks, since
// each block's C round trip through acc (a tile load waits for the tile
// store before it, which waits for the block's last product) drains the
// loads in flight. Measured, M = 32, SmolLM2's 30 layers' projections and
// lm_head cycled (269 MB, cold), 2 threads: 15.4 -> 14.3 ms (18 -> 19.7
// GB/s); prefetch alone 1.05x, no blocks alone 1.07x; in the engine, W2
// (32 sequences decoding) 781 -> 843-866 tok/s, batch-1 decode 1.04x. A
// weight that stays in L2 between calls loses (gate_up at M = 32 hot:
// 55 -> 67 us, still 2.3x torch's linear), which a forward never sees;
// from 33 rows on, streaming was slower (M = 64 cold pass 18.8 -> 19.2 ms).
// With two row tiles (17-32 rows) the stream also runs 16 KB ahead into L2
// (one prefetch per 256 bytes; the L2's own prefetchers fill in): a tile
// load that misses holds up the tile loads behind it and, through the
// tiles they fill, the products, and at M = 32 the A tile loads between the
// weight's left the weight further behind. Measured on this Sapphire Rapids
// (2 threads): a bare 273 MB panel stream at M = 32 23.5-24.5 -> 26.8-27.7
// GB/s (tile loads alone: 35-37); engine decode steps of 32 sequences
// 27.2-29.1 -> 26.4-27.6 ms. At M = 1 the same prefetch cost batch-1 decode
// 5-10%, so one row tile keeps the one-step prefetch.
// The k-steps run in the same order for every row count and C passes
// through f32 memory exactly, so a row's result does not depend on its
// batch; K not a multiple of 32 takes the type's register tile
// (AmxDot::Fallback) for every row count instead. The C++ tests run it on the
// software tile model (emulation/amx_emulation.h); the f16 tile was never
// run on an AMX-FP16 CPU (none at hand).
template <typename T>
struct AmxTiles {
    using Dot = AmxDot<T>;
    using Fallback = typename Dot::Fallback;
    static constexpr int kPair = 2;
    static constexpr const char *kName = Dot::kName;
    using X = T;
    static constexpr bool kPairOrder = false;
    static constexpr int kMaxRows = 128;  // the driver's acc holds 128 rows x 32 columns
    static constexpr int kRowPad = 16;
    static constexpr bool kCopyX = true;
    static constexpr int64_t kChunkBytes = 768 * 1024;  // x per row chunk: the panels stream from L3 once per chunk (2 MB L2); 1.05-1.2x over 192 KB at M = 2048
    static constexpr int64_t kKBlock = 288;  // most k per block: 18 KB of panel, 9 KB of each A row group
    // K (a multiple of 32) in the fewest equal blocks of at most kKBlock, in whole k-steps.
    static int64_t k_block(int64_t K) {
        const int64_t n = (K + kKBlock - 1) / kKBlock;
        return (K / 32 + n - 1) / n * 32;
    }
    // Up to 16 rows take two panels a call (few()); more, one.
    static int panels(int mr) { return mr <= 16 ? 2 : 1; }

    // The rows of tiles 0-4 in this thread's configuration: 16 (x86::full_tiles, loaded by begin()) or a
    // few-row call's count (x86::row_tiles). A row's products do not depend on the tile's other rows.
    static int &config_rows() {
        thread_local int rows = 16;
        return rows;
    }
    static void use_rows(int rows) {
        if (config_rows() == rows) return;
        x86::load_tile_config(x86::row_tiles(rows));
        config_rows() = rows;
    }

    // Our tile configuration, loaded per thread before a run of calls (see x86::load_tile_config).
    static void begin() {
        x86::load_tile_config(x86::full_tiles());
        config_rows() = 16;
    }
    static void end() { x86::release_tiles(); }

    // Up to 16 rows (a decode step, a small batch), np (1 or 2) panels: the tiles configured to mr rows,
    // C tiles 0-1 (panel 0) and 2-3 (panel 1), x in tile 4, the weight's four B tiles a k-step through
    // tiles 5-7 (the fourth reloads 5 once its product has read it). Each column's sums are the same
    // chain of k-steps from zero as in run()'s row groups, so the bits are those of any other row count.
    // Measured on this Sapphire Rapids (one thread, SmolLM2's gate_up [3072, 576] x 100 copies on huge
    // pages, cycled: read from memory; alternating processes, three rounds): the 16-row one-panel loop
    // below 303-310 us a call, this 266-278, VDPBF16PS's four-panel register tile (avx512bf16) 233-243.
    // Rows configured to mr or left at 16: no difference there (the stream bounds it); in L2, one row
    // ran 1.5x the 16-row tile in a micro-benchmark. More prefetch (4 KB ahead, or the next call's panels
    // into L2) gained nothing.
    static void few(int mr, int np, const T *x, const T *w, int64_t ps, int64_t K, float *acc) {
        use_rows(mr);
        const int64_t cs = int64_t(np) * 32 * int64_t(sizeof(float));  // acc's row stride: np panels a row
        x86::tile_zero<0>();
        x86::tile_zero<1>();
        if (np == 2) {
            x86::tile_zero<2>();
            x86::tile_zero<3>();
        }
        for (int64_t k = 0; k < K; k += 32) {
            const T *w0 = w + k * 32, *w1 = w0 + ps;  // 16 k-pairs x 32 columns x 2 of each panel
            prefetch_stream(w0, 2048);
            x86::tile_load<4>(x + k * 16, 64);
            x86::tile_load<5>(w0, 128);
            Dot::template dp<0, 4, 5>();
            x86::tile_load<6>(w0 + 32, 128);
            Dot::template dp<1, 4, 6>();
            if (np == 2) {
                prefetch_stream(w1, 2048);
                x86::tile_load<7>(w1, 128);
                Dot::template dp<2, 4, 7>();
                x86::tile_load<5>(w1 + 32, 128);
                Dot::template dp<3, 4, 5>();
            }
        }
        x86::tile_store<0>(acc, cs);
        x86::tile_store<1>(acc + 16, cs);
        if (np == 2) {
            x86::tile_store<2>(acc + 32, cs);
            x86::tile_store<3>(acc + 48, cs);
        }
    }

    // K % 32 == 0: x in 16-row tiles, [group][k / 32][16 rows][32 k] (the
    // returned stride K puts group r / 16 at x + r * K); else row-major for
    // the fallback tile.
    static int64_t pack_x(T *dst, int64_t ds, const T *x, int64_t xs, int64_t rows, int64_t padded, int64_t K) {
        if (K % 32 != 0) return RegisterTiles<Fallback>::pack_x(dst, ds, x, xs, rows, padded, K);
        const __m512i zero = _mm512_setzero_si512();
        for (int64_t g = 0; g < padded; g += 16) {
            T *tile = dst + g * K;
            for (int64_t k = 0; k < K; k += 32, tile += 512)
                for (int64_t r = 0; r < 16; ++r)
                    _mm512_storeu_si512(tile + r * 32, g + r < rows ? _mm512_loadu_si512(x + (g + r) * xs + k) : zero);
        }
        return K;
    }

    // acc[(r * np + q) * 32 + j] for r < mr (<= 128), panel q < np (2 only up to 16 rows: few()), j < 32.
    static void run(int mr, int np, const T *x, int64_t xs, const T *w, int64_t ps, int64_t K, float *acc) {
        if (K % 32 != 0) {  // panel by panel (np is 2 only up to 16 rows), into acc's rows of np panels
            alignas(64) float one[128 * 32];
            for (int q = 0; q < np; ++q) {
                for (int r0 = 0; r0 < mr; r0 += Fallback::kMaxRows)
                    Fallback::run(std::min(Fallback::kMaxRows, mr - r0), 1, x + r0 * xs, xs, w + q * ps, ps, K,
                                  np == 1 ? acc + r0 * 32 : one + r0 * 32);
                if (np > 1)
                    for (int r = 0; r < mr; ++r) std::memcpy(acc + (r * np + q) * 32, one + r * 32, 32 * sizeof(float));
            }
            return;
        }
        if (mr <= 16) return few(mr, np, x, w, ps, K, acc);
        use_rows(16);
        const bool stream = mr <= 32;  // one row group: the panel comes from memory, once (see above)
        const int64_t kb = stream ? K : k_block(K);
        for (int64_t k0 = 0; k0 < K; k0 += kb) {
            const int64_t k1 = std::min(K, k0 + kb);
            for (int g = 0; g < mr; g += 32) {
                const bool two = g + 16 < mr;
                float *c = acc + g * 32;
                if (k0 == 0) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else {
                    _tile_loadd(0, c, 128);
                    _tile_loadd(1, c + 16, 128);
                    if (two) {
                        _tile_loadd(2, c + 16 * 32, 128);
                        _tile_loadd(3, c + 16 * 32 + 16, 128);
                    }
                }
                const T *a0 = x + g * K, *a1 = x + (g + 16) * K;  // one KB per k-step each
                for (int64_t k = k0; k < k1; k += 32) {
                    const T *wk = w + k * 32;  // 16 k-pairs x 32 columns x 2
                    if (stream) {
                        prefetch_stream(wk, 2048);
                        if (two) {  // 17-32 rows: also 8 k-steps ahead into L2, a line in four (see above)
                            const char *ahead = reinterpret_cast<const char *>(wk) + 8 * 2048;
                            for (int o = 0; o < 2048; o += 256) _mm_prefetch(ahead + o, _MM_HINT_T2);
                        }
                    }
                    if (stream) _tile_loadd(4, a0 + k * 16, 64);
                    else _tile_stream_loadd(4, a0 + k * 16, 64);  // used once here: kept out of the panel's L1 (above)
                    _tile_loadd(6, wk, 128);
                    Dot::template dp<0, 4, 6>();
                    _tile_loadd(7, wk + 32, 128);
                    Dot::template dp<1, 4, 7>();
                    if (two) {
                        if (stream) _tile_loadd(5, a1 + k * 16, 64);
                        else _tile_stream_loadd(5, a1 + k * 16, 64);
                        Dot::template dp<2, 5, 6>();
                        Dot::template dp<3, 5, 7>();
                    }
                }
                _tile_stored(0, c, 128);
                _tile_stored(1, c + 16, 128);
                if (two) {
                    _tile_stored(2, c + 16 * 32, 128);
                    _tile_stored(3, c + 16 * 32 + 16, 128);
                }
            }
        }
    }

    // Four independent tile-product chains (16 x 16 x 32 multiply-adds each).
    static int64_t peak(int64_t iters, float *sink) {
        alignas(64) static const uint16_t zeros[16 * 32] = {};
        alignas(64) float c[16 * 16];
        begin();
        _tile_zero(0);  // tile numbers are immediates: no loop
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, zeros, 64);
        _tile_loadd(5, zeros, 64);
        _tile_loadd(6, zeros, 64);
        _tile_loadd(7, zeros, 64);
        for (int64_t it = 0; it < iters; ++it) {
            Dot::template dp<0, 4, 6>();
            Dot::template dp<1, 4, 7>();
            Dot::template dp<2, 5, 6>();
            Dot::template dp<3, 5, 7>();
        }
        _tile_stored(0, c, 64);
        end();
        *sink = c[0];
        return iters * 4 * 16 * 16 * 32;
    }
};

template <>
struct PanelKernel<bf16_t> : AmxTiles<bf16_t> {};

// f16 on amx: the AMX-FP16 tile where the CPU has it, else the portable tile
// (kPair 1; Sapphire Rapids has no AMX-FP16).
template <>
struct KernelChoice<f16_t> {
    template <typename F>
    static void with(F &&f) {
        if (x86::has_amx_fp16()) f(static_cast<AmxTiles<f16_t> *>(nullptr));
        else f(static_cast<PanelKernel<f16_t> *>(nullptr));
    }
};
#else
template <>
struct PanelKernel<bf16_t> : DpBf16Tiles {};
#endif

}  // namespace cpuinfer::panel

#endif
