// The linear layer on a packed weight: one kernel for decode (a few rows, a
// GEMV reading W once) and for prefill and batches (a blocked GEMM).
//
// Layout (linear_pack_weight): output features in panels of
// C = linear_pack_cols() (2 vectors of this build); a panel is K x C elements,
// k-major, each column's kPair consecutive k adjacent (panel_kernel.h). Rows
// past the last full panel stay row-major and take the row-major kernel.
//
// Work: the rows of x are cut into chunks sized so that a chunk of x stays in
// L2 while the weight panels pass by; a task is (row chunk, panel), ordered
// chunk-major, and parallel_for hands each thread one contiguous run of
// tasks. So a long prefill splits over rows (each thread keeps its own x in
// its L2 and reads the small weight from L3), a short batch or a decode step
// splits over panels (each thread reads half of W once). Inside a task the
// chunk's rows go through the register tile in even groups of at most
// kMaxRows rows; the panel stays in L1/L2 between groups.
//
// Determinism and batch invariance: every output element is the same chain
// of multiply-adds in k order, one f32 rounding to the output type at the
// end, whatever M, the chunking, the grouping or the thread count; so a row's
// result does not depend on the batch it was computed in (the engine's greedy
// outputs rely on that; tests/kernels/test_linear.py checks it across the
// decode/prefill sizes).
#include "linear_packed.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "activation.h"
#include "aligned.h"
#include "dispatch_dtype.h"
#include "panel_kernel.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

constexpr int kMaxLanes = 64;                // f32 lanes of the widest vector (SVE 2048-bit)

