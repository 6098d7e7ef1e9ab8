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
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
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

// A plan's field, by name: `obj.name` (None when the plan says "none"). Every error names the field as
// the plan spells it ("attn.qkv_w", "mlp.router_w"), so a plan builder's mistake points at its own line.
inline nb::object field(nb::handle obj, const char *name, const std::string &where) {
    if (!nb::hasattr(obj, name)) fail_value("the layer plan's " + where + " has no field '" + name + "'");
    return nb::getattr(obj, name);
}

inline Activation parse_act(const std::string &act, const std::string &name) {
    if (act == "silu") return Activation::silu;
    if (act == "gelu") return Activation::gelu;
    if (act == "gelu_tanh") return Activation::gelu_tanh;
    if (act == "swiglu_oai") return Activation::swiglu_oai;
    fail_value(name + " must be 'silu', 'gelu', 'gelu_tanh' or 'swiglu_oai', got '" + act + "'");
    return Activation::silu;
}

// A mixture-of-experts MLP held by a layer (or by a MoE op): its router, its experts' weights (kept alive
// by their Python objects) and the MoeWeights the kernel reads, which point into this object (never moved:
// owners hold it by unique_ptr).
struct HeldMoe {
    HeldLinear router;
    Held router_b;
    std::vector<HeldLinear> gate_up, down;
    std::vector<LinearWeight> gate_up_w, down_w;
    std::vector<Held> gate_up_bias, down_bias;
    std::vector<const void *> gate_up_b, down_b;
    MoeWeights w;
};

