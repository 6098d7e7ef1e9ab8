// The linear layer on a quantized weight (QuantMatrix, kernels.h): one kernel
// for decode (weights streamed once) and prefill (a register-tiled GEMM), as
// the bf16 packed kernel (linear_packed.cpp) is.
//
// x is quantized once per call: each row, per block of 32 k, to int8 with one
// f32 scale (quant_tile.h). Then tasks (row chunk, panel) go to the threads
// chunk-major, so a decode step splits over panels (each thread reads its
// share of the weight once) and a long prefill splits over rows. Inside a task
// the chunk's rows go through the tile in even groups of at most kMaxRows.
//
// The weight is never dequantized: its integer values meet the int8
// activations in the variant's integer dot product (VPDPBUSD on AVX512-VNNI,
// USDOT / SDOT on Arm; quant_tile.h lists the tiles), which reads a 4-bit
// weight as a quarter of the bytes of bf16.
//
// Weight-only formats (w.act16: GPTQ, AWQ, compressed-tensors W4A16 / W8A16)
// keep x in its own type instead: the same driver runs a tile that widens each
// block of the weight where the rows use it (quant_wide.h), on x as it lies
// (or gathered through the perm, or widened to the tile's type).
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "aligned.h"
#include "dispatch_dtype.h"
#include "kernels.h"
#include "linear_packed.h"
#include "parallel.h"
#include "quant_tile.h"
#include "vec.h"

namespace cpuinfer {
namespace {

using quant::block_bytes;
using quant::kBlock;
using quant::kLanes;


// One block's int8 values from its f32 values already rounded (r), and the
// block's entries of dx / sx / s16 (see quant_tile.h).
inline void store_block(const float *r, float d, int8_t *qb, float *dx, float *sx, int32_t *s16) {
    int32_t half[2] = {0, 0};
    for (int h = 0; h < 2; ++h)
        for (int k = 16 * h; k < 16 * h + 16; ++k) {
            qb[k] = int8_t(r[k]);
            half[h] += int32_t(r[k]);
        }
    *dx = d;
    *sx = d * float(half[0] + half[1]);
    s16[0] = half[0];
    s16[1] = half[1];
}

// Row x [K] -> q [K], dx / sx [K / 32], s16 [K / 16] (see quant_tile.h): per
// block, d = amax / 127 and q = round(x / d) (to nearest, ties to even)
// clamped to +-127. Vector lanes and the scalar tail round the same way, and
// the block's max and integer sums do not depend on their order, so every
// layer gives the same bytes. A block holding inf or NaN gets d = NaN and
// q = 0: its products become NaN, as torch's would be NaN or inf.
template <typename T>
void quantize_row(const T *x, int64_t K, int8_t *q, float *dx, float *sx, int32_t *s16) {
    const int W = vec::width();
    const bool lanes = W <= kBlock && kBlock % W == 0;
    alignas(64) float r[kBlock];
    for (int64_t b = 0; b < K / kBlock; ++b) {
        const T *xb = x + b * kBlock;
        float amax = 0.0f;
        bool finite = true;
        if (lanes) {
            vec::vf m = vec::zero(), nonfinite = vec::zero();
            for (int k = 0; k < kBlock; k += W) {
                const vec::vf v = vec::load(xb + k);
                m = vec::max(m, vec::abs(v));
                nonfinite = vec::add(nonfinite, vec::sub(v, v));  // NaN in a lane once inf or NaN was seen
            }
            amax = vec::reduce_max(m);
            finite = vec::reduce_add(nonfinite) == 0.0f;
        } else {
            for (int k = 0; k < kBlock; ++k) {
                const float v = to_f32(xb[k]);
                amax = std::max(amax, std::fabs(v));
                finite = finite && std::isfinite(v);
            }
        }
        int8_t *qb = q + b * kBlock;
        if (!finite) {
            for (int k = 0; k < kBlock; ++k) r[k] = 0.0f;
            store_block(r, std::numeric_limits<float>::quiet_NaN(), qb, dx + b, sx + b, s16 + 2 * b);
            continue;
        }
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        if (lanes) {
            const vec::vf vid = vec::splat(id), hi = vec::splat(127.0f), lo = vec::splat(-127.0f);
            for (int k = 0; k < kBlock; k += W)
                vec::store(r + k, vec::min(hi, vec::max(lo, vec::round(vec::mul(vec::load(xb + k), vid)))));
        } else {
            for (int k = 0; k < kBlock; ++k)
                r[k] = std::min(127.0f, std::max(-127.0f, std::nearbyint(to_f32(xb[k]) * id)));
        }
        store_block(r, d, qb, dx + b, sx + b, s16 + 2 * b);
    }
}

// x [M, K] quantized (the caller's thread pool splits the rows), in the
// weight's k order: with a perm, each row is first gathered through it, so
// the blocks of 32 are those of the packed weight and the quantization is
// still one function of the row alone (batch invariant, the same bits on
// every variant).
struct QuantizedX {
    LineVector<int8_t> q;  // cache-line aligned (aligned.h): AMX-INT8 reads its rows as tiles
    LineVector<float> dx, sx;
    LineVector<int32_t> s16;
    quant::QuantRows rows{};

