// What the x86 bf16 fast paths share (paged attention's tiles and the packed
// linear's): the __m512bh view of a register, and loading an AMX tile
// configuration. Under CPUINFER_SIMDE_EMULATION the same code runs on SIMDe
// and on the software model of the AMX tiles (emulation/amx_emulation.h).
#pragma once
#include <array>
#include <cstdint>
#include <cstring>

#include "../common/vec.h"
#if defined(__AMX_BF16__) || defined(CPUINFER_SIMDE_AMX)
#if defined(CPUINFER_SIMDE_EMULATION)
#include "emulation/amx_emulation.h"
#else
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace cpuinfer::x86 {

#if defined(__AVX512BF16__) || defined(CPUINFER_SIMDE_AVX512BF16)
inline __m512bh as_bh(__m512i x) {
#if defined(CPUINFER_SIMDE_EMULATION)
    __m512bh r;
    std::memcpy(&r, &x, sizeof r);
    return r;
#else
    return (__m512bh)x;
#endif
}
#endif

#if defined(__AMX_BF16__) || defined(CPUINFER_SIMDE_AMX)
// The 64-byte operand of ldtilecfg (palette 1).
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Loads a tile configuration on this thread. Callers load theirs before each
// run of tile work: other AMX code (oneDNN's GEMMs included) runs on the same
// OpenMP threads in between and leaves its own. The asm operand covers the
// whole struct, so the compiler cannot drop any of its stores (GCC 12 can with
// the _tile_loadconfig intrinsic, see DESIGN.md).
inline void load_tile_config(const TileConfig &cfg) {
#if defined(CPUINFER_SIMDE_EMULATION)
    amx_emu::load_config(&cfg, sizeof cfg);
#else
    // The OS must grant the tile data state once per process; the dispatcher
    // asks before importing the variant, and asking again (once per thread) is harmless.
    thread_local bool granted = [] {
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }();
    (void)granted;
    asm volatile("ldtilecfg %0" ::"m"(cfg));
#endif
}

// Tiles 0-4 of `rows` rows (C and A tiles of a few-row product), 5-7 16 x 64 bytes (B); 64 bytes a row.
inline const TileConfig &row_tiles(int rows) {
    static const auto cfgs = [] {
        std::array<TileConfig, 17> all;
        for (int m = 1; m <= 16; ++m) {
            TileConfig &c = all[m];
            std::memset(&c, 0, sizeof c);
            c.palette = 1;
            for (int t = 0; t < 8; ++t) c.rows[t] = uint8_t(t < 5 ? m : 16), c.colsb[t] = 64;
        }
        return all;
    }();
    return cfgs[rows];
}

// The one configuration both AMX paths use: all eight tiles 16 rows x 64 bytes.
inline const TileConfig &full_tiles() { return row_tiles(16); }

// AMX-FP16 (TDPFP16PS; Granite Rapids on): CPUID.(EAX=7, ECX=1):EAX bit 21.
// The tile state is the one the amx variant already holds the OS grant for.
// The software model has it, so the C++ tests run the f16 tile on SIMDe.
inline bool has_amx_fp16() {
#if defined(CPUINFER_SIMDE_EMULATION)
    return true;
#else
    static const bool has = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        // Leaf 7 subleaf 0's EAX is the last subleaf; subleaf 1 exists from 1 on.
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || a < 1) return false;
        return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 21) & 1);
    }();
    return has;
#endif
}

// TDPBF16PS with tile numbers as template arguments: GCC's _tile_* macros
// paste their arguments into the asm text, so they cannot take template
// constants.
template <int C, int A, int B>
inline void tdpbf16ps() {
#if defined(CPUINFER_SIMDE_EMULATION)
    _tile_dpbf16ps(C, A, B);
#else
    asm volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" ::"i"(B), "i"(A), "i"(C));
#endif
}

// TILEZERO, TILELOADD and TILESTORED with the tile number as a template argument (as above).
template <int T>
inline void tile_zero() {
#if defined(CPUINFER_SIMDE_EMULATION)
    _tile_zero(T);
#else
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
#endif
}
template <int T>
inline void tile_load(const void *p, int64_t stride) {
#if defined(CPUINFER_SIMDE_EMULATION)
    _tile_loadd(T, p, stride);
#else
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(p), "r"(stride), "i"(T) : "memory");
#endif
}
template <int T>
inline void tile_store(void *p, int64_t stride) {
#if defined(CPUINFER_SIMDE_EMULATION)
    _tile_stored(T, p, stride);
#else
    asm volatile("tilestored %%tmm%c0, (%1,%2,1)" ::"i"(T), "r"(p), "r"(stride) : "memory");
#endif
}

inline void release_tiles() {
#if !defined(CPUINFER_SIMDE_EMULATION)
    _tile_release();
#endif
}
#endif

}  // namespace cpuinfer::x86
