// Bindings of the KV-cache write and paged attention: every shape, dtype,
// stride and index the kernels rely on (block ids, slots, lengths) is checked
// here, so a bad call is a Python exception and never an out-of-bounds access.
#pragma once
#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "../common/kernels.h"
#include "tensor_checks.h"

namespace cpuinfer::bind {

inline std::string str(int64_t v) { return std::to_string(v); }

// The dtype of a KV-cache tensor: a float dtype, or uint8 carrying fp8_e5m2
// bits (torch.float8_e5m2 viewed as uint8 by the Python wrapper).
template <typename A>
inline DType cache_dtype(const A &a, const char *name) {
    check_cpu(a, name);
    nb::dlpack::dtype d = a.dtype();
    if (d.lanes == 1 && d.code == uint8_t(nb::dlpack::dtype_code::UInt) && d.bits == 8) return DType::fp8_e5m2;
    if (d.lanes == 1 && (d.code == uint8_t(nb::dlpack::dtype_code::Float) ||
                         d.code == uint8_t(nb::dlpack::dtype_code::Bfloat))) {
        if (d.bits == 32 || d.bits == 16) return float_dtype(a, name);
    }
    fail_type(std::string(name) + " has dtype " + dtype_name(d) +
              "; KV-cache dtypes are float32, bfloat16, float16 and float8_e5m2 (passed as uint8)");
}

template <typename A>
inline const void *int_tensor(const A &a, const char *name, int bits, size_t ndim) {
    check_cpu(a, name);
    nb::dlpack::dtype d = a.dtype();
    if (d.code != uint8_t(nb::dlpack::dtype_code::Int) || d.bits != bits || d.lanes != 1)
        fail_type(std::string(name) + " must be an int" + std::to_string(bits) + " tensor, got " + dtype_name(d));
    if (a.ndim() != ndim) fail_value(std::string(name) + " must have " + std::to_string(ndim) + " dimension(s), got " +
                                     std::to_string(a.ndim()));
    if (ndim >= 1 && a.shape(ndim - 1) > 1 && a.stride(ndim - 1) != 1)
        fail_value(std::string(name) + " must be contiguous; call .contiguous() first");
    return a.data();
}

struct CacheShape {
    DType dt;
    int64_t blocks, heads, block_size, head_size;
};

inline CacheShape check_caches(const Out &kc, const Out &vc) {
    CacheShape c;
    c.dt = cache_dtype(kc, "key_cache");
    if (cache_dtype(vc, "value_cache") != c.dt)
        fail_type(std::string("value_cache has dtype ") + dtype_label(cache_dtype(vc, "value_cache")) +
                  " but key_cache is " + dtype_label(c.dt));
    for (const Out *t : {&kc, &vc}) {
        const char *name = t == &kc ? "key_cache" : "value_cache";
        if (t->ndim() != 4) fail_value(std::string(name) + " must be [num_blocks, num_kv_heads, block_size, head_size]");
        int64_t expect = 1;
        for (int i = 3; i >= 0; --i) {
            if (t->shape(i) > 1 && t->stride(i) != expect)
                fail_value(std::string(name) + " must be contiguous; call .contiguous() first");
            expect *= int64_t(t->shape(i));
        }
    }
    for (int i = 0; i < 4; ++i)
        if (kc.shape(i) != vc.shape(i)) fail_value("key_cache and value_cache must have the same shape");
    c.blocks = int64_t(kc.shape(0));
    c.heads = int64_t(kc.shape(1));
    c.block_size = int64_t(kc.shape(2));
    c.head_size = int64_t(kc.shape(3));
    if (c.heads < 1 || c.block_size < 1 || c.head_size < 1) fail_value("KV-cache dimensions must be positive");
    if (c.blocks > 0 && kc.data() == vc.data()) fail_value("key_cache and value_cache must be different tensors");
    return c;
}

// [tokens, heads, head_size], contiguous within a head.
struct Tokens {
    int64_t tokens, heads, head_size, token_stride, head_stride;
};

template <typename A>
inline Tokens check_tokens(const A &t, const char *name) {
    if (t.ndim() != 3) fail_value(std::string(name) + " must be [num_tokens, num_heads, head_size], got " +
                                  std::to_string(t.ndim()) + " dimensions");
    Tokens r{int64_t(t.shape(0)), int64_t(t.shape(1)), int64_t(t.shape(2)), t.stride(0), t.stride(1)};
    if (r.head_size > 1 && t.stride(2) != 1)
        fail_value(std::string(name) + " must be contiguous in its last dimension; call .contiguous() first");
    return r;
}

// One position per token, each a row of the rotary table (rows = its length).
inline const int64_t *check_positions(const In &positions, int64_t tokens, int64_t rows) {
    check_cpu(positions, "positions");
    auto pd = positions.dtype();
    if (pd.code != uint8_t(nb::dlpack::dtype_code::Int) || pd.bits != 64 || pd.lanes != 1)
        fail_type("positions must be an int64 tensor, got " + dtype_name(pd));
    if (positions.ndim() != 1 || int64_t(positions.shape(0)) != tokens)
        fail_value("positions must be 1-D with one entry per token (" + std::to_string(tokens) + ")");
    if (tokens > 1 && positions.stride(0) != 1) fail_value("positions must be contiguous");
    const int64_t *pos = static_cast<const int64_t *>(positions.data());
    for (int64_t i = 0; i < tokens; ++i) {
        if (pos[i] < 0 || pos[i] >= rows)
            throw nb::index_error(("positions[" + std::to_string(i) + "] = " + std::to_string(pos[i]) +
                                   " is outside the cos_sin_cache (" + std::to_string(rows) + " positions)")
                                      .c_str());
    }
    return pos;
}

// The slot of every token, each inside the cache (negative = skip).
inline const int64_t *check_slots(const In &slot_mapping, int64_t tokens, const CacheShape &c) {
    const int64_t *slots = static_cast<const int64_t *>(int_tensor(slot_mapping, "slot_mapping", 64, 1));
    if (int64_t(slot_mapping.shape(0)) != tokens)
        fail_value("slot_mapping has " + str(slot_mapping.shape(0)) + " entries for " + str(tokens) + " tokens");
    const int64_t capacity = c.blocks * c.block_size;
    for (int64_t i = 0; i < tokens; ++i)
        if (slots[i] >= capacity)
            throw nb::index_error(("slot_mapping[" + str(i) + "] = " + str(slots[i]) + " is outside the cache (" +
                                   str(c.blocks) + " blocks of " + str(c.block_size) + " slots)").c_str());
    return slots;
}

// The per-sequence metadata of an attention call: lengths consistent with the
// query tokens and every block the kernel will read inside the cache.
struct SeqMeta {
    const int32_t *qsl, *lens, *tables;
    int64_t num_seqs, table_stride;
};

inline SeqMeta check_seq_meta(const In &query_start_loc, const In &seq_lens, const In &block_tables, int64_t tokens,
                              const CacheShape &c, int64_t sliding_window) {
    SeqMeta m;
    m.qsl = static_cast<const int32_t *>(int_tensor(query_start_loc, "query_start_loc", 32, 1));
    m.lens = static_cast<const int32_t *>(int_tensor(seq_lens, "seq_lens", 32, 1));
    m.tables = static_cast<const int32_t *>(int_tensor(block_tables, "block_tables", 32, 2));
    const int32_t *qsl = m.qsl, *lens = m.lens, *tables = m.tables;
    const int64_t S = int64_t(seq_lens.shape(0));
    if (int64_t(query_start_loc.shape(0)) != S + 1)
        fail_value("query_start_loc must have num_seqs + 1 = " + str(S + 1) + " entries, got " +
                   str(query_start_loc.shape(0)));
    if (int64_t(block_tables.shape(0)) != S)
        fail_value("block_tables has " + str(block_tables.shape(0)) + " rows for " + str(S) + " sequences");
    const int64_t max_blocks = int64_t(block_tables.shape(1));
    const int64_t table_stride = S > 1 ? block_tables.stride(0) : max_blocks;
    if (S > 1 && table_stride < max_blocks) fail_value("block_tables rows overlap; call .contiguous() first");
    if (S > 0 && qsl[0] != 0) fail_value("query_start_loc[0] must be 0, got " + str(qsl[0]));
    if (qsl[S] != tokens)
        fail_value("query_start_loc[-1] = " + str(qsl[S]) + " but query has " + str(tokens) + " tokens");
    for (int64_t s = 0; s < S; ++s) {
        const int64_t L = int64_t(qsl[s + 1]) - qsl[s], ctx = lens[s];
        if (L < 0) fail_value("query_start_loc must be non-decreasing (at sequence " + str(s) + ")");
        if (ctx < L)
            fail_value("seq_lens[" + str(s) + "] = " + str(ctx) + " is less than the sequence's " + str(L) +
                       " query tokens (seq_lens counts the whole context, this step included)");
        if (ctx > max_blocks * c.block_size)
            fail_value("seq_lens[" + str(s) + "] = " + str(ctx) + " is beyond its block table (" + str(max_blocks) +
                       " blocks of " + str(c.block_size) + ")");
        if (L == 0) continue;
        const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, ctx - L - sliding_window + 1) : 0;
        for (int64_t b = first / c.block_size; b * c.block_size < ctx; ++b) {
            const int64_t id = tables[s * table_stride + b];
            if (id < 0 || id >= c.blocks)
                throw nb::index_error(("block_tables[" + str(s) + ", " + str(b) + "] = " + str(id) +
                                       " is not a block of the cache (" + str(c.blocks) + " blocks)").c_str());
        }
    }
    m.num_seqs = S;
    m.table_stride = table_stride;
    return m;
}