// plan.mlp of kind "moe" (models/plan.py: MoEMLP), checked against the run dtype and hidden size.
inline std::unique_ptr<HeldMoe> hold_moe(nb::handle mlp, bool packed, DType dt, int64_t H) {
    auto m = std::make_unique<HeldMoe>();
    const std::string at = "mlp";
    m->router = hold_linear(field(mlp, "router_w", at), "mlp.router_w", packed);
    m->router_b = hold(field(mlp, "router_b", at), "mlp.router_b");
    if (m->router.w.parts) fail_value("mlp.router_w must be a dense tensor in the run dtype");
    check_same_dtype(m->router.dense.dt, dt, "mlp.router_w", "the layer's run dtype");
    nb::object gu = field(mlp, "gate_up_w", at), dn = field(mlp, "down_w", at);
    const int64_t E = int64_t(nb::len(gu));
    if (int64_t(nb::len(dn)) != E)
        fail_value("mlp.gate_up_w has " + str(E) + " experts, mlp.down_w " + str(int64_t(nb::len(dn))));
    if (E < 1) fail_value("a mixture-of-experts MLP needs at least one expert");
    if (m->router.rows != E || m->router.cols != H)
        fail_value("mlp.router_w must be [" + str(E) + ", " + str(H) + "] (experts x hidden), got " +
                   str(m->router.rows) + " rows of " + str(m->router.cols));
    if (m->router_b.data && (m->router_b.ndim != 1 || m->router_b.cols != E))
        fail_value("mlp.router_b must be 1-D with " + str(E) + " elements");
    if (m->router_b.data) check_same_dtype(m->router_b.dt, dt, "mlp.router_b", "the layer's run dtype");
    const int64_t top_k = nb::cast<int64_t>(field(mlp, "top_k", at));
    if (top_k < 1 || top_k > E) fail_value("mlp.top_k is " + str(top_k) + "; it must be in [1, " + str(E) + "]");
    int64_t I = -1;
    for (int64_t e = 0; e < E; ++e) {
        const std::string gn = "mlp.gate_up_w[" + str(e) + "]", dnn = "mlp.down_w[" + str(e) + "]";
        m->gate_up.push_back(hold_linear(gu.attr("__getitem__")(e), gn.c_str(), packed));
        m->down.push_back(hold_linear(dn.attr("__getitem__")(e), dnn.c_str(), packed));
        const HeldLinear &g = m->gate_up.back(), &d = m->down.back();
        if (I < 0) I = d.cols;
        if (g.rows != 2 * I || g.cols != H)
            fail_value(gn + " must be [" + str(2 * I) + ", " + str(H) + "], got " + str(g.rows) + " rows of " +
                       str(g.cols));
        if (d.rows != H || d.cols != I)
            fail_value(dnn + " must be [" + str(H) + ", " + str(I) + "], got " + str(d.rows) + " rows of " +
                       str(d.cols) + " (every expert has the same intermediate size)");
        if (g.dense.data) check_same_dtype(g.dense.dt, dt, gn.c_str(), "the layer's run dtype");
        if (d.dense.data) check_same_dtype(d.dense.dt, dt, dnn.c_str(), "the layer's run dtype");
        m->gate_up_w.push_back(g.w);
        m->down_w.push_back(d.w);
    }
    // Per-expert biases (gpt-oss): a list of E vectors, or None.
    for (auto [list, held, ptrs, n, what] :
         {std::tuple{field(mlp, "gate_up_b", at), &m->gate_up_bias, &m->gate_up_b, 2 * I, "mlp.gate_up_b"},
          std::tuple{field(mlp, "down_b", at), &m->down_bias, &m->down_b, H, "mlp.down_b"}}) {
        if (list.is_none()) continue;
        if (int64_t(nb::len(list)) != E) fail_value(std::string(what) + " must hold one bias per expert (" + str(E) + ")");
        for (int64_t e = 0; e < E; ++e) {
            const std::string name = std::string(what) + "[" + str(e) + "]";
            held->push_back(hold(list.attr("__getitem__")(e), name.c_str()));
            const Held &b = held->back();
            if (!b.data || b.ndim != 1 || b.cols != n) fail_value(name + " must be 1-D with " + str(n) + " elements");
            check_same_dtype(b.dt, dt, name.c_str(), "the layer's run dtype");
            ptrs->push_back(b.data);
        }
    }
    const std::string scoring = nb::cast<std::string>(field(mlp, "scoring", at));
    if (scoring == "softmax") m->w.scoring = MoeScoring::softmax;
    else if (scoring == "topk_softmax") m->w.scoring = MoeScoring::topk_softmax;
    else fail_value("mlp.scoring must be 'softmax' or 'topk_softmax', got '" + scoring + "'");
    m->w.num_experts = E;
    m->w.top_k = top_k;
    m->w.intermediate = I;
    m->w.router = m->router.w;
    m->w.router_b = m->router_b.data;
    m->w.gate_up = m->gate_up_w.data();
    m->w.down = m->down_w.data();
    m->w.gate_up_b = m->gate_up_b.empty() ? nullptr : m->gate_up_b.data();
    m->w.down_b = m->down_b.empty() ? nullptr : m->down_b.data();
    m->w.renormalize = nb::cast<bool>(field(mlp, "renormalize", at));
    m->w.act = parse_act(nb::cast<std::string>(field(mlp, "act", at)), "mlp.act");
    return m;
}

// The MoE MLP alone, as an op (ops.MoE): the Python reference executor's call for a MoE plan, and the
// kernel's test entry.
class MoE {
  public:
    MoE(nb::handle mlp, bool packed) {
        // The router sets the run dtype and the hidden size; hold_moe checks every other weight against them.
        const Held router = hold(field(mlp, "router_w", "mlp"), "mlp.router_w");
        if (!router.data || router.ndim != 2) fail_value("mlp.router_w must be a 2-D tensor [experts, hidden]");
        dt_ = router.dt;
        hidden_ = router.cols;
        m_ = hold_moe(mlp, packed, dt_, hidden_);
    }

    // out[rows, hidden] = the MoE MLP of x[rows, hidden] (out in x's dtype, or float32 sums with out_f32).
    void forward(Out out, In x) const {
        check_same_dtype(float_dtype(x, "x"), dt_, "x", "the experts'");
        const bool out_f32 = out_f32_or_same(float_dtype(out, "out"), dt_);
        Rows xr = as_rows(x, "x"), orow = as_rows(out, "out");
        if (xr.cols != hidden_) fail_value("x has " + str(xr.cols) + " features, the experts " + str(hidden_));
        if (orow.cols != hidden_ || orow.rows != xr.rows) fail_value("out must have x's shape");
        nb::gil_scoped_release nogil;
        moe_mlp(dt_, m_->w, out.data(), orow.stride, x.data(), xr.stride, xr.rows, hidden_, out_f32);
    }

