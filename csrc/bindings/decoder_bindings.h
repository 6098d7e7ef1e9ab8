// Binding of the fused decoder layer (kernels.h: decoder_layer).
//
// A DecoderLayer is built once per layer when the model loads: it validates
// the weights' dtypes and shapes against the layer's configuration and keeps
// the weight tensors alive. Each call then checks only what changes per step
// (the activations, the batch metadata and the KV cache) with the same checks
// as the individual kernel bindings, and runs the layer with the GIL released.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../common/kernels.h"
#include "../common/shm_comm.h"
#include "attention_bindings.h"
#include "quant_bindings.h"
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

// A projection weight held by the layer: a dense tensor (row-major, or packed
// for linear()) or a quantized weight (quant_bindings.h).
struct HeldLinear {
    Held dense;
    std::vector<nb::object> keep;  // the quantized weight's owners
    LinearWeight w;
    int64_t rows = 0, cols = 0;
};

inline HeldLinear hold_linear(nb::handle h, const char *name, bool packed) {
    HeldLinear r;
    if (is_quant_weight(h)) {
        r.w = quant_weight(h, name, r.keep, r.rows, r.cols);
        return r;
    }
    r.dense = hold(h, name);
    if (!r.dense.data) fail_value(std::string(name) + " is required");
    if (r.dense.ndim != 2) fail_value(std::string(name) + " must be 2-D");
    if (packed) check_packable(r.dense.cols, r.dense.dt, name);
    r.w.dense = r.dense.data;
    r.w.packed = packed;
    r.rows = r.dense.rows;
    r.cols = r.dense.cols;
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
        in_norm_ = hold(in_norm, "in_norm");
        post_attn_norm_ = hold(post_attn_norm, "post_attn_norm");
        pre_ff_norm_ = hold(pre_ff_norm, "pre_ff_norm");
        post_ff_norm_ = hold(post_ff_norm, "post_ff_norm");
        q_norm_ = hold(q_norm, "q_norm");
        k_norm_ = hold(k_norm, "k_norm");
        qkv_b_ = hold(qkv_b, "qkv_b");
        o_b_ = hold(o_b, "o_b");
        gate_up_b_ = hold(gate_up_b, "gate_up_b");
        down_b_ = hold(down_b, "down_b");
        cos_sin_ = hold(cos_sin, "cos_sin");
        qkv_ = hold_linear(qkv_w, "qkv_w", packed);
        o_ = hold_linear(o_w, "o_w", packed);
        gate_up_ = hold_linear(gate_up_w, "gate_up_w", packed);
        down_ = hold_linear(down_w, "down_w", packed);
        if (!in_norm_.data) fail_value("in_norm is required");
        if (!post_attn_norm_.data) fail_value("post_attn_norm is required");
        if ((pre_ff_norm_.data == nullptr) != (post_ff_norm_.data == nullptr))
            fail_value("pre_ff_norm and post_ff_norm come together (Gemma's sandwich norms) or not at all");
        if ((q_norm_.data == nullptr) != (k_norm_.data == nullptr))
            fail_value("q_norm and k_norm come together or not at all");
        // The run dtype: the activations'. Norms and biases are in it, and so are dense weights.
        const DType dt = in_norm_.dt;
        const std::pair<const Held *, const char *> same[] = {
            {&post_attn_norm_, "post_attn_norm"}, {&pre_ff_norm_, "pre_ff_norm"}, {&post_ff_norm_, "post_ff_norm"},
            {&q_norm_, "q_norm"}, {&k_norm_, "k_norm"}, {&qkv_b_, "qkv_b"}, {&o_b_, "o_b"},
            {&gate_up_b_, "gate_up_b"}, {&down_b_, "down_b"}, {&qkv_.dense, "qkv_w"}, {&o_.dense, "o_w"},
            {&gate_up_.dense, "gate_up_w"}, {&down_.dense, "down_w"}};
        for (const auto &[h, name] : same)
            if (h->data) check_same_dtype(h->dt, dt, name, "in_norm");
        if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0)
            fail_value("num_heads (" + str(num_heads) + ") must be a positive multiple of num_kv_heads (" +
                       str(num_kv_heads) + ")");
        const int64_t H = o_.rows, q = num_heads * head_size, kv = num_kv_heads * head_size, I = down_.cols;
        auto shape2 = [&](const HeldLinear &l, const char *name, int64_t r, int64_t c) {
            if (l.rows != r || l.cols != c)
                fail_value(std::string(name) + " must be [" + str(r) + ", " + str(c) + "], got " + str(l.rows) +
                           " rows of " + str(l.cols));
        };
        auto shape1 = [&](const Held &h, const char *name, int64_t n) {
            if (h.data && (h.ndim != 1 || h.cols != n))
                fail_value(std::string(name) + " must be 1-D with " + str(n) + " elements");
        };
        shape2(qkv_, "qkv_w", q + 2 * kv, H);
        shape2(o_, "o_w", H, q);
        shape2(gate_up_, "gate_up_w", 2 * I, H);
        shape2(down_, "down_w", H, I);
        shape1(in_norm_, "in_norm", H);
        shape1(post_attn_norm_, "post_attn_norm", H);
        shape1(pre_ff_norm_, "pre_ff_norm", H);
        shape1(post_ff_norm_, "post_ff_norm", H);
        shape1(o_b_, "o_b", H);
        shape1(down_b_, "down_b", H);
        shape1(qkv_b_, "qkv_b", q + 2 * kv);
        shape1(q_norm_, "q_norm", head_size);
        shape1(k_norm_, "k_norm", head_size);
        shape1(gate_up_b_, "gate_up_b", 2 * I);
        Activation a;
        if (act == "silu") a = Activation::silu;
        else if (act == "gelu") a = Activation::gelu;
        else if (act == "gelu_tanh") a = Activation::gelu_tanh;
        else fail_value("act must be 'silu', 'gelu' or 'gelu_tanh', got '" + act + "'");
        if (!(eps >= 0.0f)) fail_value("eps must be a non-negative number");
        int64_t rot_dim = 0;
        if (cos_sin_.data) {
            if (cos_sin_.dt != DType::f32 && cos_sin_.dt != dt)
                fail_type(std::string("cos_sin must be float32 or the weights' dtype (") + dtype_label(dt) + ")");
            if (cos_sin_.ndim != 2) fail_value("cos_sin must be [max_positions, rot_dim]");
            rot_dim = cos_sin_.cols;
            if (rot_dim % 2 != 0 || rot_dim <= 0 || rot_dim > head_size)
                fail_value("cos_sin rows have " + str(rot_dim) + " entries; rot_dim must be even and at most " +
                           "head_size " + str(head_size));
        }
        w_.dt = dt;
        w_.hidden = H;
        w_.num_heads = num_heads;
        w_.num_kv_heads = num_kv_heads;
        w_.head_size = head_size;
        w_.intermediate = I;
        w_.in_norm = in_norm_.data;
        w_.post_attn_norm = post_attn_norm_.data;
        w_.pre_ff_norm = pre_ff_norm_.data;
        w_.post_ff_norm = post_ff_norm_.data;
        w_.qkv = qkv_.w;
        w_.o = o_.w;
        w_.gate_up = gate_up_.w;
        w_.down = down_.w;
        w_.qkv_b = qkv_b_.data;
        w_.o_b = o_b_.data;
        w_.gate_up_b = gate_up_b_.data;
        w_.down_b = down_b_.data;
        w_.q_norm = q_norm_.data;
        w_.k_norm = k_norm_.data;
        w_.cos_sin = cos_sin_.data;
        w_.cos_sin_dt = cos_sin_.dt;
        w_.rot_dim = rot_dim;
        w_.neox = true;
        w_.act = a;
        w_.eps = eps;
        w_.scale = scale;
        w_.soft_cap = soft_cap;
        w_.sliding_window = sliding_window;
        // The attention settings against a cache of this layer's geometry.
        CacheShape c{dt, 1, num_kv_heads, 16, head_size};
        check_attention_settings(c, num_heads, head_size, scale, sliding_window, soft_cap);
    }

    // h, residual: [tokens, hidden] in place (see kernels.h: decoder_layer).
    void forward(Out h, Out residual, bool first, In positions, In slot_mapping, In query_start_loc, In seq_lens,
                 In block_tables, Out key_cache, Out value_cache, std::optional<In> keep) const {
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
        if (w_.cos_sin) pos = check_positions(positions, T, cos_sin_.rows);
        const int64_t *slots = check_slots(slot_mapping, T, c);
        const SeqMeta m = check_seq_meta(query_start_loc, seq_lens, block_tables, T, c, w_.sliding_window);
        DecoderBatch b{};  // by field name (kernels.h)
        b.tokens = T;
        b.positions = pos;
        b.slot_mapping = slots;
        b.query_start_loc = m.qsl;
        b.seq_lens = m.lens;
        b.block_tables = m.tables;
        b.num_seqs = m.num_seqs;
        b.block_table_stride = m.table_stride;
        b.cache_dt = c.dt;
        b.key_cache = key_cache.data();
        b.value_cache = value_cache.data();
        b.block_size = c.block_size;
        if (keep) {
            // Each kept row the last query row of its sequence, in order (what the model runner samples).
            b.keep = static_cast<const int64_t *>(int_tensor(*keep, "keep", 64, 1));
            b.kept = int64_t(keep->shape(0));
            for (int64_t i = 0, s = 0; i < b.kept; ++i, ++s) {
                while (s < m.num_seqs && (int64_t(m.qsl[s + 1]) - 1 != b.keep[i] || m.qsl[s + 1] == m.qsl[s])) ++s;
                if (s == m.num_seqs)
                    fail_value("keep[" + str(i) + "] = " + str(b.keep[i]) + " is not the last query row of a sequence" +
                               (i > 0 ? " after keep[" + str(i - 1) + "]'s" : std::string()) +
                               ": keep lists sequences' last rows, in order");
            }
        }
        void *scratch = scratch_for(size_t(decoder_layer_scratch_bytes(w_, T)));
        nb::gil_scoped_release nogil;
        decoder_layer(w_, b, h.data(), residual.data(), first, scratch);
    }

    // Tensor parallelism: sum o_proj's and down_proj's partial outputs over the ranks with this ShmComm
    // (None: a single rank). The layer keeps the communicator alive.
    void set_all_reduce(nb::handle comm) {
        if (comm.is_none()) {
            comm_ = nb::object();
            w_.all_reduce = nullptr;
            w_.all_reduce_ctx = nullptr;
            return;
        }
        ShmComm *c = nullptr;
        if (!nb::try_cast<ShmComm *>(comm, c) || c == nullptr) fail_type("comm must be a ShmComm or None");
        comm_ = nb::borrow(comm);
        w_.all_reduce_ctx = c;
        w_.all_reduce = [](void *ctx, void *data, int64_t numel, DType dt) {
            static_cast<ShmComm *>(ctx)->all_reduce(data, numel, dt);
        };
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

    Held in_norm_, post_attn_norm_, pre_ff_norm_, post_ff_norm_, q_norm_, k_norm_;
    Held qkv_b_, o_b_, gate_up_b_, down_b_, cos_sin_;
    HeldLinear qkv_, o_, gate_up_, down_;
    nb::object comm_;  // the ShmComm the all-reduce hook calls, kept alive
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
             nb::arg("block_tables"), nb::arg("key_cache"), nb::arg("value_cache"), nb::arg("keep").none() = nb::none(),
             "Run the layer on h [tokens, hidden] in place; residual carries the stream between layers. keep: the "
             "rows whose outputs are read, each the last query row of its sequence, in order (None: all); every "
             "row still writes the cache, and h and residual return the kept rows' in their first rows.")
        .def("set_all_reduce", &DecoderLayer::set_all_reduce, nb::arg("comm").none(),
             "Tensor parallelism: sum o_proj's and down_proj's outputs over the ranks with this ShmComm.");
}

}  // namespace cpuinfer::bind
