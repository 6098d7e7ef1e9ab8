// reshape_and_cache and paged_attention against double-precision references:
// every cache dtype (fp8_e5m2 included), every head size, mixed decode and
// prefill batches with shuffled block tables, GQA, sliding window, soft-cap.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include "common/kernels.h"
#include "common/vec.h"
#include "harness.h"

using namespace cpuinfer;
using namespace cpuinfer::test;

namespace {

constexpr DType kCacheTypes[] = {DType::f32, DType::bf16, DType::f16, DType::fp8_e5m2};

const char *cache_name(DType dt) { return dt == DType::fp8_e5m2 ? "fp8_e5m2" : dtype_name(dt); }

// Raw storage of any cache dtype, written and read through the exact scalar conversions.
struct CacheBuf {
    DType dt;
    std::vector<uint8_t> bytes;
    static size_t item(DType dt) { return dt == DType::f32 ? 4 : dt == DType::fp8_e5m2 ? 1 : 2; }
    CacheBuf(DType dt, int64_t n) : dt(dt), bytes(size_t(n) * item(dt), 0) {}
    void *data() { return bytes.data(); }
    // Typed copies, so the code is right on big-endian hosts (s390x) too.
    uint32_t bits(int64_t i) const {
        const uint8_t *p = bytes.data() + size_t(i) * item(dt);
        if (item(dt) == 1) return *p;
        if (item(dt) == 2) { uint16_t h; std::memcpy(&h, p, 2); return h; }
        uint32_t w; std::memcpy(&w, p, 4); return w;
    }
    float get(int64_t i) const {
        uint32_t b = bits(i);
        switch (dt) {
            case DType::f32: return bits_f32(b);
            case DType::bf16: return to_f32(bf16_t{uint16_t(b)});
            case DType::f16: return to_f32(f16_t{uint16_t(b)});
            default: return to_f32(fp8_e5m2_t{uint8_t(b)});
        }
    }
    static uint32_t encode(DType dt, float x) {
        switch (dt) {
            case DType::f32: return f32_bits(x);
            case DType::bf16: return f32_to_bf16_bits(x);
            case DType::f16: return f32_to_half_bits(x);
            default: return f32_to_e5m2_bits(x);
        }
    }
    void set(int64_t i, float x) {
        uint32_t b = encode(dt, x);
        uint8_t *p = bytes.data() + size_t(i) * item(dt);
        if (item(dt) == 1) { *p = uint8_t(b); return; }
        if (item(dt) == 2) { uint16_t h = uint16_t(b); std::memcpy(p, &h, 2); return; }
        std::memcpy(p, &b, 4);
    }
    void fill_normal() {
        for (int64_t i = 0; i < int64_t(bytes.size() / item(dt)); ++i) set(i, normal());
    }
};

}  // namespace

// fp8_e5m2 rounding matches torch: these pairs are tensor.to(torch.float8_e5m2)
// results (RNE, overflow to inf, NaN -> 0x7f, subnormals, ties to even).
CPUINFER_TEST(fp8_e5m2_rounding_matches_torch) {
    const struct { float x; uint8_t want; } cases[] = {
        {1e6f, 124}, {-1e6f, 252}, {57344.f, 123}, {60000.f, 123}, {61439.f, 123}, {61440.f, 124}, {65535.f, 124},
        {65536.f, 124}, {std::numeric_limits<float>::infinity(), 124}, {std::nanf(""), 127}, {1e-8f, 0},
        {std::ldexp(1.f, -17), 0}, {3 * std::ldexp(1.f, -17), 2}, {1.5f * std::ldexp(1.f, -16), 2}, {1.f, 0x3c},
        {1.125f, 0x3c}, {1.375f, 0x3e}, {-2.5f, 0xc1}, {0.f, 0}, {-0.f, 0x80}};
    for (auto c : cases) {
        expect_true("fp8(" + std::to_string(c.x) + ") = " + std::to_string(f32_to_e5m2_bits(c.x)) + ", want " +
                        std::to_string(c.want),
                    f32_to_e5m2_bits(c.x) == c.want);
    }
    // Widening is exact: every byte round-trips (NaNs stay NaN).
    for (int b = 0; b < 256; ++b) {
        float x = to_f32(fp8_e5m2_t{uint8_t(b)});
        expect_true("fp8 byte " + std::to_string(b) + " round-trips",
                    std::isnan(x) ? (b & 0x7f) > 0x7c : f32_to_e5m2_bits(x) == b);
    }
}