  private:
    DType dt_ = DType::f32;
    int64_t hidden_ = 0;
    std::unique_ptr<HeldMoe> m_;
};

class DecoderLayer {
  public:
    // plan: a models/plan.py LayerPlan, read by field name: its norms, plan.attn (AttentionPlan) and plan.mlp
    // (DenseMLP or MoEMLP, told apart by mlp.kind). Every weight is checked against the others once, here.
    explicit DecoderLayer(nb::handle plan) {
        const std::string L = "layer";
        nb::object attn = field(plan, "attn", L), mlp = field(plan, "mlp", L);
        const bool packed = nb::cast<bool>(field(plan, "packed", L));
        const std::string kind = nb::cast<std::string>(field(mlp, "kind", "mlp"));
        if (kind != "dense" && kind != "moe") fail_value("mlp.kind must be 'dense' or 'moe', got '" + kind + "'");
        const bool moe = kind == "moe";
        in_norm_ = hold(field(plan, "in_norm", L), "in_norm");
        post_attn_norm_ = hold(field(plan, "post_attn_norm", L), "post_attn_norm");
        pre_ff_norm_ = hold(field(plan, "pre_ff_norm", L), "pre_ff_norm");
        post_ff_norm_ = hold(field(plan, "post_ff_norm", L), "post_ff_norm");
        q_norm_ = hold(field(attn, "q_norm", "attn"), "attn.q_norm");
        k_norm_ = hold(field(attn, "k_norm", "attn"), "attn.k_norm");
        qkv_b_ = hold(field(attn, "qkv_b", "attn"), "attn.qkv_b");
        o_b_ = hold(field(attn, "o_b", "attn"), "attn.o_b");
        cos_sin_ = hold(field(attn, "cos_sin", "attn"), "attn.cos_sin");
        sinks_ = hold(field(attn, "sinks", "attn"), "attn.sinks");
        qkv_ = hold_linear(field(attn, "qkv_w", "attn"), "attn.qkv_w", packed);
        o_ = hold_linear(field(attn, "o_w", "attn"), "attn.o_w", packed);
        if (!moe) {
            gate_up_b_ = hold(field(mlp, "gate_up_b", "mlp"), "mlp.gate_up_b");
            down_b_ = hold(field(mlp, "down_b", "mlp"), "mlp.down_b");
            gate_up_ = hold_linear(field(mlp, "gate_up_w", "mlp"), "mlp.gate_up_w", packed);
            down_ = hold_linear(field(mlp, "down_w", "mlp"), "mlp.down_w", packed);
        }
        const int64_t num_heads = nb::cast<int64_t>(field(attn, "num_heads", "attn"));
        const int64_t num_kv_heads = nb::cast<int64_t>(field(attn, "num_kv_heads", "attn"));
        const int64_t head_size = nb::cast<int64_t>(field(attn, "head_size", "attn"));
        const float eps = nb::cast<float>(field(plan, "eps", L));
        const float scale = nb::cast<float>(field(attn, "scale", "attn"));
        const int64_t sliding_window = nb::cast<int64_t>(field(attn, "sliding_window", "attn"));
        const float soft_cap = nb::cast<float>(field(attn, "soft_cap", "attn"));
        if (!in_norm_.data) fail_value("in_norm is required");
        if (!post_attn_norm_.data) fail_value("post_attn_norm is required");
        if ((pre_ff_norm_.data == nullptr) != (post_ff_norm_.data == nullptr))
            fail_value("pre_ff_norm and post_ff_norm come together (Gemma's sandwich norms) or not at all");
        if ((q_norm_.data == nullptr) != (k_norm_.data == nullptr))
            fail_value("attn.q_norm and attn.k_norm come together or not at all");
        // The run dtype: the activations'. Norms and biases are in it, and so are dense weights.
        const DType dt = in_norm_.dt;
        const std::pair<const Held *, const char *> same[] = {
            {&post_attn_norm_, "post_attn_norm"}, {&pre_ff_norm_, "pre_ff_norm"},
            {&post_ff_norm_, "post_ff_norm"},     {&q_norm_, "attn.q_norm"},
            {&k_norm_, "attn.k_norm"},            {&qkv_b_, "attn.qkv_b"},
            {&o_b_, "attn.o_b"},                  {&gate_up_b_, "mlp.gate_up_b"},
            {&down_b_, "mlp.down_b"},             {&qkv_.dense, "attn.qkv_w"},
            {&o_.dense, "attn.o_w"},              {&gate_up_.dense, "mlp.gate_up_w"},
            {&down_.dense, "mlp.down_w"}};
        for (const auto &[h, name] : same)
            if (h->data) check_same_dtype(h->dt, dt, name, "in_norm");
        if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0)
            fail_value("attn.num_heads (" + str(num_heads) + ") must be a positive multiple of attn.num_kv_heads (" +
                       str(num_kv_heads) + ")");
        const int64_t H = o_.rows, q = num_heads * head_size, kv = num_kv_heads * head_size;
        auto shape2 = [&](const HeldLinear &l, const char *name, int64_t r, int64_t c) {
            if (l.rows != r || l.cols != c)
                fail_value(std::string(name) + " must be [" + str(r) + ", " + str(c) + "], got " + str(l.rows) +
                           " rows of " + str(l.cols));
        };
        auto shape1 = [&](const Held &h, const char *name, int64_t n) {
            if (h.data && (h.ndim != 1 || h.cols != n))
                fail_value(std::string(name) + " must be 1-D with " + str(n) + " elements");
        };
        shape2(qkv_, "attn.qkv_w", q + 2 * kv, H);
        shape2(o_, "attn.o_w", H, q);
        int64_t I = 0;
        if (moe) {
            moe_ = hold_moe(mlp, packed, dt, H);
        } else {
            I = down_.cols;
            shape2(gate_up_, "mlp.gate_up_w", 2 * I, H);
            shape2(down_, "mlp.down_w", H, I);
            shape1(down_b_, "mlp.down_b", H);
            shape1(gate_up_b_, "mlp.gate_up_b", 2 * I);
        }
        shape1(in_norm_, "in_norm", H);
        shape1(post_attn_norm_, "post_attn_norm", H);
        shape1(pre_ff_norm_, "pre_ff_norm", H);
        shape1(post_ff_norm_, "post_ff_norm", H);
        shape1(o_b_, "attn.o_b", H);
        shape1(qkv_b_, "attn.qkv_b", q + 2 * kv);
        shape1(q_norm_, "attn.q_norm", head_size);
        shape1(k_norm_, "attn.k_norm", head_size);
        shape1(sinks_, "attn.sinks", num_heads);
        if (sinks_.data && sinks_.dt != DType::f32) fail_type("attn.sinks must be float32");
        const Activation a = moe ? moe_->w.act : parse_act(nb::cast<std::string>(field(mlp, "act", "mlp")), "mlp.act");
        if (!(eps >= 0.0f)) fail_value("eps must be a non-negative number");
        int64_t rot_dim = 0;
        if (cos_sin_.data) {
            if (cos_sin_.dt != DType::f32 && cos_sin_.dt != dt)
                fail_type(std::string("attn.cos_sin must be float32 or the weights' dtype (") + dtype_label(dt) + ")");
            if (cos_sin_.ndim != 2) fail_value("attn.cos_sin must be [max_positions, rot_dim]");
            rot_dim = cos_sin_.cols;
            if (rot_dim % 2 != 0 || rot_dim <= 0 || rot_dim > head_size)
                fail_value("attn.cos_sin rows have " + str(rot_dim) + " entries; rot_dim must be even and at most " +
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
        w_.moe = moe ? &moe_->w : nullptr;
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
        w_.sinks = static_cast<const float *>(sinks_.data);
        // The attention settings against a cache of this layer's geometry.
        CacheShape c{dt, 1, num_kv_heads, 16, head_size};
        check_attention_settings(c, num_heads, head_size, scale, sliding_window, soft_cap);
    }

    // h, residual: [tokens, hidden] in place (see kernels.h: decoder_layer).
    void forward(Out h, Out residual, bool first, In positions, In slot_mapping, In query_start_loc, In seq_lens,
                 In block_tables, Out key_cache, Out value_cache, std::optional<In> keep) const {
        const DecoderBatch b =
            batch(h, residual, positions, slot_mapping, query_start_loc, seq_lens, block_tables, key_cache, value_cache,
                  keep ? &*keep : nullptr, nullptr);
        void *scratch = scratch_for(size_t(decoder_layer_scratch_bytes(w_, b.tokens)));
        nb::gil_scoped_release nogil;
        decoder_layer(w_, b, h.data(), residual.data(), first, scratch);
    }

    // The per-step checks of a call (the activations, the KV cache, the batch metadata, keep: the same as the
    // individual kernel bindings'), and the batch they describe. seen: the metadata as the previous layer of a
    // stack checked it (its cache's block count and size and this layer's window equal, it holds again), or
    // null; updated to this layer's.
    struct Checked {
        CacheShape cache;
        int64_t window;
        SeqMeta meta;
    };
    DecoderBatch batch(const Out &h, const Out &residual, const In &positions, const In &slot_mapping,
                       const In &query_start_loc, const In &seq_lens, const In &block_tables, const Out &key_cache,
                       const Out &value_cache, const In *keep, std::optional<Checked> *seen) const {
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
        const bool same = seen && *seen && (*seen)->cache.blocks == c.blocks &&
                          (*seen)->cache.block_size == c.block_size && (*seen)->window == w_.sliding_window;
        const SeqMeta m = same ? (*seen)->meta
                               : check_seq_meta(query_start_loc, seq_lens, block_tables, T, c, w_.sliding_window);
        if (seen) *seen = Checked{c, w_.sliding_window, m};
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
        return b;
    }

    const DecoderLayerWeights &weights() const { return w_; }

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
    Held in_norm_, post_attn_norm_, pre_ff_norm_, post_ff_norm_, q_norm_, k_norm_;
    Held qkv_b_, o_b_, gate_up_b_, down_b_, cos_sin_, sinks_;
    HeldLinear qkv_, o_, gate_up_, down_;
    std::unique_ptr<HeldMoe> moe_;  // a MoE layer's router and experts (null: a dense MLP)
    nb::object comm_;  // the ShmComm the all-reduce hook calls, kept alive
    DecoderLayerWeights w_{};
};

// A pipeline stage's decoder layers as one call: each step's checks for every layer first (so a bad argument
// changes nothing: a Python loop over DecoderLayer.forward had run the layers before the bad one), then the
// layers one after another with the GIL released once. It also saves each layer's return to the interpreter
// and the next call's argument conversion: traced on Sapphire Rapids (2 threads, SmolLM2 bf16, batch-1
// decode), ~30 us between one layer's last kernel and the next one's first in one trace, 0.9 ms of a 12 ms
// step, but 3-26 us in later ones: the step gained less (alternating processes: 128-token context 11.57 ->
// 11.52 ms a step, 7 pairs, within the noise; 4096 16.72 -> 16.35 ms, 3 pairs, -2%).
class DecoderStack {
  public:
    explicit DecoderStack(nb::sequence layers) {
        for (nb::handle l : layers) {
            DecoderLayer *p = nullptr;
            if (!nb::try_cast<DecoderLayer *>(l, p) || p == nullptr)
                fail_type("DecoderStack takes DecoderLayer objects, got " + nb::cast<std::string>(nb::str(l.type())));
            owners_.push_back(nb::borrow(l));
            layers_.push_back(p);
        }
        if (layers_.empty()) fail_value("DecoderStack needs at least one layer");
    }