    template <typename T>
    QuantizedX(const T *x, int64_t xs, int64_t M, int64_t K, const int32_t *perm) {
        const int64_t nb = K / kBlock, padded = M + quant::kTileReadRows;  // zero rows after the last
        q.resize(size_t(padded * K));
        dx.resize(size_t(padded * nb));
        sx.resize(size_t(padded * nb));
        s16.resize(size_t(padded * 2 * nb));
        const int64_t grain = std::max<int64_t>(1, 16384 / K);
        parallel_for(M, grain, [&](int64_t b, int64_t e) {
            std::vector<T> gathered(perm ? size_t(K) : 0);
            for (int64_t r = b; r < e; ++r) {
                const T *row = x + r * xs;
                if (perm) {
                    for (int64_t k = 0; k < K; ++k) gathered[size_t(k)] = row[perm[k]];
                    row = gathered.data();
                }
                quantize_row(row, K, q.data() + r * K, dx.data() + r * nb, sx.data() + r * nb,
                             s16.data() + r * 2 * nb);
            }
        });
        rows = {q.data(), dx.data(), sx.data(), s16.data(), K, nb};
    }
};

// Sum of n values of x in f32, in one fixed order (vector lanes, then their reduction, where n is whole vectors).
template <typename X>
float row_sum(const X *x, int64_t n) {
    const int W = vec::width();
    if (n % W == 0) {
        vec::vf s = vec::zero();
        for (int64_t k = 0; k < n; k += W) s = vec::add(s, vec::load(x + k));
        return vec::reduce_add(s);
    }
    float s = 0.0f;
    for (int64_t k = 0; k < n; ++k) s += to_f32(x[k]);
    return s;
}

// x [M, K] for a 16-bit-activation tile (quant_wide.h): the rows in the tile's type X, copied only where x is
// not that already (another type, or a perm to gather through), and per group the f32 sum of each row's x if
// the tile needs it. Each is a function of its row alone.
template <typename X>
struct WideX {
    LineVector<X> copy;
    LineVector<float> sums;
    quant::WideRows<X> rows{};