CPUINFER_TEST(reshape_and_cache_every_dtype) {
    const int64_t tokens = 13, heads = 3, D = 80, bs = 16, blocks = 4;
    for (DType dt : kFloatTypes) {
        for (DType cdt : kCacheTypes) {
            // key rows are 2 heads wider than needed, as slices of a fused qkv output.
            const int64_t tstride = (heads + 2) * D;
            Buffer key(dt, tokens * tstride), value(dt, tokens * tstride);
            key.fill_normal(300.f);  // large enough to reach fp8's overflow to inf
            value.fill_normal();
            CacheBuf kc(cdt, blocks * heads * bs * D), vc(cdt, blocks * heads * bs * D);
            std::vector<int64_t> slots(blocks * bs);
            std::iota(slots.begin(), slots.end(), 0);
            std::shuffle(slots.begin(), slots.end(), rng());
            slots.resize(tokens);
            slots[4] = -1;  // padding: skipped
            reshape_and_cache(dt, cdt, key.data(), tstride, D, value.data(), tstride, D, kc.data(), vc.data(),
                              slots.data(), tokens, heads, D, bs);
            int64_t bad = 0, written = 0;
            for (int64_t s = 0; s < blocks * bs; ++s) {
                auto it = std::find(slots.begin(), slots.end(), s);
                for (int64_t h = 0; h < heads; ++h)
                    for (int64_t d = 0; d < D; ++d) {
                        int64_t at = ((s / bs * heads + h) * bs + s % bs) * D + d;
                        uint32_t wk = 0, wv = 0;
                        if (it != slots.end()) {
                            int64_t t = it - slots.begin();
                            wk = CacheBuf::encode(cdt, key.get(t * tstride + h * D + d));
                            wv = CacheBuf::encode(cdt, value.get(t * tstride + h * D + d));
                            ++written;
                        }
                        bad += kc.bits(at) != wk || vc.bits(at) != wv;
                    }
            }
            expect_true(std::string("reshape_and_cache ") + dtype_name(dt) + " -> " + cache_name(cdt) + ": " +
                            std::to_string(bad) + " wrong elements",
                        bad == 0 && written == (tokens - 1) * heads * D);
        }
    }
}

