// Mixture-of-experts MLP (kernels.h: moe_route, moe_mlp): a router picks each
// row's top-k experts, the rows are grouped by expert, and each expert runs as
// one GEMM call over its rows with the same linear kernels the dense MLP uses
// (packed bf16/f16 on the variant's matrix tile, or the integer tiles for a
// quantized expert), so a decode step reads only its experts' weights.
//
// Batch invariance: every linear kernel gives a row the same bits whatever the
// other rows of its call (linear.cpp), the router works row by row, and a row's
// weighted sum adds its experts' outputs in expert-index order in f32 and is
// rounded once. So a row's result depends on that row alone, not on which
// other tokens share its step or its experts.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dispatch_dtype.h"
#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

// Grow-only per-thread scratch (a decode step calls this once per layer: no allocation in steady state).
struct Scratch {
    std::vector<float> logits, weights, acc, y;
    std::vector<int32_t> ids, count, start, rows;
    std::vector<float> row_w;
    std::vector<char> xe, act, gate_up;
};

template <typename V>
void grow(V &v, size_t n) {
    if (v.size() < n) v.resize(n);
}

bool glu_ok(const LinearWeight &w, int64_t I) { return w.parts == 0 && w.packed && I % linear_pack_cols() == 0; }

const void *bias_of(const void *const *b, int64_t e) { return b ? b[e] : nullptr; }

}  // namespace

void moe_route(const MoeWeights &m, const float *logits, int64_t rows, int32_t *ids, float *weights) {
    const int64_t E = m.num_experts, k = m.top_k;
    parallel_for(rows, 64, [&](int64_t b, int64_t e) {
        std::vector<float> p(static_cast<size_t>(E), 0.0f);
        std::vector<int32_t> order(static_cast<size_t>(E));
        for (int64_t r = b; r < e; ++r) {
            const float *l = logits + r * E;
            if (m.scoring == MoeScoring::softmax) {  // softmax over every expert first
                float mx = l[0];
                for (int64_t i = 1; i < E; ++i) mx = std::max(mx, l[i]);
                float s = 0.0f;
                for (int64_t i = 0; i < E; ++i) s += (p[size_t(i)] = std::exp(l[i] - mx));
                for (int64_t i = 0; i < E; ++i) p[size_t(i)] /= s;
            } else {
                for (int64_t i = 0; i < E; ++i) p[size_t(i)] = l[i];
            }
            // The top k, largest first; ties to the lower expert index (a total order: no dependence on the sort).
            for (int64_t i = 0; i < E; ++i) order[size_t(i)] = int32_t(i);
            std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t c) {
                return p[size_t(a)] > p[size_t(c)] || (p[size_t(a)] == p[size_t(c)] && a < c);
            });
            int32_t *id = ids + r * k;
            float *w = weights + r * k;
            for (int64_t j = 0; j < k; ++j) id[j] = order[size_t(j)], w[j] = p[size_t(order[size_t(j)])];
            if (m.scoring == MoeScoring::topk_softmax) {  // a softmax over the k chosen logits
                const float mx = w[0];
                float s = 0.0f;
                for (int64_t j = 0; j < k; ++j) s += (w[j] = std::exp(w[j] - mx));
                for (int64_t j = 0; j < k; ++j) w[j] /= s;
            } else if (m.renormalize) {
                float s = 0.0f;
                for (int64_t j = 0; j < k; ++j) s += w[j];
                for (int64_t j = 0; j < k; ++j) w[j] /= s;
            }
        }
    });
}

