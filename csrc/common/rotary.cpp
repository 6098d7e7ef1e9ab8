#include "dispatch_dtype.h"
#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

// NeoX style: feature i pairs with i + half; both halves are contiguous runs,
// so the rotation is plain vector arithmetic.
template <typename T, typename C>
void rotate_neox(T *x, const C *cos, const C *sin, int64_t half) {
    const int W = vec::width();
    int64_t i = 0;
    for (; i + W <= half; i += W) {
        vec::vf c = vec::load(cos + i), s = vec::load(sin + i);
        vec::vf a = vec::load(x + i), b = vec::load(x + half + i);
        vec::store(x + i, vec::sub(vec::mul(a, c), vec::mul(b, s)));
        vec::store(x + half + i, vec::fma(a, s, vec::mul(b, c)));
    }
    for (; i < half; ++i) {
        float c = to_f32(cos[i]), s = to_f32(sin[i]), a = to_f32(x[i]), b = to_f32(x[half + i]);
        x[i] = from_f32<T>(a * c - b * s);
        x[half + i] = from_f32<T>(b * c + a * s);
    }
}

// GPT-J style: features (2i, 2i+1) pair up; interleaved, so scalar f32.
template <typename T, typename C>
void rotate_gptj(T *x, const C *cos, const C *sin, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        float c = to_f32(cos[i]), s = to_f32(sin[i]), a = to_f32(x[2 * i]), b = to_f32(x[2 * i + 1]);
        x[2 * i] = from_f32<T>(a * c - b * s);
        x[2 * i + 1] = from_f32<T>(b * c + a * s);
    }
}

template <typename T, typename C>
void run(const int64_t *positions, int64_t tokens, T *q, int64_t q_stride, int64_t q_heads, T *k, int64_t k_stride,
         int64_t k_heads, int64_t head_size, const C *cos_sin, int64_t rot_dim, bool neox) {
    const int64_t half = rot_dim / 2;
    const int64_t heads = q_heads + (k ? k_heads : 0);
    parallel_for(tokens * heads, std::max<int64_t>(1, 4096 / std::max<int64_t>(rot_dim, 1)), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
            int64_t tok = t / heads, h = t % heads;
            const C *cos = cos_sin + positions[tok] * rot_dim;
            const C *sin = cos + half;
            T *x = h < q_heads ? q + tok * q_stride + h * head_size : k + tok * k_stride + (h - q_heads) * head_size;
            if (neox) {
                rotate_neox(x, cos, sin, half);
            } else {
                rotate_gptj(x, cos, sin, half);
            }
        }
    });
}

}  // namespace

void rotary_embedding(DType dt, const int64_t *positions, int64_t tokens, void *q, int64_t q_stride,
                      int64_t q_heads, void *k, int64_t k_stride, int64_t k_heads, int64_t head_size,
                      const void *cos_sin, DType cache_dt, int64_t rot_dim, bool neox) {
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        auto go = [&](auto ctag) {
            using C = decltype(ctag);
            run<T, C>(positions, tokens, static_cast<T *>(q), q_stride, q_heads, static_cast<T *>(k), k_stride,
                      k_heads, head_size, static_cast<const C *>(cos_sin), rot_dim, neox);
        };
        if (cache_dt == DType::f32) {
            go(float{});
        } else {
            go(T{});
        }
    });
}

}  // namespace cpuinfer