namespace {

struct Seq {
    int q_len, ctx;
};

// One randomized batch checked against a double reference.
void check_attention(DType dt, DType cdt, int64_t D, int64_t hkv, int64_t group, int64_t bs,
                     const std::vector<Seq> &seqs, int64_t window, float cap) {
    const int64_t hq = hkv * group, S = int64_t(seqs.size());
    std::vector<int32_t> qsl(S + 1, 0), lens(S);
    int64_t max_blocks = 0, total_blocks = 0;
    for (int64_t s = 0; s < S; ++s) {
        qsl[s + 1] = qsl[s] + seqs[s].q_len;
        lens[s] = seqs[s].ctx;
        int64_t n = (seqs[s].ctx + bs - 1) / bs;
        max_blocks = std::max(max_blocks, n + 1);
        total_blocks += n;
    }
    const int64_t nb = total_blocks + 2, T = qsl[S];
    std::vector<int32_t> perm(nb), tables(S * max_blocks, -1);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng());
    for (int64_t s = 0, used = 0; s < S; ++s)
        for (int64_t b = 0; b < (seqs[s].ctx + bs - 1) / bs; ++b) tables[s * max_blocks + b] = perm[used++];
    CacheBuf kc(cdt, nb * hkv * bs * D), vc(cdt, nb * hkv * bs * D);
    kc.fill_normal();
    vc.fill_normal();
    Buffer q(dt, T * hq * D), out(dt, T * hq * D);
    q.fill_normal();
    const float scale = 1.f / std::sqrt(float(D));
    PagedAttentionArgs a{};
    a.dt = dt;
    a.cache_dt = cdt;
    a.out = out.data();
    a.out_token_stride = hq * D;
    a.out_head_stride = D;
    a.query = q.data();
    a.q_token_stride = hq * D;
    a.q_head_stride = D;
    a.key_cache = kc.data();
    a.value_cache = vc.data();
    a.num_q_heads = hq;
    a.num_kv_heads = hkv;
    a.head_size = D;
    a.block_size = bs;
    a.query_start_loc = qsl.data();
    a.seq_lens = lens.data();
    a.block_tables = tables.data();
    a.num_seqs = S;
    a.block_table_stride = max_blocks;
    a.scale = scale;
    a.sliding_window = window;
    a.soft_cap = cap;
    paged_attention(a);

    std::vector<double> want(size_t(T * hq * D));
    for (int64_t s = 0; s < S; ++s) {
        const int64_t L = seqs[s].q_len, ctx = seqs[s].ctx;
        for (int64_t t = 0; t < L; ++t)
            for (int64_t h = 0; h < hq; ++h) {
                const int64_t pos = ctx - L + t, kh = h / group, row = (qsl[s] + t) * hq + h;
                std::vector<double> logit(size_t(ctx), -INFINITY);
                double mx = -INFINITY;
                for (int64_t p = 0; p <= pos; ++p) {
                    if (window > 0 && pos - p >= window) continue;
                    int64_t base = ((tables[s * max_blocks + p / bs] * hkv + kh) * bs + p % bs) * D;
                    double dot = 0;
                    for (int64_t d = 0; d < D; ++d) dot += double(q.get(row * D + d)) * kc.get(base + d);
                    dot *= scale;
                    if (cap > 0) dot = cap * std::tanh(dot / cap);
                    logit[p] = dot;
                    mx = std::max(mx, dot);
                }
                double sum = 0;
                for (int64_t p = 0; p < ctx; ++p) sum += logit[p] == -INFINITY ? 0 : std::exp(logit[p] - mx);
                for (int64_t p = 0; p < ctx; ++p) {
                    if (logit[p] == -INFINITY) continue;
                    double w = std::exp(logit[p] - mx) / sum;
                    int64_t base = ((tables[s * max_blocks + p / bs] * hkv + kh) * bs + p % bs) * D;
                    for (int64_t d = 0; d < D; ++d) want[row * D + d] += w * vc.get(base + d);
                }
            }
    }
    Tol t = dt == DType::f32 ? Tol{2e-5, 1e-4} : dt == DType::bf16 ? Tol{1.6e-2, 1.6e-2} : Tol{2e-3, 2e-3};
    expect_close(std::string("paged_attention ") + dtype_name(dt) + " cache " + cache_name(cdt) + " D=" +
                     std::to_string(D) + " kv=" + std::to_string(hkv) + "x" + std::to_string(group) + " bs=" +
                     std::to_string(bs) + " window=" + std::to_string(window) + " cap=" + std::to_string(cap),
                 out.to_floats().data(), want.data(), T * hq * D, t.atol, t.rtol);
}

std::vector<Seq> random_seqs(int n, int max_ctx) {
    std::vector<Seq> seqs;
    std::uniform_int_distribution<int> ctxd(1, max_ctx);
    for (int i = 0; i < n; ++i) {
        int ctx = ctxd(rng());
        float k = uniform();
        int q = k < 0.5f ? 1 : k < 0.7f ? ctx : std::uniform_int_distribution<int>(1, ctx)(rng());
        seqs.push_back({q, ctx});
    }
    return seqs;
}

