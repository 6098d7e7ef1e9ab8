// Binding of the fused decoder layer (kernels.h: decoder_layer).
//
// A DecoderLayer is built once per layer when the model loads: it validates
// the weights' dtypes and shapes against the layer's configuration and keeps
// the weight tensors alive. Each call then checks only what changes per step
// (the activations, the batch metadata and the KV cache) with the same checks
// as the individual kernel bindings, and runs the layer with the GIL released.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "../common/kernels.h"
#include "attention_bindings.h"
#include "tensor_checks.h"

namespace cpuinfer::bind {

// A weight tensor held by the layer: the Python object keeps it alive.
struct Held {
    nb::object owner;
    const void *data = nullptr;
    DType dt = DType::f32;
    int64_t rows = 0, cols = 0;
    size_t ndim = 0;
};

inline Held hold(nb::handle h, const char *name) {
    Held r;
    if (h.is_none()) return r;
    In t;
    nb::detail::cleanup_list cleanup(nullptr);
    if (!t.load(h, uint8_t(nb::detail::cast_flags::convert), &cleanup)) {
        cleanup.release();
        fail_type(std::string(name) + " must be a tensor");
    }
    r.dt = float_dtype(t, name);
    r.ndim = t.ndim();
    Rows rows = as_rows(t, name);
    if (rows.rows > 1 && rows.stride != rows.cols) fail_value(std::string(name) + " must be contiguous");
    r.rows = rows.rows;
    r.cols = rows.cols;
    r.data = t.data();
    r.owner = nb::borrow(h);
    cleanup.release();
    return r;
}

class DecoderLayer {
  public:
    DecoderLayer(nb::handle in_norm, nb::handle post_attn_norm, nb::handle pre_ff_norm, nb::handle post_ff_norm,
                 nb::handle qkv_w, nb::handle qkv_b, nb::handle o_w, nb::handle o_b, nb::handle q_norm,
                 nb::handle k_norm, nb::handle gate_up_w, nb::handle gate_up_b, nb::handle down_w,
                 nb::handle down_b, nb::handle cos_sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                 const std::string &act, float eps, float scale, int64_t sliding_window, float soft_cap,
                 bool packed) {
        const char *names[] = {"in_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "qkv_w", "qkv_b",
                               "o_w", "o_b", "q_norm", "k_norm", "gate_up_w", "gate_up_b", "down_w", "down_b",
                               "cos_sin"};
        nb::handle hs[] = {in_norm, post_attn_norm, pre_ff_norm, post_ff_norm, qkv_w, qkv_b, o_w, o_b, q_norm,
                           k_norm, gate_up_w, gate_up_b, down_w, down_b, cos_sin};
        for (int i = 0; i < 15; ++i) held_[i] = hold(hs[i], names[i]);
        const Held &qkv = held_[4], &o = held_[6], &gu = held_[10], &down = held_[12], &cs = held_[14];
        for (int i : {0, 1, 4, 6, 10, 12})
            if (!held_[i].data) fail_value(std::string(names[i]) + " is required");
        if ((held_[2].data == nullptr) != (held_[3].data == nullptr))
            fail_value("pre_ff_norm and post_ff_norm come together (Gemma's sandwich norms) or not at all");
        if ((held_[8].data == nullptr) != (held_[9].data == nullptr))
            fail_value("q_norm and k_norm come together or not at all");
        const DType dt = qkv.dt;
        for (int i = 0; i < 14; ++i)
            if (held_[i].data) check_same_dtype(held_[i].dt, dt, names[i], "qkv_w");
        if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0)
            fail_value("num_heads (" + str(num_heads) + ") must be a positive multiple of num_kv_heads (" +
                       str(num_kv_heads) + ")");
        const int64_t H = o.rows, q = num_heads * head_size, kv = num_kv_heads * head_size, I = down.cols;
        auto shape2 = [&](int i, int64_t r, int64_t c) {
            if (held_[i].ndim != 2 || held_[i].rows != r || held_[i].cols != c)
                fail_value(std::string(names[i]) + " must be [" + str(r) + ", " + str(c) + "], got " +
                           str(held_[i].rows) + " rows of " + str(held_[i].cols));
        };
        auto shape1 = [&](int i, int64_t n) {
            if (held_[i].data && (held_[i].ndim != 1 || held_[i].cols != n))
                fail_value(std::string(names[i]) + " must be 1-D with " + str(n) + " elements");
        };
        shape2(4, q + 2 * kv, H);
        shape2(6, H, q);
        shape2(10, 2 * I, H);
        shape2(12, H, I);
        for (int i : {0, 1, 2, 3, 7, 13}) shape1(i, H);
        shape1(5, q + 2 * kv);
        shape1(8, head_size);
        shape1(9, head_size);
        shape1(11, 2 * I);
        Activation a;
        if (act == "silu") a = Activation::silu;
        else if (act == "gelu") a = Activation::gelu;
        else if (act == "gelu_tanh") a = Activation::gelu_tanh;
        else fail_value("act must be 'silu', 'gelu' or 'gelu_tanh', got '" + act + "'");
        if (!(eps >= 0.0f)) fail_value("eps must be a non-negative number");
        int64_t rot_dim = 0;
        if (cs.data) {
            if (cs.dt != DType::f32 && cs.dt != dt)
                fail_type(std::string("cos_sin must be float32 or the weights' dtype (") + dtype_label(dt) + ")");
            if (cs.ndim != 2) fail_value("cos_sin must be [max_positions, rot_dim]");
            rot_dim = cs.cols;
            if (rot_dim % 2 != 0 || rot_dim <= 0 || rot_dim > head_size)
                fail_value("cos_sin rows have " + str(rot_dim) + " entries; rot_dim must be even and at most " +
                           "head_size " + str(head_size));
        }
        w_ = DecoderLayerWeights{dt, H, num_heads, num_kv_heads, head_size, I,
                                 held_[0].data, held_[1].data, held_[2].data, held_[3].data,
                                 qkv.data, held_[5].data, o.data, held_[7].data, held_[8].data, held_[9].data,
                                 gu.data, held_[11].data, down.data, held_[13].data,
                                 cs.data, cs.dt, rot_dim, true, a, eps, scale, soft_cap, sliding_window, packed};
        if (packed) {
            for (int i : {4, 6, 10, 12}) check_packable(held_[i].cols, dt, names[i]);
        }
        // The attention settings against a cache of this layer's geometry.
        CacheShape c{dt, 1, num_kv_heads, 16, head_size};
        check_attention_settings(c, num_heads, head_size, scale, sliding_window, soft_cap);
    }