    template <typename T>
    WideX(const T *x, int64_t xs, int64_t M, int64_t K, const int32_t *perm, int64_t group, bool with_sums) {
        const bool own = perm || !std::is_same_v<X, T>;
        const int64_t groups = K / group;
        if (own) copy.resize(size_t(M * K));
        if (with_sums) sums.resize(size_t(M * groups));
        const int64_t grain = std::max<int64_t>(1, 16384 / K);
        parallel_for(M, grain, [&](int64_t b, int64_t e) {
            for (int64_t r = b; r < e; ++r) {
                const T *row = x + r * xs;
                const X *xr = nullptr;
                if (own) {
                    X *c = copy.data() + r * K;
                    for (int64_t k = 0; k < K; ++k) c[k] = from_f32<X>(to_f32(row[perm ? perm[k] : k]));
                    xr = c;
                } else if constexpr (std::is_same_v<X, T>) {
                    xr = row;
                }
                if (with_sums)
                    for (int64_t g = 0; g < groups; ++g) sums[size_t(r * groups + g)] = row_sum(xr + g * group, group);
            }
        });
        const X *base = own ? copy.data() : nullptr;
        if constexpr (std::is_same_v<X, T>) base = own ? base : x;
        rows = {base, with_sums ? sums.data() : nullptr, own ? K : xs, groups};
    }
};

int64_t groups_of(const QuantMatrix &w) { return w.K / w.group; }

// Up to this many rows, several row chunks share each panel pass (see run).
constexpr int64_t kPanelMajorRows = 64;

quant::QuantPanel panel(const QuantMatrix &w, int64_t p) {
    const int64_t blocks = w.K / kBlock, groups = groups_of(w), at = p * groups * kLanes;
    return {w.qs + p * blocks * block_bytes(w.bits), w.d + at, w.z ? w.z + at : nullptr, w.m ? w.m + at : nullptr,
            blocks, w.group >= kBlock ? w.group / kBlock : 0};
}

// O: the output's type, T or float (unrounded sums, out_f32). Rows: quant::QuantRows (int8 x) or
// quant::WideRows (16-bit x), as the tile reads them.
template <typename Tile, typename Rows, typename T, typename O>
void run(O *out, int64_t os, const Rows &x, const QuantMatrix &w, const T *bias, int64_t M) {
    static_assert(Tile::kMaxRows <= 16, "acc below holds 16 rows");
    const int64_t panels = quant_panels(w.N), K = w.K, MR = Tile::kMaxRows;
    const int64_t chunk = row_chunk(M, K * Rows::kElemBytes, MR, Tile::kChunkBytes), chunks = (M + chunk - 1) / chunk;
    const int64_t tasks = chunks * panels;
    // A decode batch of a few row chunks (the amx tile's are 16 rows: two at M = 32) goes panel-major: a
    // thread takes each of its panels through every chunk, so the weight streams once per call, not once
    // per chunk (chunk-major, each thread would read the whole weight for its own chunk). Measured on
    // Sapphire Rapids, 2 threads, SmolLM2 Q4_1, 32 sequences decoding: 36.1 -> 33.9 ms a step.
    const bool panel_major = chunks > 1 && M <= kPanelMajorRows;
    // At least ~64K multiply-adds per thread, so that small projections do not wake the team.
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (kLanes * K * std::min<int64_t>(chunk, 64)));
    parallel_for(tasks, grain, [&](int64_t b, int64_t e) {
        alignas(64) float acc[16 * kLanes];
        Tile::begin();
        for (int64_t t = b; t < e; ++t) {
            const int64_t c = panel_major ? t % chunks : t / panels, p = panel_major ? t / chunks : t % panels;
            const int64_t m_begin = c * chunk, rows = std::min(chunk, M - m_begin);
            if (rows <= 0) continue;
            const quant::QuantPanel wp = panel(w, p);
            const int64_t n0 = p * kLanes, nn = std::min<int64_t>(kLanes, w.N - n0);
            const int64_t groups = (rows + MR - 1) / MR, per = (rows + groups - 1) / groups;
            for (int64_t r0 = 0; r0 < rows; r0 += per) {
                const int mr = int(std::min(per, rows - r0));
                const int64_t m0 = m_begin + r0;
                Tile::run(mr, x.from(m0), wp, acc);
                for (int r = 0; r < mr; ++r) {
                    O *o = out + (m0 + r) * os + n0;
                    const float *a = acc + r * kLanes;
                    if (bias) {
                        for (int64_t f = 0; f < nn; ++f) o[f] = from_f32<O>(a[f] + to_f32(bias[n0 + f]));
                    } else {
                        for (int64_t f = 0; f < nn; ++f) o[f] = from_f32<O>(a[f]);
                    }
                }
            }
        }
        Tile::end();
    });
}

// Calls f(Tile) with the tile type for w's bits, form and group. The forms
// built are those the formats bring (quant_form_supported): every form at 4
// and 8 bits, zero points or minimums at 5 (Q5_0, Q5_1, Q5_K), group 16 with
// zero points at 6 (Q6_K), and MXFP4's codes.
template <typename F>
void with_tile(const QuantMatrix &w, F &&f) {
    const bool g16 = w.group == 16, has_min = w.m != nullptr;
    if (w.fp4) return f(quant::Tile<4, false, false, true>{});
    switch (w.bits) {
        case 4:
            if (g16) f(quant::Tile<4, false, true>{});
            else if (has_min) f(quant::Tile<4, true, false>{});
            else f(quant::Tile<4, false, false>{});
            break;
        case 5:
            if (has_min) f(quant::Tile<5, true, false>{});
            else f(quant::Tile<5, false, false>{});
            break;
        case 6: f(quant::Tile<6, false, true>{}); break;
        default:
            if (g16) f(quant::Tile<8, false, true>{});
            else if (has_min) f(quant::Tile<8, true, false>{});
            else f(quant::Tile<8, false, false>{});
            break;
    }
}

// Calls f(Tile) with the 16-bit-activation tile for a run of type T and w's bits and form (4 or 8 bits, zero
// points or minimums, groups of 32 or more: quant_form_supported with act16).
template <typename T, typename F>
void with_wide_tile(const QuantMatrix &w, F &&f) {
    const bool has_min = w.m != nullptr;
    if (w.bits == 4) {
        if (has_min) f(quant::Wide<T, 4, true>{});
        else f(quant::Wide<T, 4, false>{});
    } else {
        if (has_min) f(quant::Wide<T, 8, true>{});
        else f(quant::Wide<T, 8, false>{});
    }
}

}  // namespace