// Attention settings the kernel supports.
inline void check_attention_settings(const CacheShape &c, int64_t q_heads, int64_t D, float scale,
                                     int64_t sliding_window, float soft_cap) {
    if (D != 64 && D != 80 && D != 96 && D != 128 && D != 256)
        fail_value("head_size " + str(D) + " is not supported; supported head sizes are 64, 80, 96, 128 and 256");
    if (c.head_size != D)
        fail_value("query has head_size " + str(D) + " but the KV cache has head_size " + str(c.head_size));
    if (q_heads % c.heads != 0)
        fail_value("query has " + str(q_heads) + " heads, not a multiple of the cache's " + str(c.heads) +
                   " KV heads");
    if (c.block_size % 16 != 0)
        fail_value("block_size " + str(c.block_size) + " is not supported; it must be a multiple of 16");
    if (!std::isfinite(scale)) fail_value("scale must be a finite number");
    if (sliding_window < 0) fail_value("sliding_window must be >= 0 (0 = no window), got " + str(sliding_window));
    if (!(soft_cap >= 0.f) || !std::isfinite(soft_cap))
        fail_value("soft_cap must be a finite number >= 0 (0 = off)");
}

inline void py_reshape_and_cache(In key, In value, Out key_cache, Out value_cache, In slot_mapping) {
    DType dt = float_dtype(key, "key");
    check_same_dtype(float_dtype(value, "value"), dt, "value", "key");
    Tokens k = check_tokens(key, "key"), v = check_tokens(value, "value");
    if (k.tokens != v.tokens || k.heads != v.heads || k.head_size != v.head_size)
        fail_value("key and value must have the same shape");
    CacheShape c = check_caches(key_cache, value_cache);
    if (k.heads != c.heads || k.head_size != c.head_size)
        fail_value("key is [" + str(k.tokens) + ", " + str(k.heads) + ", " + str(k.head_size) +
                   "] but the cache holds " + str(c.heads) + " KV heads of size " + str(c.head_size));
    const int64_t *slots = check_slots(slot_mapping, k.tokens, c);
    nb::gil_scoped_release nogil;
    reshape_and_cache(dt, c.dt, key.data(), k.token_stride, k.head_stride, value.data(), v.token_stride,
                      v.head_stride, key_cache.data(), value_cache.data(), slots, k.tokens, k.heads, k.head_size,
                      c.block_size);
}

