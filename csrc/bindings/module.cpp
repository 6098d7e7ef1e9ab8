// Python binding of one kernel variant. Compiled once per variant into
// cpuinfer/_C_<variant>; takes tensors through DLPack (nanobind ndarray), so
// it never links libtorch and one build serves every torch release.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../common/kernels.h"
#include "../common/parallel.h"
#include "tensor_checks.h"
#include "attention_bindings.h"
#include "comm_bindings.h"
#include "decoder_bindings.h"
#include "quant_bindings.h"

#ifndef CPUINFER_VARIANT
#error "CMake must define CPUINFER_VARIANT"
#endif
#ifndef CPUINFER_ABI_STAMP
#error "CMake must define CPUINFER_ABI_STAMP"
#endif
#define CPUINFER_CAT(a, b) a##b
#define CPUINFER_MODULE(v) CPUINFER_CAT(_C_, v)
#define CPUINFER_STR2(x) #x
#define CPUINFER_STR(x) CPUINFER_STR2(x)

namespace nb = nanobind;
using namespace cpuinfer;
using namespace cpuinfer::bind;

namespace {

struct NormArgs {
    DType dt;
    Rows x, w;
};

NormArgs check_norm(const char *xn, const Rows &x, DType xdt, const In &weight, float eps) {
    DType wdt = float_dtype(weight, "weight");
    check_same_dtype(wdt, xdt, "weight", xn);
    if (weight.ndim() != 1) fail_value("weight must be 1-D, got " + std::to_string(weight.ndim()) + " dimensions");
    Rows w = as_rows(weight, "weight");
    if (w.cols != x.cols)
        fail_value(std::string("weight has ") + std::to_string(w.cols) + " elements but " + xn + " has hidden size " +
                   std::to_string(x.cols));
    if (!(eps >= 0.0f)) fail_value("epsilon must be a non-negative number, got " + std::to_string(eps));
    return {xdt, x, w};
}

void py_rms_norm(Out out, In input, In weight, float eps) {
    DType dt = float_dtype(input, "input");
    check_same_dtype(float_dtype(out, "out"), dt, "out", "input");
    Rows x = as_rows(input, "input"), o = as_rows(out, "out");
    if (o.rows != x.rows || o.cols != x.cols) fail_value("out must have the shape of input");
    NormArgs a = check_norm("input", x, dt, weight, eps);
    if (x.lo != o.lo) check_no_overlap(o, "out", x, "input");  // exact aliasing (in place) is fine
    nb::gil_scoped_release nogil;
    rms_norm(dt, out.data(), o.stride, input.data(), x.stride, weight.data(), x.rows, x.cols, eps);
    (void)a;
}

// out = LayerNorm(input (+ residual)) with float32 weight and bias (kernels.h: add_layer_norm).
void py_add_layer_norm(Out out, In input, std::optional<In> residual, In weight, In bias, float eps) {
    DType dt = float_dtype(input, "input");
    check_same_dtype(float_dtype(out, "out"), dt, "out", "input");
    Rows x = as_rows(input, "input"), o = as_rows(out, "out");
    if (o.rows != x.rows || o.cols != x.cols) fail_value("out must have the shape of input");
    Rows r{};
    if (residual) {
        check_same_dtype(float_dtype(*residual, "residual"), dt, "residual", "input");
        r = as_rows(*residual, "residual");
        if (r.rows != x.rows || r.cols != x.cols) fail_value("residual must have the shape of input");
        if (r.lo != o.lo) check_no_overlap(o, "out", r, "residual");
    }
    if (x.lo != o.lo) check_no_overlap(o, "out", x, "input");  // exact aliasing (in place) is fine
    for (const auto &[t, name] : {std::pair<const In &, const char *>{weight, "weight"}, {bias, "bias"}}) {
        if (float_dtype(t, name) != DType::f32) fail_type(std::string(name) + " must be float32");
        if (t.ndim() != 1 || int64_t(t.shape(0)) != x.cols || (x.cols > 1 && t.stride(0) != 1))
            fail_value(std::string(name) + " must be a contiguous 1-D tensor of " + std::to_string(x.cols) + " elements");
    }
    if (!(eps >= 0.0f)) fail_value("epsilon must be a non-negative number, got " + std::to_string(eps));
    nb::gil_scoped_release nogil;
    add_layer_norm(dt, out.data(), o.stride, input.data(), x.stride, residual ? residual->data() : nullptr,
                   residual ? r.stride : 0, static_cast<const float *>(weight.data()),
                   static_cast<const float *>(bias.data()), x.rows, x.cols, eps);
}

void py_act(Activation a, Out out, In input) {
    DType dt = float_dtype(input, "input");
    check_same_dtype(float_dtype(out, "out"), dt, "out", "input");
    Rows x = as_rows(input, "input"), o = as_rows(out, "out");
    if (o.rows != x.rows || o.cols != x.cols) fail_value("out must have the shape of input");
    if (x.lo != o.lo) check_no_overlap(o, "out", x, "input");
    nb::gil_scoped_release nogil;
    act(dt, a, out.data(), o.stride, input.data(), x.stride, x.rows, x.cols);
}

void py_argmax(Out out, In logits) {
    DType dt = float_dtype(logits, "logits");
    Rows x = as_rows(logits, "logits");
    check_cpu(out, "out");
    auto od = out.dtype();
    if (od.code != uint8_t(nb::dlpack::dtype_code::Int) || od.bits != 64 || od.lanes != 1)
        fail_type("out must be an int64 tensor, got " + dtype_name(od));
    if (out.ndim() != 1 || int64_t(out.shape(0)) != x.rows)
        fail_value("out must be 1-D with one entry per row of logits (" + std::to_string(x.rows) + ")");
    if (x.rows > 1 && out.stride(0) != 1) fail_value("out must be contiguous");
    if (x.cols == 0 && x.rows > 0) fail_value("logits has rows of 0 elements: their argmax is undefined");
    nb::gil_scoped_release nogil;
    argmax_rows(dt, static_cast<int64_t *>(out.data()), logits.data(), x.stride, x.rows, x.cols);
}

void py_fused_add_rms_norm(Out input, Out residual, In weight, float eps) {
    DType dt = float_dtype(input, "input");
    check_same_dtype(float_dtype(residual, "residual"), dt, "residual", "input");
    Rows x = as_rows(input, "input"), r = as_rows(residual, "residual");
    if (r.rows != x.rows || r.cols != x.cols) fail_value("residual must have the shape of input");
    check_norm("input", x, dt, weight, eps);
    check_no_overlap(x, "input", r, "residual");
    nb::gil_scoped_release nogil;
    fused_add_rms_norm(dt, input.data(), x.stride, residual.data(), r.stride, weight.data(), x.rows, x.cols, eps);
}

// q/k as [tokens, heads * head_size] or [tokens, heads, head_size].
struct Heads {
    int64_t tokens, heads, stride;
};

Heads check_heads(const Out &t, const char *name, int64_t head_size) {
    if (t.ndim() != 2 && t.ndim() != 3)
        fail_value(std::string(name) + " must be [tokens, heads * head_size] or [tokens, heads, head_size]");
    int64_t tokens = int64_t(t.shape(0)), feat;
    if (t.ndim() == 3) {
        if (int64_t(t.shape(2)) != head_size)
            fail_value(std::string(name) + " has head size " + std::to_string(t.shape(2)) + ", expected " +
                       std::to_string(head_size));
        if (t.stride(2) != 1 || (t.shape(1) > 1 && t.stride(1) != head_size))
            fail_value(std::string(name) + " must be contiguous within each token; call .contiguous() first");
        feat = int64_t(t.shape(1)) * head_size;
    } else {
        if (t.shape(1) > 1 && t.stride(1) != 1)
            fail_value(std::string(name) + " must be contiguous within each token; call .contiguous() first");
        feat = int64_t(t.shape(1));
        if (feat % head_size != 0)
            fail_value(std::string(name) + " has " + std::to_string(feat) + " features per token, not a multiple of head_size " +
                       std::to_string(head_size));
    }
    int64_t stride = t.stride(0);
    if (tokens > 1 && stride < feat) fail_value(std::string(name) + " has overlapping tokens");
    return {tokens, feat / head_size, stride};
}

void py_rotary_embedding(In positions, Out query, std::optional<Out> key, int64_t head_size,
                         In cos_sin_cache, bool is_neox) {
    DType dt = float_dtype(query, "query");
    if (head_size <= 0) fail_value("head_size must be positive, got " + std::to_string(head_size));
    Heads q = check_heads(query, "query", head_size);
    Heads k{0, 0, 0};
    if (key) {
        check_same_dtype(float_dtype(*key, "key"), dt, "key", "query");
        k = check_heads(*key, "key", head_size);
        if (k.tokens != q.tokens)
            fail_value("key has " + std::to_string(k.tokens) + " tokens but query has " + std::to_string(q.tokens));
        if (key->data() == query.data()) fail_value("query and key must be different tensors");
    }
    DType cdt = float_dtype(cos_sin_cache, "cos_sin_cache");
    if (cdt != DType::f32 && cdt != dt)
        fail_type(std::string("cos_sin_cache must be float32 or the query dtype (") + dtype_label(dt) + "), got " +
                  dtype_label(cdt));
    if (cos_sin_cache.ndim() != 2) fail_value("cos_sin_cache must be [max_position, rot_dim]");
    Rows cs = as_rows(cos_sin_cache, "cos_sin_cache");
    if (cs.stride != cs.cols) fail_value("cos_sin_cache must be contiguous");
    int64_t rot_dim = cs.cols;
    if (rot_dim % 2 != 0 || rot_dim <= 0 || rot_dim > head_size)
        fail_value("cos_sin_cache rows have " + std::to_string(rot_dim) +
                   " entries; rot_dim must be even and at most head_size " + std::to_string(head_size));
    const int64_t *pos = check_positions(positions, q.tokens, cs.rows);
    nb::gil_scoped_release nogil;
    rotary_embedding(dt, pos, q.tokens, query.data(), q.stride, q.heads, key ? key->data() : nullptr, k.stride,
                     k.heads, head_size, cos_sin_cache.data(), cdt, rot_dim, is_neox);
}

void py_act_and_mul(Activation act, Out out, In input) {
    DType dt = float_dtype(input, "input");
    check_same_dtype(float_dtype(out, "out"), dt, "out", "input");
    Rows x = as_rows(input, "input"), o = as_rows(out, "out");
    if (x.cols % 2 != 0) fail_value("input's last dimension (" + std::to_string(x.cols) + ") must be even: [..., 2 * d]");
    if (o.rows != x.rows || o.cols * 2 != x.cols)
        fail_value("out must be [..., d] for input [..., 2 * d] (d = " + std::to_string(x.cols / 2) + ")");
    check_no_overlap(o, "out", x, "input");
    nb::gil_scoped_release nogil;
    act_and_mul(dt, act, out.data(), o.stride, input.data(), x.stride, x.rows, o.cols);
}

DType dtype_from_name(const std::string &name) {
    for (DType d : {DType::f32, DType::bf16, DType::f16})
        if (name == dtype_label(d)) return d;
    fail_value("dtype must be 'float32', 'bfloat16' or 'float16', got '" + name + "'");
}

void py_linear(Out out, In input, In weight, std::optional<In> bias, bool packed, bool rounded) {
    DType dt = float_dtype(input, "input");
    check_same_dtype(float_dtype(weight, "weight"), dt, "weight", "input");
    const bool out_f32 = out_f32_or_same(float_dtype(out, "out"), dt);
    if (rounded && !out_f32) fail_value("rounded=True needs a float32 out for a bfloat16/float16 input");
    if (weight.ndim() != 2)
        fail_value("weight must be 2-D [out_features, in_features], got " + std::to_string(weight.ndim()) + " dimensions");
    Rows x = as_rows(input, "input"), o = as_rows(out, "out"), w = as_rows(weight, "weight");
    if (w.rows > 1 && w.stride != w.cols) fail_value("weight must be contiguous; call .contiguous() first");
    if (x.cols != w.cols)
        fail_value("input has " + std::to_string(x.cols) + " features but weight is [" + std::to_string(w.rows) + ", " +
                   std::to_string(w.cols) + "] (in_features " + std::to_string(w.cols) + ")");
    if (o.rows != x.rows || o.cols != w.rows)
        fail_value("out must be [" + std::to_string(x.rows) + " rows, " + std::to_string(w.rows) + "], got " +
                   std::to_string(o.rows) + " rows of " + std::to_string(o.cols));
    check_no_overlap(o, "out", x, "input");
    check_no_overlap(o, "out", w, "weight");
    const void *b = nullptr;
    if (bias) {
        check_same_dtype(float_dtype(*bias, "bias"), dt, "bias", "input");
        if (bias->ndim() != 1 || int64_t(bias->shape(0)) != w.rows)
            fail_value("bias must be 1-D with out_features (" + std::to_string(w.rows) + ") elements");
        Rows br = as_rows(*bias, "bias");
        check_no_overlap(o, "out", br, "bias");
        b = bias->data();
    }
    if (packed) check_packable(w.cols, dt, "weight");
    nb::gil_scoped_release nogil;
    linear(dt, out.data(), o.stride, input.data(), x.stride, weight.data(), b, x.rows, w.rows, w.cols, packed, out_f32,
           rounded);
}

void py_linear_pack_weight(Out out, In weight) {
    DType dt = float_dtype(weight, "weight");
    check_same_dtype(float_dtype(out, "out"), dt, "out", "weight");
    if (weight.ndim() != 2 || out.ndim() != 2) fail_value("weight and out must be 2-D [out_features, in_features]");
    Rows w = as_rows(weight, "weight"), o = as_rows(out, "out");
    if (w.rows > 1 && w.stride != w.cols) fail_value("weight must be contiguous; call .contiguous() first");
    if (o.rows > 1 && o.stride != o.cols) fail_value("out must be contiguous");
    if (o.rows != w.rows || o.cols != w.cols) fail_value("out must have the shape of weight");
    check_no_overlap(o, "out", w, "weight");
    check_packable(w.cols, dt, "weight");
    nb::gil_scoped_release nogil;
    linear_pack_weight(dt, out.data(), weight.data(), w.rows, w.cols);
}

void py_linear_packed_rows(Out out, In weight, In ids) {
    DType dt = float_dtype(weight, "weight");
    check_same_dtype(float_dtype(out, "out"), dt, "out", "weight");
    if (weight.ndim() != 2 || out.ndim() != 2) fail_value("weight and out must be 2-D [rows, features]");
    Rows w = as_rows(weight, "weight"), o = as_rows(out, "out");
    if (w.rows > 1 && w.stride != w.cols) fail_value("weight must be contiguous (linear_pack_weight's output)");
    check_packable(w.cols, dt, "weight");
    const auto *id = static_cast<const int64_t *>(int_tensor(ids, "ids", 64, 1));
    const int64_t n = int64_t(ids.shape(0));
    if (o.rows != n || o.cols != w.cols)
        fail_value("out must be [len(ids), " + std::to_string(w.cols) + "], got [" + std::to_string(o.rows) + ", " +
                   std::to_string(o.cols) + "]");
    check_no_overlap(o, "out", w, "weight");
    const auto [lo, hi] = std::minmax_element(id, id + n);
    if (n > 0 && (*lo < 0 || *hi >= w.rows))
        throw nb::index_error(("token ids must be in [0, " + std::to_string(w.rows) + "), got " + std::to_string(*lo) +
                               ".." + std::to_string(*hi))
                                  .c_str());
    nb::gil_scoped_release nogil;
    linear_packed_rows(dt, out.data(), o.stride, weight.data(), id, n, w.rows, w.cols);
}

void py_bind_threads(const std::vector<int> &cpus) {
    if (cpus.empty()) fail_value("bind_threads needs at least one CPU id");
    for (int c : cpus)
        if (c < 0) fail_value("CPU ids must be non-negative, got " + std::to_string(c));
    int err = bind_threads(cpus.data(), int(cpus.size()));
    if (err != 0) throw nb::builtin_exception(nb::exception_type::runtime_error,
                                              (std::string("sched_setaffinity failed: ") + std::strerror(err)).c_str());
}

}  // namespace