// The head sizes of the tile-path cases: 64, 96, 128 and 256 (multiples of 32: amx's tiles) and 80; reduced(),
// the smallest, 80 and the largest.
std::vector<int64_t> head_sizes() {
    if (reduced()) return {64, 80, 256};
    return {64, 80, 96, 128, 256};
}

}  // namespace

CPUINFER_TEST(paged_attention_matrix) {
    const int64_t heads[][2] = {{1, 1}, {2, 2}, {2, 4}, {1, 8}, {1, 12}};
    const int64_t windows[] = {0, 0, 29, 13};
    const float caps[] = {0.f, 20.f, 0.f, 4.f};
    int i = 0;
    for (int64_t D : {64, 80, 96, 128, 256})
        for (DType cdt : kCacheTypes)
            for (int v = 0; v < 2; ++v, ++i) {
                const int64_t *hg = heads[i % 5];
                const std::vector<Seq> seqs = reduced() ? random_seqs(2, 40) : random_seqs(3, 60);
                check_attention(kFloatTypes[i % 3], cdt, D, hg[0], hg[1], 16 * (1 + i % 3), seqs, windows[i % 4],
                                caps[i % 4]);
            }
}

CPUINFER_TEST(paged_attention_long_context) {
    // Long enough that, with threads, the key range is split and merged.
    check_attention(DType::bf16, DType::bf16, 128, 1, 4, 16, {{1, 1200}, {5, 300}}, 0, 0.f);
    check_attention(DType::f32, DType::fp8_e5m2, 64, 2, 1, 32, {{2, 900}}, 100, 0.f);
}

CPUINFER_TEST(paged_attention_bf16_tile_paths) {
    // bf16 query x bf16 cache takes the ISA's bf16 paths: avx512bf16's VDPBF16PS
    // on packed keys (tiles of 1-2, 3-8 and 9-16 rows take 4, 2 and 1 16-key
    // groups at once, so block size 128 and 1-2 heads per KV head are here),
    // amx's flash attention on tiles for head sizes that are multiples of 32.
    for (int64_t D : head_sizes()) {
        check_attention(DType::bf16, DType::bf16, D, 2, 8, 32, {{1, 77}, {20, 50}, {3, 33}}, 0, 0.f);
        check_attention(DType::bf16, DType::bf16, D, 1, 4, 16, {{37, 37}, {1, 90}}, 24, 0.f);
        check_attention(DType::bf16, DType::bf16, D, 1, 16, 16, {{2, 40}}, 0, 15.f);
        check_attention(DType::bf16, DType::bf16, D, 2, 1, 128, {{1, 200}, {45, 150}, {1, 5}}, 0, 0.f);
        check_attention(DType::bf16, DType::bf16, D, 1, 2, 128, {{30, 170}, {1, 129}}, 70, 0.f);
    }
}