    // h, residual: [tokens, hidden] in place (see kernels.h: decoder_layer).
    void forward(Out h, Out residual, bool first, In positions, In slot_mapping, In query_start_loc, In seq_lens,
                 In block_tables, Out key_cache, Out value_cache) const {
        const DType dt = w_.dt;
        check_same_dtype(float_dtype(h, "h"), dt, "h", "the layer's weights");
        check_same_dtype(float_dtype(residual, "residual"), dt, "residual", "the layer's weights");
        Rows x = as_rows(h, "h"), r = as_rows(residual, "residual");
        for (const Rows *t : {&x, &r}) {
            const char *name = t == &x ? "h" : "residual";
            if (t->cols != w_.hidden)
                fail_value(std::string(name) + " has hidden size " + str(t->cols) + ", the layer " + str(w_.hidden));
            if (t->rows > 1 && t->stride != t->cols) fail_value(std::string(name) + " must be contiguous");
        }
        if (r.rows != x.rows) fail_value("residual must have the shape of h");
        check_no_overlap(x, "h", r, "residual");
        const int64_t T = x.rows;
        CacheShape c = check_caches(key_cache, value_cache);
        if (c.heads != w_.num_kv_heads || c.head_size != w_.head_size)
            fail_value("the KV cache holds " + str(c.heads) + " heads of size " + str(c.head_size) + ", the layer " +
                       str(w_.num_kv_heads) + " of size " + str(w_.head_size));
        check_attention_settings(c, w_.num_heads, w_.head_size, w_.scale, w_.sliding_window, w_.soft_cap);
        const int64_t *pos = nullptr;
        if (w_.cos_sin) pos = check_positions(positions, T, held_[14].rows);
        const int64_t *slots = check_slots(slot_mapping, T, c);
        const SeqMeta m = check_seq_meta(query_start_loc, seq_lens, block_tables, T, c, w_.sliding_window);
        DecoderBatch b{T, pos, slots, m.qsl, m.lens, m.tables, m.num_seqs, m.table_stride, c.dt,
                       key_cache.data(), value_cache.data(), c.block_size};
        void *scratch = scratch_for(size_t(decoder_layer_scratch_bytes(w_, T)));
        nb::gil_scoped_release nogil;
        decoder_layer(w_, b, h.data(), residual.data(), first, scratch);
    }

  private:
    // Per-thread scratch, grown to the largest step seen (no allocation per call).
    static void *scratch_for(size_t bytes) {
        struct Buffer {
            void *p = nullptr;
            size_t n = 0;
            ~Buffer() { std::free(p); }
        };
        static thread_local Buffer buf;
        if (bytes > buf.n) {
            std::free(buf.p);
            buf.n = 0;
            buf.p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
            if (!buf.p) throw std::bad_alloc();
            buf.n = bytes;
        }
        return buf.p;
    }

    Held held_[15];
    DecoderLayerWeights w_{};
};

inline void bind_decoder(nb::module_ &m) {
    nb::class_<DecoderLayer>(m, "DecoderLayer",
                             "One pre-norm decoder layer (Llama family, Qwen2/3, Gemma 3) as a single kernel call.")
        .def(nb::init<nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, nb::handle,
                      nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, int64_t,
                      int64_t, int64_t, const std::string &, float, float, int64_t, float, bool>(),
             nb::arg("in_norm"), nb::arg("post_attn_norm"), nb::arg("pre_ff_norm").none(),
             nb::arg("post_ff_norm").none(), nb::arg("qkv_w"), nb::arg("qkv_b").none(), nb::arg("o_w"),
             nb::arg("o_b").none(), nb::arg("q_norm").none(), nb::arg("k_norm").none(), nb::arg("gate_up_w"),
             nb::arg("gate_up_b").none(), nb::arg("down_w"), nb::arg("down_b").none(), nb::arg("cos_sin").none(),
             nb::arg("num_heads"), nb::arg("num_kv_heads"), nb::arg("head_size"), nb::arg("act"), nb::arg("eps"),
             nb::arg("scale"), nb::arg("sliding_window") = 0, nb::arg("soft_cap") = 0.0f, nb::arg("packed") = false)
        .def("forward", &DecoderLayer::forward, nb::arg("h"), nb::arg("residual"), nb::arg("first"),
             nb::arg("positions"), nb::arg("slot_mapping"), nb::arg("query_start_loc"), nb::arg("seq_lens"),
             nb::arg("block_tables"), nb::arg("key_cache"), nb::arg("value_cache"),
             "Run the layer on h [tokens, hidden] in place; residual carries the stream between layers.");
}

}  // namespace cpuinfer::bind