// O: the output's type, T or float (unrounded sums, linear()'s out_f32; with
// `rounded`, the sums rounded to T and widened back).
// Act >= 0 (an Activation; O is T): a gated MLP's gate and up projections at
// once (linear_glu). `panels` are then the gate's, each with its up panel
// `up` panels further on in w, and out[m, n] = act(gate) * up for the pair.
template <typename Kernel, typename T, typename O, int Act = -1>
void run(O *out, int64_t os, const T *x, int64_t xs, const T *w, const T *bias, int64_t M, int64_t panels,
         int64_t K, int64_t up = 0, bool rounded = false) {
    constexpr bool kGlu = Act >= 0;
    using X = typename Kernel::X;
    const int W = vec::width();
    const int64_t C = 2 * int64_t(W), MR = Kernel::kMaxRows;
    const int64_t chunk = row_chunk(M, K * int64_t(sizeof(T)), MR, Kernel::kChunkBytes), tasks = (M + chunk - 1) / chunk * panels;
    // As the row-major GEMV: at least ~64K multiply-adds per thread, so that
    // a decode step's small projections do not pay for waking the team.
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (C * K * std::min<int64_t>(chunk, 64)));
    // x as the tile reads it: widened to f32 for the portable tile; and
    // copied when its rows are a multiple of 4 KB apart, since then the
    // tile's rows fall into one L1 set and evict each other (measured: Gemma 3
    // down, K = 2048, M = 2048: 413 -> 449 GFLOP/s). The copy's rows are
    // one cache line further apart than that.
    const bool copy_x = Kernel::kCopyX || !std::is_same_v<X, T> || (M > 8 && (xs * int64_t(sizeof(T))) % 4096 == 0);
    // The logits (rounded f32 out, written once and read once by the sampler) past the L2 go around the
    // caches: their stores need no read for ownership, and they would only evict the weights' stream.
    // Measured, SmolLM2's lm_head for 32 sequences + argmax: 3.55 -> 3.28 ms. Where every store is aligned,
    // and the tile's lanes are in column order.
    constexpr int64_t kF = int64_t(sizeof(float));
    const bool stream_out = std::is_same_v<O, float> && !Kernel::kPairOrder && rounded &&
                            M * panels * C * kF > (int64_t(2) << 20) &&
                            reinterpret_cast<uintptr_t>(out) % (W * kF) == 0 && (os * kF) % (W * kF) == 0;
    const int64_t line = int64_t(tuning::kCacheLine / sizeof(X));
    int64_t xbs = K + line;
    if ((xbs * int64_t(sizeof(X))) % 4096 == 0) xbs += line;
    parallel_for(tasks, grain, [&](int64_t b, int64_t e) {
        alignas(64) float acc[32 * 2 * kMaxLanes];  // up to 32 slots of (row, panel), or 128 rows of a 32-column panel (amx)
        alignas(64) float bias_f[4 * 2 * kMaxLanes];
        alignas(64) float acc_up[kGlu ? 32 * 2 * kMaxLanes : 1];  // the up panels' sums, as acc
        alignas(64) float bias_up[kGlu ? 4 * 2 * kMaxLanes : 1];
        thread_local LineVector<X> x_copy;  // the row chunk as the tile reads it (see copy_x), aligned for its tiles
        int64_t copied = -1;                 // which chunk x_copy holds
        int64_t copy_stride = xbs;           // its x stride for the kernel (Kernel::pack_x)
        Kernel::begin();
        for (int64_t t = b; t < e; ++t) {
            const int64_t c = t / panels, p = t % panels;
            const int64_t m_begin = c * chunk, rows = std::min(chunk, M - m_begin);
            if (rows <= 0) continue;
            const X *xc = reinterpret_cast<const X *>(x + m_begin * xs);  // X is T unless copy_x
            if (copy_x) {
                if (copied != c) {
                    // Rows up to a multiple of kRowPad, zero (AMX tiles read 16 rows).
                    const int64_t padded = (rows + Kernel::kRowPad - 1) / Kernel::kRowPad * Kernel::kRowPad;
                    if (int64_t(x_copy.size()) < padded * xbs) x_copy.resize(size_t(padded * xbs));
                    copy_stride = Kernel::pack_x(x_copy.data(), xbs, x + m_begin * xs, xs, rows, padded, K);
                    copied = c;
                }
                xc = x_copy.data();
            }
            const int64_t xcs = copy_x ? copy_stride : xs;
            const int64_t groups = (rows + MR - 1) / MR;
            const int64_t per = std::min<int64_t>(MR, ((rows + groups - 1) / groups + Kernel::kRowPad - 1) /
                                                          Kernel::kRowPad * Kernel::kRowPad);
            // Panels side by side: only for one or two rows (then this
            // task's run holds one row chunk, and the next tasks are the next
            // panels of it).
            const int64_t np_max = std::min<int64_t>({Kernel::panels(int(per)), e - t, panels - p});
            const int np = np_max >= 4 ? 4 : np_max >= 2 ? 2 : 1;
            const T *wp = w + p * C * K;
            // A bias in the tile's lane order: panels [p, p + np) at bf + q * C.
            auto lanes_of_bias = [&](const T *b, float *bf) {
                for (int64_t j = 0; j < np * C; j += C) {
                    if constexpr (Kernel::kPairOrder) {
                        vec::store(bf + j, vec::load2a(b + p * C + j));
                        vec::store(bf + j + W, vec::load2b(b + p * C + j));
                    } else {
                        vec::store(bf + j, vec::load(b + p * C + j));
                        vec::store(bf + j + W, vec::load(b + p * C + j + W));
                    }
                }
            };
            if (bias) {
                lanes_of_bias(bias, bias_f);
                if constexpr (kGlu) lanes_of_bias(bias + up * C, bias_up);
            }
            for (int64_t r0 = 0; r0 < rows; r0 += per) {
                const int mr = int(std::min(per, rows - r0));
                const int64_t m0 = m_begin + r0;
                Kernel::run(mr, np, xc + r0 * xcs, xcs, wp, C * K, K, acc);
                if constexpr (kGlu) Kernel::run(mr, np, xc + r0 * xcs, xcs, wp + up * C * K, C * K, K, acc_up);
                for (int r = 0; r < mr; ++r) {
                    for (int q = 0; q < np; ++q) {
                        O *o = out + (m0 + r) * os + (p + q) * C;
                        const float *a = acc + (r * np + q) * C;
                        vec::vf va = vec::load(a), vb = vec::load(a + W);
                        if (bias) {
                            va = vec::add(va, vec::load(bias_f + q * C));
                            vb = vec::add(vb, vec::load(bias_f + q * C + W));
                        }
                        if constexpr (kGlu) {
                            // As the unfused path computes it: gate and up rounded to T (that GEMM's output),
                            // widened, then act_and_mul's arithmetic on them, rounded once more.
                            const float *au = acc_up + (r * np + q) * C;
                            vec::vf ua = vec::load(au), ub = vec::load(au + W);
                            if (bias) {
                                ua = vec::add(ua, vec::load(bias_up + q * C));
                                ub = vec::add(ub, vec::load(bias_up + q * C + W));
                            }
                            alignas(64) T g[2 * kMaxLanes], u[2 * kMaxLanes];  // natural order
                            if constexpr (Kernel::kPairOrder) {
                                vec::store2(g, va, vb);
                                vec::store2(u, ua, ub);
                            } else {
                                vec::store(g, va), vec::store(g + W, vb);
                                vec::store(u, ua), vec::store(u + W, ub);
                            }
                            // (kGlu ? Act : 0: GCC 12 crashes on Activation(-1) as a template argument, even in
                            // this discarded branch of the plain instantiation.)
                            constexpr Activation kAct = Activation(kGlu ? Act : 0);
                            for (int h = 0; h < 2 * W; h += W)
                                vec::store(o + h, gated<kAct>(vec::load(g + h), vec::load(u + h)));
                            continue;
                        }
                        if constexpr (std::is_same_v<O, float> && !std::is_same_v<T, float>) {
                            if (rounded) {  // through T and back: T's output, as f32
                                alignas(64) T t[2 * kMaxLanes];
                                vec::store(t, va), vec::store(t + W, vb);
                                va = vec::load(t), vb = vec::load(t + W);
                            }
                            if (stream_out) {
                                vec::stream(o, va);
                                vec::stream(o + W, vb);
                                continue;
                            }
                        }
                        if constexpr (Kernel::kPairOrder && std::is_same_v<O, T>) {
                            vec::store2(o, va, vb);
                        } else {
                            vec::store(o, va);
                            vec::store(o + W, vb);
                            // f32 out of a pair-order tile: its lanes back into column order.
                            if constexpr (Kernel::kPairOrder) vec::natural_order(o, C, static_cast<const T *>(nullptr));
                        }
                    }
                }
            }
            t += np - 1;  // run() took np panels for every row group
        }
        Kernel::end();
        if (stream_out) vec::stream_fence();
    });
}

}  // namespace