void quant_linear(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const QuantMatrix &w,
                  const void *bias, int64_t M, bool out_f32) {
    if (M <= 0 || w.N <= 0) return;
    with_float_types(dt, out_f32, [&](auto tag, auto out_tag) {
        using T = decltype(tag);
        using O = decltype(out_tag);
        if (w.act16) {
            with_wide_tile<T>(w, [&](auto tile) {
                using Tile = decltype(tile);
                const WideX<typename Tile::X> xw(static_cast<const T *>(x), x_stride, M, w.K, w.perm, w.group,
                                                 Tile::kSums);
                run<Tile>(static_cast<O *>(out), out_stride, xw.rows, w, static_cast<const T *>(bias), M);
            });
            return;
        }
        const QuantizedX xq(static_cast<const T *>(x), x_stride, M, w.K, w.perm);
        with_tile(w, [&](auto tile) {
            run<decltype(tile)>(static_cast<O *>(out), out_stride, xq.rows, w, static_cast<const T *>(bias), M);
        });
    });
}

bool quant_form_supported(int bits, int64_t group, bool has_min, bool act16, bool fp4) {
    if (fp4) return bits == 4 && group == kBlock && !has_min && !act16;
    if (act16) return (bits == 4 || bits == 8) && group >= kBlock && group % kBlock == 0;
    switch (bits) {
        case 4:
        case 8: return true;
        case 5: return group != 16;
        case 6: return group == 16 && !has_min;
        default: return false;
    }
}

void quant_pack(const QuantMatrix &s, const uint8_t *u, const f16_t *d, const uint8_t *z, const f16_t *m,
                uint8_t *qs_out, f16_t *d_out, uint8_t *z_out, f16_t *m_out) {
    const int64_t N = s.N, K = s.K, panels = quant_panels(N), blocks = K / kBlock, groups = K / s.group;
    const int64_t bb = block_bytes(s.bits);
    quant::with_bits(s.bits, [&](auto bits) {
        constexpr int Bits = decltype(bits)::value;
        parallel_for(panels, 4, [&](int64_t pb, int64_t pe) {
            alignas(64) uint8_t v[kLanes][kBlock];
            for (int64_t p = pb; p < pe; ++p) {
                for (int64_t b = 0; b < blocks; ++b) {
                    for (int f = 0; f < kLanes; ++f) {
                        const int64_t n = p * kLanes + f;
                        for (int k = 0; k < kBlock; ++k) v[f][k] = n < N ? u[n * K + b * kBlock + k] : 0;
                    }
                    quant::pack_block<Bits>(v, qs_out + (p * blocks + b) * bb);
                }
                for (int64_t g = 0; g < groups; ++g) {
                    for (int f = 0; f < kLanes; ++f) {
                        const int64_t n = p * kLanes + f, at = (p * groups + g) * kLanes + f;
                        const bool in = n < N;
                        if (d_out) d_out[at] = in ? d[n * groups + g] : f16_t{0};
                        if (z_out) z_out[at] = in ? z[n * groups + g] : 0;
                        if (m_out) m_out[at] = in ? m[n * groups + g] : f16_t{0};
                    }
                }
            }
        });
    });
}

void quant_rows(DType dt, void *out, int64_t out_stride, const QuantMatrix &w, const int64_t *ids, int64_t n) {
    const int64_t blocks = w.K / kBlock, groups = groups_of(w), bb = block_bytes(w.bits);
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        parallel_for(n, 16, [&](int64_t b0, int64_t e0) {
            alignas(64) uint8_t u[kLanes][kBlock];
            for (int64_t i = b0; i < e0; ++i) {
                const int64_t p = ids[i] / kLanes, f = ids[i] % kLanes;
                T *o = static_cast<T *>(out) + i * out_stride;
                for (int64_t b = 0; b < blocks; ++b) {
                    quant::with_bits(w.bits, [&](auto bits) {
                        quant::unpack_block<decltype(bits)::value>(w.qs + (p * blocks + b) * bb, u);
                    });
                    for (int k = 0; k < kBlock; ++k) {
                        const int64_t g = (b * kBlock + k) / w.group, at = (p * groups + g) * kLanes + f;
                        float v;
                        if (w.fp4) {
                            v = quant::fp4_scale(w.z[at]) * float(int32_t(quant::kFp4U[u[f][k]]) - quant::kFp4Zero);
                        } else {
                            const float d = to_f32(w.d[at]);
                            v = w.z ? d * float(int32_t(u[f][k]) - int32_t(w.z[at])) : d * float(u[f][k]) + to_f32(w.m[at]);
                        }
                        const int64_t kk = b * kBlock + k;
                        o[w.perm ? w.perm[kk] : kk] = from_f32<T>(v);
                    }
                }
            }
        });
    });
}

const char *quant_tile_impl() { return quant::Tile<4, false, false>::kName; }

const char *quant_wide_impl(DType dt) {
    const char *name = "";
    with_float_type(dt, [&](auto tag) { name = quant::Wide<decltype(tag), 4, false>::kName; });
    return name;
}

}  // namespace cpuinfer