void moe_mlp(DType dt, const MoeWeights &m, void *out, int64_t out_stride, const void *x, int64_t x_stride,
             int64_t rows, int64_t hidden, bool out_f32) {
    if (rows <= 0) return;
    static thread_local Scratch tls;
    Scratch &s = tls;  // this thread's: the parallel loops below reach it through this reference
    const int64_t E = m.num_experts, k = m.top_k, I = m.intermediate, H = hidden, es = dtype_size(dt);
    // Router logits in f32, rounded to the run dtype as the model's own router projection is (transformers
    // computes them in the run dtype, then the softmax in f32).
    grow(s.logits, size_t(rows * E));
    linear_weight(dt, s.logits.data(), E, x, x_stride, m.router, m.router_b, rows, E, H, /*out_f32=*/true);
    if (dt != DType::f32) {
        with_float_type(dt, [&](auto tag) {
            using T = decltype(tag);
            for (int64_t i = 0; i < rows * E; ++i) s.logits[size_t(i)] = to_f32(from_f32<T>(s.logits[size_t(i)]));
        });
    }
    grow(s.ids, size_t(rows * k));
    grow(s.weights, size_t(rows * k));
    moe_route(m, s.logits.data(), rows, s.ids.data(), s.weights.data());

    // Group the (row, weight) pairs by expert, rows ascending within an expert (a counting sort).
    s.count.assign(size_t(E), 0);
    grow(s.start, size_t(E + 1));
    for (int64_t i = 0; i < rows * k; ++i) ++s.count[size_t(s.ids[size_t(i)])];
    s.start[0] = 0;
    for (int64_t e = 0; e < E; ++e) s.start[size_t(e + 1)] = s.start[size_t(e)] + s.count[size_t(e)];
    grow(s.rows, size_t(rows * k));
    grow(s.row_w, size_t(rows * k));
    {
        std::vector<int32_t> fill(s.start.begin(), s.start.begin() + E);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < k; ++j) {
                const int32_t e = s.ids[size_t(r * k + j)];
                s.rows[size_t(fill[size_t(e)])] = int32_t(r);
                s.row_w[size_t(fill[size_t(e)]++)] = s.weights[size_t(r * k + j)];
            }
    }
    int64_t most = 0;
    for (int64_t e = 0; e < E; ++e) most = std::max<int64_t>(most, s.count[size_t(e)]);
    grow(s.xe, size_t(most * H * es));
    grow(s.act, size_t(most * I * es));
    grow(s.y, size_t(most * H));
    grow(s.acc, size_t(rows * H));
    std::fill(s.acc.begin(), s.acc.begin() + rows * H, 0.0f);
    const char *xb = static_cast<const char *>(x);
    const int W = vec::width();
    for (int64_t e = 0; e < E; ++e) {
        const int64_t n = s.count[size_t(e)];
        if (n == 0) continue;
        const int32_t *er = s.rows.data() + s.start[size_t(e)];
        const float *ew = s.row_w.data() + s.start[size_t(e)];
        for (int64_t i = 0; i < n; ++i)
            std::memcpy(s.xe.data() + i * H * es, xb + int64_t(er[i]) * x_stride * es, size_t(H * es));
        const LinearWeight &gu = m.gate_up[e];
        if (glu_ok(gu, I)) {
            linear_glu(dt, m.act, s.act.data(), I, s.xe.data(), H, gu.dense, bias_of(m.gate_up_b, e), n, I, H);
        } else {
            grow(s.gate_up, size_t(n * 2 * I * es));
            linear_weight(dt, s.gate_up.data(), 2 * I, s.xe.data(), H, gu, bias_of(m.gate_up_b, e), n, 2 * I, H);
            act_and_mul(dt, m.act, s.act.data(), I, s.gate_up.data(), 2 * I, n, I);
        }
        linear_weight(dt, s.y.data(), H, s.act.data(), I, m.down[e], bias_of(m.down_b, e), n, H, I, /*out_f32=*/true);
        // acc[row] += weight * y: each row appears once per expert, so rows split over threads do not collide.
        parallel_for(n, 16, [&](int64_t b, int64_t end) {
            for (int64_t i = b; i < end; ++i) {
                float *a = s.acc.data() + int64_t(er[i]) * H;
                const float *yi = s.y.data() + i * H;
                const vec::vf wv = vec::splat(ew[i]);
                int64_t c = 0;
                for (; c + W <= H; c += W) vec::store(a + c, vec::fma(wv, vec::load(yi + c), vec::load(a + c)));
                for (; c < H; ++c) a[c] = std::fma(ew[i], yi[c], a[c]);
            }
        });
    }
    // One rounding of each row's f32 sum (or the sums themselves: a tensor-parallel share).
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        parallel_for(rows, 16, [&](int64_t b, int64_t end) {
            for (int64_t r = b; r < end; ++r) {
                const float *a = s.acc.data() + r * H;
                if (out_f32) {
                    std::memcpy(static_cast<float *>(out) + r * out_stride, a, size_t(H) * sizeof(float));
                    continue;
                }
                T *o = static_cast<T *>(out) + r * out_stride;
                int64_t c = 0;
                for (; c + W <= H; c += W) vec::store(o + c, vec::load(a + c));
                for (; c < H; ++c) o[c] = from_f32<T>(a[c]);
            }
        });
    });
}

}  // namespace cpuinfer