namespace {

// paged_attention of one sequence: `rows` query rows (hq heads of D) ending at key len - 1, over a cache of
// hkv heads in blocks of bs laid out by `table`.
void run_one_sequence(DType dt, DType cdt, void *out, const void *query, int32_t rows, int32_t len, void *kc,
                      void *vc, const std::vector<int32_t> &table, int64_t hq, int64_t hkv, int64_t D, int64_t bs,
                      int64_t window = 0) {
    const int32_t qsl[2] = {0, rows}, lens[1] = {len};
    PagedAttentionArgs a{};
    a.dt = dt;
    a.cache_dt = cdt;
    a.out = out;
    a.out_token_stride = hq * D;
    a.out_head_stride = D;
    a.query = query;
    a.q_token_stride = hq * D;
    a.q_head_stride = D;
    a.key_cache = kc;
    a.value_cache = vc;
    a.num_q_heads = hq;
    a.num_kv_heads = hkv;
    a.head_size = D;
    a.block_size = bs;
    a.query_start_loc = qsl;
    a.seq_lens = lens;
    a.block_tables = table.data();
    a.num_seqs = 1;
    a.block_table_stride = int64_t(table.size());
    a.scale = 1.f / std::sqrt(float(D));
    a.sliding_window = window;
    paged_attention(a);
}

// A query row's output, bit for bit, does not depend on the rows computed with it: each row of a prefill
// chunk (q rows after a cached prefix) against the same row run alone as a decode step. (The vector
// layers' key scores are reduced four at a time or one at a time depending on the tile's row count, so
// every layer's reduce_add4 must give reduce_add's bits; avx512bf16 computes 1, 2 or 4 16-key groups at
// once by row count; flash-decoding partitions sit at fixed key positions.)
void check_rows_alone(DType dt, DType cdt, int64_t D, int64_t hkv, int64_t group, int64_t bs, int q, int ctx) {
    const int64_t hq = hkv * group, blocks = (ctx + bs - 1) / bs;
    std::vector<int32_t> table(static_cast<size_t>(blocks), 0);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng());
    CacheBuf kc(cdt, blocks * hkv * bs * D), vc(cdt, blocks * hkv * bs * D);
    kc.fill_normal();
    vc.fill_normal();
    Buffer query(dt, q * hq * D), out(dt, q * hq * D), one(dt, hq * D);
    query.fill_normal();
    auto run = [&](void *o, const void *qp, int rows, int32_t len) {
        run_one_sequence(dt, cdt, o, qp, rows, len, kc.data(), vc.data(), table, hq, hkv, D, bs);
    };
    run(out.data(), query.data(), q, ctx);
    const int64_t es = dtype_size(dt), row = hq * D;
    bool same = true;
    for (int t = 0; t < q && same; ++t) {
        run(one.data(), static_cast<const char *>(query.data()) + t * row * es, 1, ctx - q + t + 1);
        same = std::memcmp(one.data(), static_cast<const char *>(out.data()) + t * row * es, size_t(row * es)) == 0;
    }
    expect_true(std::string("paged_attention ") + dtype_name(dt) + " cache " + cache_name(cdt) + " D=" +
                    std::to_string(D) + " kv=" + std::to_string(hkv) + "x" + std::to_string(group) + " q=" +
                    std::to_string(q) + " ctx=" + std::to_string(ctx) + ": each prefill row's bits = that row decoded alone",
                same);
}

}  // namespace

CPUINFER_TEST(paged_attention_row_independent_of_its_tile) {
    std::uniform_int_distribution<int> ctxd(2, reduced() ? 120 : 300), longd(600, reduced() ? 800 : 1400);
    int i = 0;
    for (DType dt : kFloatTypes)
        for (DType cdt : kCacheTypes)
            for (int64_t D : {64, 128}) {
                // Every fourth case spans several 512-key partitions (a few rows: the reference is one call a row).
                const bool long_ctx = i % 4 == 3;
                const int ctx = long_ctx ? longd(rng()) : ctxd(rng());
                const int q = std::uniform_int_distribution<int>(1, long_ctx ? 12 : ctx)(rng());
                const int64_t group = (i++ % 3) + 1;
                check_rows_alone(dt, cdt, D, 2, group, 16, q, ctx);
            }
    // bf16 x bf16 at block size 128 and every head size: avx512bf16's multi-group tiles, amx's D = 80.
    for (int64_t D : head_sizes())
        for (int64_t group : {1, 2, 3})
            check_rows_alone(DType::bf16, DType::bf16, D, 1, group, 128, std::uniform_int_distribution<int>(2, 40)(rng()),
                             std::uniform_int_distribution<int>(60, 300)(rng()));
}