// Attention sinks: a float32 vector of one logit per query head (or None).
inline const float *check_sinks(const std::optional<In> &sinks, int64_t heads) {
    if (!sinks) return nullptr;
    if (float_dtype(*sinks, "sinks") != DType::f32) fail_type("sinks must be a float32 tensor");
    if (sinks->ndim() != 1 || int64_t(sinks->shape(0)) != heads || (heads > 1 && sinks->stride(0) != 1))
        fail_value("sinks must be a contiguous vector of one logit per query head (" + std::to_string(heads) + ")");
    return static_cast<const float *>(sinks->data());
}

inline void py_paged_attention(Out out, In query, Out key_cache, Out value_cache, In query_start_loc, In seq_lens,
                               In block_tables, float scale, int64_t sliding_window, float soft_cap,
                               std::optional<In> sinks, bool causal) {
    DType dt = float_dtype(query, "query");
    check_same_dtype(float_dtype(out, "out"), dt, "out", "query");
    Tokens q = check_tokens(query, "query"), o = check_tokens(out, "out");
    if (o.tokens != q.tokens || o.heads != q.heads || o.head_size != q.head_size)
        fail_value("out must have the shape of query");
    CacheShape c = check_caches(key_cache, value_cache);
    const int64_t D = q.head_size;
    check_attention_settings(c, q.heads, D, scale, sliding_window, soft_cap);
    if (q.tokens > 0) {  // exact aliasing is fine too, but partial overlap is not
        const char *olo = static_cast<const char *>(out.data()), *qlo = static_cast<const char *>(query.data());
        const int64_t isz = int64_t(query.itemsize());
        const char *ohi = olo + ((o.tokens - 1) * o.token_stride + (o.heads - 1) * o.head_stride + D) * isz;
        const char *qhi = qlo + ((q.tokens - 1) * q.token_stride + (q.heads - 1) * q.head_stride + D) * isz;
        if (olo < qhi && qlo < ohi) fail_value("out and query overlap in memory; pass separate tensors");
    }

    const SeqMeta m = check_seq_meta(query_start_loc, seq_lens, block_tables, q.tokens, c, sliding_window);
    PagedAttentionArgs a{};  // by field name (kernels.h): a reordered field cannot silently take another's value
    a.dt = dt;
    a.cache_dt = c.dt;
    a.out = out.data();
    a.out_token_stride = o.token_stride;
    a.out_head_stride = o.head_stride;
    a.query = query.data();
    a.q_token_stride = q.token_stride;
    a.q_head_stride = q.head_stride;
    a.key_cache = key_cache.data();
    a.value_cache = value_cache.data();
    a.num_q_heads = q.heads;
    a.num_kv_heads = c.heads;
    a.head_size = D;
    a.block_size = c.block_size;
    a.query_start_loc = m.qsl;
    a.seq_lens = m.lens;
    a.block_tables = m.tables;
    a.num_seqs = m.num_seqs;
    a.block_table_stride = m.table_stride;
    a.scale = scale;
    a.sliding_window = sliding_window;
    a.soft_cap = soft_cap;
    a.sinks = check_sinks(sinks, q.heads);
    if (!causal && sliding_window != 0) fail_value("a sliding window needs causal attention (causal=True)");
    a.causal = causal;
    nb::gil_scoped_release nogil;
    paged_attention(a);
}

inline void bind_attention(nb::module_ &m) {
    m.def("reshape_and_cache", &py_reshape_and_cache, nb::arg("key"), nb::arg("value"), nb::arg("key_cache"),
          nb::arg("value_cache"), nb::arg("slot_mapping"),
          "Write key/value [T, kv_heads, head_size] into the paged caches at slot_mapping (negative = skip).");
    m.def("paged_attention", &py_paged_attention, nb::arg("out"), nb::arg("query"), nb::arg("key_cache"),
          nb::arg("value_cache"), nb::arg("query_start_loc"), nb::arg("seq_lens"), nb::arg("block_tables"),
          nb::arg("scale"), nb::arg("sliding_window") = 0, nb::arg("soft_cap") = 0.0f,
          nb::arg("sinks").none() = nb::none(), nb::arg("causal") = true,
          "Causal GQA attention of a mixed decode/prefill batch over the paged KV cache, written into out; sinks: "
          "a float32 logit per query head that joins each row's softmax sum (gpt-oss), or None; causal=False: "
          "every row sees its whole sequence (an encoder).");
    m.attr("ATTENTION_IMPL") = attention_impl();
}

}  // namespace cpuinfer::bind