NB_MODULE(CPUINFER_MODULE(CPUINFER_VARIANT), m) {
    m.doc() = "cpuinfer kernels, variant " CPUINFER_STR(CPUINFER_VARIANT);
    m.attr("VARIANT") = CPUINFER_STR(CPUINFER_VARIANT);
    m.attr("ABI_STAMP") = CPUINFER_ABI_STAMP;
    m.attr("VECTOR_LAYER") = vector_layer();
    m.attr("VECTOR_WIDTH") = vector_width();

    m.def("rms_norm", &py_rms_norm, nb::arg("out"), nb::arg("input"), nb::arg("weight"), nb::arg("epsilon"),
          "out = input * rsqrt(mean(input^2) + epsilon) * weight, per row.");
    m.def("fused_add_rms_norm", &py_fused_add_rms_norm, nb::arg("input"), nb::arg("residual"), nb::arg("weight"),
          nb::arg("epsilon"), "In place: residual += input; input = rms_norm(residual).");
    m.def("argmax", &py_argmax, nb::arg("out"), nb::arg("logits"),
          "out[r] = argmax of logits row r: the first index of the maximum, or of the first NaN (torch.argmax).");
    m.def("rotary_embedding", &py_rotary_embedding, nb::arg("positions"), nb::arg("query"), nb::arg("key").none(),
          nb::arg("head_size"), nb::arg("cos_sin_cache"), nb::arg("is_neox"),
          "Rotary position embedding applied in place to query and key.");
    m.def("add_layer_norm", &py_add_layer_norm, nb::arg("out"), nb::arg("input"), nb::arg("residual").none(),
          nb::arg("weight"), nb::arg("bias"), nb::arg("epsilon"),
          "out = LayerNorm(input + residual) (residual None: of input), statistics in float32, float32 weight and "
          "bias; out may be input or residual.");
    m.def("gelu", [](Out out, In input) { py_act(Activation::gelu, out, input); }, nb::arg("out"), nb::arg("input"),
          "out = gelu(input) (exact erf form); out may be input.");
    m.def("gelu_tanh", [](Out out, In input) { py_act(Activation::gelu_tanh, out, input); }, nb::arg("out"),
          nb::arg("input"), "out = gelu_tanh(input); out may be input.");
    m.def("silu_and_mul", [](Out out, In input) { py_act_and_mul(Activation::silu, out, input); },
          nb::arg("out"), nb::arg("input"), "out = silu(x[..., :d]) * x[..., d:].");
    m.def("gelu_and_mul", [](Out out, In input) { py_act_and_mul(Activation::gelu, out, input); },
          nb::arg("out"), nb::arg("input"), "out = gelu(x[..., :d]) * x[..., d:] (exact erf form).");
    m.def("gelu_tanh_and_mul", [](Out out, In input) { py_act_and_mul(Activation::gelu_tanh, out, input); },
          nb::arg("out"), nb::arg("input"), "out = gelu_tanh(x[..., :d]) * x[..., d:].");
    m.def("swiglu_oai_and_mul", [](Out out, In input) { py_act_and_mul(Activation::swiglu_oai, out, input); },
          nb::arg("out"), nb::arg("input"),
          "gpt-oss's clamped SwiGLU: out = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7).");
    bind_attention(m);
    bind_decoder(m);
    bind_quant(m);
    bind_comm(m);
    m.def("linear", &py_linear, nb::arg("out"), nb::arg("input"), nb::arg("weight"), nb::arg("bias").none(),
          nb::arg("packed") = false, nb::arg("rounded") = false,
          "out = input @ weight.T (+ bias), f32 accumulation, rounded once to out's dtype (input's, or float32 "
          "for the unrounded sums). packed: weight is in linear_pack_weight's layout (GEMV for few rows, blocked "
          "GEMM for many); else a GEMV at every M. rounded (float32 out): the sums rounded to input's dtype, "
          "as float32.");
    m.def("linear_pack_weight", &py_linear_pack_weight, nb::arg("out"), nb::arg("weight"),
          "Write weight [N, K] into out in the packed panel layout (K % linear_pack_pair(dtype) == 0).");
    m.def("linear_packed_rows", &py_linear_packed_rows, nb::arg("out"), nb::arg("weight"), nb::arg("ids"),
          "out[i] = row ids[i] of the weight linear_pack_weight packed into `weight` (an embedding table kept "
          "packed for its tied lm_head); ids: int64, each in [0, rows).");
    m.attr("LINEAR_PACK_COLS") = linear_pack_cols();
    m.def("linear_pack_pair", [](const std::string &dtype) { return linear_pack_pair(dtype_from_name(dtype)); },
          nb::arg("dtype"), "Consecutive k per column in the packed layout for dtype ('bfloat16', ...).");
    m.def("linear_tile_impl", [](const std::string &dtype) { return std::string(linear_tile_impl(dtype_from_name(dtype))); },
          nb::arg("dtype"), "Tile of the packed linear for dtype ('amx', 'amx-fp16', 'avx512bf16', 'bfdot', 'fmlal', 'fma').");
    m.def("quant_wide_impl", [](const std::string &dtype) { return std::string(quant_wide_impl(dtype_from_name(dtype))); },
          nb::arg("dtype"), "Tile of the quantized linear with 16-bit activations (act16 weights) for dtype: "
          "'avx512bf16', 'portable-f32'.");
    m.def("linear_peak_flops", [](const std::string &dtype, double seconds) {
              DType dt = dtype_from_name(dtype);
              nb::gil_scoped_release nogil;
              return linear_peak_flops(dt, seconds);
          }, nb::arg("dtype"), nb::arg("seconds") = 0.2,
          "One core's peak flop/s on the packed tile's instruction for dtype (an in-register loop).");
    m.def("threading_runtime", &threading_runtime, "Path of the OpenMP runtime kernels run on ('' = serial).");
    m.def("max_threads", &max_threads, "Threads a parallel kernel uses.");
    m.def("bind_threads", &py_bind_threads, nb::arg("cpus"),
          "Pin the OpenMP team's thread i to cpus[i] (Linux).");
}