    size_t size() const { return layers_.size(); }

    // DecoderLayer.forward over the layers in order, layer i on key_caches[i] and value_caches[i]; first: the
    // first layer starts the residual stream; keep (the last layer's, as DecoderLayer.forward's).
    void forward(Out h, Out residual, bool first, In positions, In slot_mapping, In query_start_loc, In seq_lens,
                 In block_tables, std::vector<Out> key_caches, std::vector<Out> value_caches,
                 std::optional<In> keep) const {
        const size_t n = layers_.size();
        if (key_caches.size() != n || value_caches.size() != n)
            fail_value("the stack has " + str(n) + " layers but " + str(key_caches.size()) + " key caches and " +
                       str(value_caches.size()) + " value caches");
        std::vector<DecoderBatch> batches;
        batches.reserve(n);
        std::optional<DecoderLayer::Checked> seen;
        size_t scratch_bytes = 0;
        for (size_t i = 0; i < n; ++i) {
            const In *kept = i + 1 == n && keep ? &*keep : nullptr;
            batches.push_back(layers_[i]->batch(h, residual, positions, slot_mapping, query_start_loc, seq_lens,
                                                block_tables, key_caches[i], value_caches[i], kept, &seen));
            scratch_bytes =
                std::max(scratch_bytes, size_t(decoder_layer_scratch_bytes(layers_[i]->weights(), batches[i].tokens)));
        }
        void *scratch = DecoderLayer::scratch_for(scratch_bytes);
        nb::gil_scoped_release nogil;
        for (size_t i = 0; i < n; ++i)
            decoder_layer(layers_[i]->weights(), batches[i], h.data(), residual.data(), first && i == 0, scratch);
    }