int64_t row_chunk(int64_t M, int64_t row_bytes, int64_t tile_rows, int64_t budget_bytes) {
    int64_t chunks = 1;
    const int64_t max_rows = std::max<int64_t>(tile_rows, budget_bytes / row_bytes);
    if (M > max_rows) {
        const int64_t nth = max_threads();
        chunks = (M + max_rows - 1) / max_rows;
        const int64_t even = (chunks + nth - 1) / nth * nth;
        if (M / even >= 2 * tile_rows) chunks = even;
    }
    return (M + chunks - 1) / chunks;
}

int64_t linear_pack_cols() { return 2 * int64_t(vec::width()); }

int64_t linear_pack_pair(DType dt) {
    int64_t pair = 1;
    panel::with_kernel(dt, [&](auto *kernel) { pair = std::remove_pointer_t<decltype(kernel)>::kPair; });
    return pair;
}

const char *linear_tile_impl(DType dt) {
    const char *name = "";
    panel::with_kernel(dt, [&](auto *kernel) { name = std::remove_pointer_t<decltype(kernel)>::kName; });
    return name;
}

void linear_pack_weight(DType dt, void *dst, const void *src, int64_t N, int64_t K) {
    const int64_t C = linear_pack_cols(), P = linear_pack_pair(dt), es = dtype_size(dt);
    const char *in = static_cast<const char *>(src);
    char *o = static_cast<char *>(dst);
    const int64_t panels = N / C;
    parallel_for(panels, 4, [&](int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) {
            const char *rows = in + p * C * K * es;
            char *to = o + p * C * K * es;
            for (int64_t k = 0; k < K; k += P)
                for (int64_t j = 0; j < C; ++j, to += P * es) std::memcpy(to, rows + (j * K + k) * es, size_t(P * es));
        }
    });
    // The tail rows stay row-major.
    std::memcpy(o + panels * C * K * es, in + panels * C * K * es, size_t((N - panels * C) * K * es));
}

void linear_packed_rows(DType dt, void *out, int64_t out_stride, const void *packed, const int64_t *ids, int64_t n,
                        int64_t N, int64_t K) {
    const int64_t C = linear_pack_cols(), P = linear_pack_pair(dt), es = dtype_size(dt), full = N / C * C;
    const char *w = static_cast<const char *>(packed);
    char *o = static_cast<char *>(out);
    // A decode step's few rows stay on the calling thread (a row is K / P copies of P elements).
    parallel_for(n, std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            const int64_t id = ids[i];
            char *dst = o + i * out_stride * es;
            if (id >= full) {  // a tail row, row-major after the panels
                std::memcpy(dst, w + id * K * es, size_t(K * es));
                continue;
            }
            // Its panel's column id % C: pairs k / P at (k / P) * C * P = k * C elements apart.
            const char *col = w + ((id / C) * C * K + (id % C) * P) * es;
            for (int64_t k = 0; k < K; k += P) std::memcpy(dst + k * es, col + k * C * es, size_t(P * es));
        }
    });
}

void linear_glu(DType dt, Activation act, void *out, int64_t out_stride, const void *x, int64_t x_stride,
                const void *weight, const void *bias, int64_t M, int64_t I, int64_t K) {
    const int64_t panels = I / linear_pack_cols();
    if (M <= 0 || panels <= 0) return;
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        panel::KernelChoice<T>::with([&](auto *kernel) {
            with_activation(act, [&](auto a) {
                run<std::remove_pointer_t<decltype(kernel)>, T, T, int(decltype(a)::value)>(
                    static_cast<T *>(out), out_stride, static_cast<const T *>(x), x_stride,
                    static_cast<const T *>(weight), static_cast<const T *>(bias), M, panels, K, panels);
            });
        });
    });
}

void linear_panels(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
                   const void *bias, int64_t M, int64_t panels, int64_t K, bool out_f32, bool rounded) {
    if (M <= 0 || panels <= 0) return;
    with_float_types(dt, out_f32, [&](auto tag, auto out_tag) {
        using T = decltype(tag);
        using O = decltype(out_tag);
        panel::KernelChoice<T>::with([&](auto *kernel) {
            run<std::remove_pointer_t<decltype(kernel)>>(static_cast<O *>(out), out_stride, static_cast<const T *>(x),
                                                         x_stride, static_cast<const T *>(weight),
                                                         static_cast<const T *>(bias), M, panels, K, 0, rounded);
        });
    });
}

}  // namespace cpuinfer
