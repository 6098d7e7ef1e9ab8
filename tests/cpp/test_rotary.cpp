// Rotary embedding (NeoX, GPT-J, partial rotary, f32 or same-dtype cache)
// against a double-precision reference.
#include <cmath>
#include <string>

#include "common/kernels.h"
#include "harness.h"

using namespace cpuinfer;
using namespace cpuinfer::test;

namespace {

// Rows [cos(rot/2) | sin(rot/2)] for positions 0..max_pos-1, stored as cdt.
Buffer cos_sin_cache(DType cdt, int64_t max_pos, int64_t rot_dim) {
    Buffer c(cdt, max_pos * rot_dim);
    const int64_t half = rot_dim / 2;
    for (int64_t p = 0; p < max_pos; ++p)
        for (int64_t i = 0; i < half; ++i) {
            double inv_freq = std::pow(10000.0, -2.0 * double(i) / double(rot_dim));
            c.set(p * rot_dim + i, float(std::cos(p * inv_freq)));
            c.set(p * rot_dim + half + i, float(std::sin(p * inv_freq)));
        }
    return c;
}

// Rotates one head of x (head_size values at x[off..]) in double.
void ref_rotate(std::vector<double> &x, int64_t off, const Buffer &cache, int64_t pos, int64_t rot_dim, bool neox) {
    const int64_t half = rot_dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        double c = cache.get(pos * rot_dim + i), s = cache.get(pos * rot_dim + half + i);
        int64_t ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        double a = x[off + ia], b = x[off + ib];
        x[off + ia] = a * c - b * s;
        x[off + ib] = b * c + a * s;
    }
}

void check(DType dt, DType cdt, bool neox, int64_t head_size, int64_t rot_dim, bool with_key) {
    const int64_t tokens = 7, qh = 3, kh = 2, max_pos = 64;
    const int64_t q_stride = qh * head_size + 5, k_stride = kh * head_size + 9;  // e.g. views of a fused qkv
    Buffer cache = cos_sin_cache(cdt, max_pos, rot_dim);
    Buffer q(dt, tokens * q_stride), k(dt, tokens * k_stride);
    q.fill_normal();
    k.fill_normal();
    std::vector<int64_t> pos(tokens);
    for (int64_t t = 0; t < tokens; ++t) pos[size_t(t)] = int64_t(rng()() % max_pos);
    std::vector<double> wq(q.size()), wk(k.size());
    for (int64_t i = 0; i < q.size(); ++i) wq[size_t(i)] = q.get(i);
    for (int64_t i = 0; i < k.size(); ++i) wk[size_t(i)] = k.get(i);
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < qh; ++h) ref_rotate(wq, t * q_stride + h * head_size, cache, pos[t], rot_dim, neox);
        if (with_key)
            for (int64_t h = 0; h < kh; ++h) ref_rotate(wk, t * k_stride + h * head_size, cache, pos[t], rot_dim, neox);
    }
    rotary_embedding(dt, pos.data(), tokens, q.data(), q_stride, qh, with_key ? k.data() : nullptr, k_stride, kh,
                     head_size, cache.data(), cdt, rot_dim, neox);
    Tol t = tol_for(dt);
    std::string what = std::string(neox ? "neox " : "gptj ") + dtype_name(dt) + " cache=" + dtype_name(cdt) +
                       " head=" + std::to_string(head_size) + " rot=" + std::to_string(rot_dim);
    // Whole buffers, padding included: the padding must come back unchanged.
    expect_close(what + " q", q.to_floats().data(), wq.data(), q.size(), t.atol, t.rtol);
    expect_close(what + (with_key ? " k" : " k untouched without key"), k.to_floats().data(), wk.data(), k.size(),
                 t.atol, t.rtol);
}

}  // namespace

CPUINFER_TEST(rotary_full) {
    for (DType dt : kFloatTypes)
        for (bool neox : {true, false})
            for (int64_t hs : {64, 80, 128, 256}) check(dt, DType::f32, neox, hs, hs, true);
}

CPUINFER_TEST(rotary_partial) {
    for (DType dt : kFloatTypes)
        for (bool neox : {true, false}) {
            check(dt, DType::f32, neox, 128, 64, true);
            check(dt, DType::f32, neox, 96, 48, true);
            check(dt, DType::f32, neox, 64, 18, true);
        }
}

CPUINFER_TEST(rotary_cache_in_model_dtype_and_no_key) {
    for (DType dt : {DType::bf16, DType::f16})
        for (bool neox : {true, false}) check(dt, dt, neox, 64, 64, false);
}