  private:
    std::vector<nb::object> owners_;  // the layers, kept alive
    std::vector<const DecoderLayer *> layers_;
};

inline void bind_decoder(nb::module_ &m) {
    nb::class_<MoE>(m, "MoE", "A mixture-of-experts MLP (router, top-k, grouped expert GEMMs) as one kernel call.")
        .def(nb::init<nb::handle, bool>(), nb::arg("mlp"), nb::arg("packed") = false,
             "mlp: a MoEMLP plan (cpuinfer.models.plan), read by field name; packed: its weights are packed.")
        .def("forward", &MoE::forward, nb::arg("out"), nb::arg("x"),
             "out[rows, hidden] = the MoE MLP of x (out float32: the unrounded f32 sums).");
    nb::class_<DecoderLayer>(m, "DecoderLayer",
                             "One pre-norm decoder layer, dense or mixture-of-experts, as a single kernel call; "
                             "built from a layer plan (cpuinfer.models.plan.LayerPlan) read by field name.")
        .def(nb::init<nb::handle>(), nb::arg("plan"))
        .def("forward", &DecoderLayer::forward, nb::arg("h"), nb::arg("residual"), nb::arg("first"),
             nb::arg("positions"), nb::arg("slot_mapping"), nb::arg("query_start_loc"), nb::arg("seq_lens"),
             nb::arg("block_tables"), nb::arg("key_cache"), nb::arg("value_cache"), nb::arg("keep").none() = nb::none(),
             "Run the layer on h [tokens, hidden] in place; residual carries the stream between layers. keep: the "
             "rows whose outputs are read, each the last query row of its sequence, in order (None: all); every "
             "row still writes the cache, and h and residual return the kept rows' in their first rows.")
        .def("set_all_reduce", &DecoderLayer::set_all_reduce, nb::arg("comm").none(),
             "Tensor parallelism: sum o_proj's and down_proj's outputs over the ranks with this ShmComm.");
    nb::class_<DecoderStack>(m, "DecoderStack",
                             "A pipeline stage's DecoderLayer objects run in order by one call (one check pass, "
                             "one GIL release).")
        .def(nb::init<nb::sequence>(), nb::arg("layers"))
        .def("__len__", &DecoderStack::size)
        .def("forward", &DecoderStack::forward, nb::arg("h"), nb::arg("residual"), nb::arg("first"),
             nb::arg("positions"), nb::arg("slot_mapping"), nb::arg("query_start_loc"), nb::arg("seq_lens"),
             nb::arg("block_tables"), nb::arg("key_caches"), nb::arg("value_caches"),
             nb::arg("keep").none() = nb::none(),
             "DecoderLayer.forward of each layer in order, layer i on key_caches[i] / value_caches[i]; keep applies "
             "to the last layer. Every layer's arguments are checked before any runs.");
}

}  // namespace cpuinfer::bind