// Every e5m2 value is a bf16 value (the top byte of an f16: 2 mantissa bits and a 5-bit exponent, its
// subnormals normal in bf16), so amx widens an fp8 cache's rows to bf16 as it packs its tiles: bf16 queries
// on an fp8 cache give the bits of a bf16 cache holding its values (prefill chunks on packed K^T and V tiles,
// decodes widening K as they copy it for the A tiles; block sizes 16, 48: chunks straddle blocks, and 128).
// Other variants: within the bf16 tolerance of each other. Caches of normal values with one element in eight
// a random finite byte below 8 in magnitude (subnormals and both zeros among them).
CPUINFER_TEST(paged_attention_fp8_cache_is_its_values_in_bf16) {
    const int64_t hkv = 2, group = 3, hq = hkv * group, D = 64;
    const bool amx = std::string(attention_impl()) == "amx";
    std::uniform_int_distribution<int> byte(0, 255);
    for (int64_t bs : {16, 48, 128}) {
        const int ctx = reduced() ? 700 : 1100, blocks = int((ctx + bs - 1) / bs);
        std::vector<int32_t> table(static_cast<size_t>(blocks));
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), rng());
        CacheBuf k8(DType::fp8_e5m2, blocks * hkv * bs * D), v8 = k8;
        k8.fill_normal();
        v8.fill_normal();
        CacheBuf k16(DType::bf16, blocks * hkv * bs * D), v16 = k16;
        for (CacheBuf *c : {&k8, &v8})
            for (int64_t i = 0; i < int64_t(c->bytes.size()); ++i)
                if (byte(rng()) < 32) c->bytes[size_t(i)] = uint8_t(byte(rng()) % 0x48 | (byte(rng()) & 0x80));
        for (int64_t i = 0; i < int64_t(k8.bytes.size()); ++i) k16.set(i, k8.get(i)), v16.set(i, v8.get(i));
        for (int rows : {reduced() ? 48 : 300, 1}) {
            Buffer q(DType::bf16, rows * hq * D), o8(DType::bf16, rows * hq * D), o16 = o8;
            q.fill_normal();
            const int64_t window = bs == 48 ? 200 : 0;
            run_one_sequence(DType::bf16, DType::fp8_e5m2, o8.data(), q.data(), rows, ctx, k8.data(), v8.data(), table,
                             hq, hkv, D, bs, window);
            run_one_sequence(DType::bf16, DType::bf16, o16.data(), q.data(), rows, ctx, k16.data(), v16.data(), table,
                             hq, hkv, D, bs, window);
            const std::string what = "bf16 query, fp8 cache = its values in a bf16 cache, bs=" + std::to_string(bs) +
                                     " rows=" + std::to_string(rows);
            if (amx) expect_true(what + ", bit for bit", o8.half == o16.half);
            const std::vector<float> want = o16.to_floats();
            const std::vector<double> wanted(want.begin(), want.end());
            expect_close(what, o8.to_floats().data(), wanted.data(), o8.size(), 1.6e-2, 1.6e-2);
        }
    }
}

// vec.h's reduce_add16 (16 sums at once: the QK scores of a run of 16 keys) gives reduce_add's bits for each,
// on every layer: a key's score goes through either, depending on where the run of keys a row sees starts.
// Lanes of random magnitudes and signs, so that any other order of the additions rounds differently.
CPUINFER_TEST(reduce_add16_gives_reduce_adds_bits) {
    const int64_t W = vec::width();
    std::vector<float> x(size_t(16 * W));
    std::uniform_real_distribution<float> mant(-1.f, 1.f);
    std::uniform_int_distribution<int> expo(-20, 20);
    bool same = true;
    for (int trial = 0; trial < 64; ++trial) {
        for (float &v : x) v = std::ldexp(mant(rng()), expo(rng()));
        float out[16];
        vec::reduce_add16(x.data(), out);
        for (int k = 0; k < 16; ++k) {
            const float one = vec::reduce_add(vec::load(x.data() + k * W));
            same = same && std::memcmp(&one, &out[k], sizeof(float)) == 0;
        }
    }
    expect_true("reduce_add16 = 16 x reduce_add, bit for bit", same);
}
