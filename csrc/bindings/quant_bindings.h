// Binding of the quantized linear layer (kernels.h: QuantMatrix, quant_*).
//
// A quantized weight crosses as a Python object (cpuinfer.quantization's
// QuantWeight) with attributes qs, d, z, m (tensors; z or m is None), bits,
// group, n, k and optionally perm (int32 [k] or None: the packed k order) and act16 (True: x stays 16-bit,
// QuantMatrix::act16); a stack of them (QuantStack) as an object whose `parts` lists them. Every tensor's dtype and size is checked against the shape it claims,
// so a malformed weight is a ValueError naming it, never a read past its end.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "../common/kernels.h"
#include "attention_bindings.h"
#include "tensor_checks.h"

namespace cpuinfer::bind {

// A contiguous tensor of `count` elements of an integer or float16 dtype.
template <typename A>
inline const void *flat_tensor(const A &t, const std::string &name, uint8_t code, int bits, int64_t count,
                               const char *dtype_name_) {
    check_cpu(t, name.c_str());
    nb::dlpack::dtype d = t.dtype();
    if (d.code != code || d.bits != bits || d.lanes != 1)
        fail_type(name + " must be a " + dtype_name_ + " tensor, got " + dtype_name(d));
    int64_t n = 1, expect = 1;
    for (size_t i = t.ndim(); i-- > 0;) {
        if (t.shape(i) > 1 && t.stride(i) != expect) fail_value(name + " must be contiguous");
        expect *= int64_t(t.shape(i));
        n *= int64_t(t.shape(i));
    }
    if (n != count)
        fail_value(name + " has " + str(n) + " elements, the weight's shape needs " + str(count) +
                   "; the quantized weight is corrupt: rebuild it with cpuinfer.quantization");
    return t.data();
}

using Code = nb::dlpack::dtype_code;

// Shape fields of a quantized weight, checked (what the kernels assume).
inline QuantMatrix quant_shape(int bits, int64_t group, int64_t n, int64_t k, const std::string &name) {
    if (bits != 4 && bits != 5 && bits != 6 && bits != 8) fail_value(name + ": bits must be 4, 5, 6 or 8, got " + str(bits));
    if (n < 1 || k < 32 || k % 32 != 0)
        fail_value(name + ": shape [" + str(n) + ", " + str(k) + "] needs n >= 1 and k a positive multiple of 32");
    if (!(group == 16 || (group >= 32 && group % 32 == 0 && k % group == 0)))
        fail_value(name + ": group " + str(group) + " must be 16, or a multiple of 32 that divides k = " + str(k));
    QuantMatrix q;
    q.bits = bits;
    q.group = group;
    q.N = n;
    q.K = k;
    return q;
}

// One QuantWeight object as a QuantMatrix; `keep` collects the tensors' owners.
inline QuantMatrix quant_part(nb::handle obj, const std::string &name, std::vector<nb::object> &keep) {
    for (const char *attr : {"qs", "d", "z", "m", "bits", "group", "n", "k"})
        if (!nb::hasattr(obj, attr)) fail_type(name + " must be a quantized weight (no attribute '" + attr + "')");
    QuantMatrix q = quant_shape(nb::cast<int>(obj.attr("bits")), nb::cast<int64_t>(obj.attr("group")),
                                nb::cast<int64_t>(obj.attr("n")), nb::cast<int64_t>(obj.attr("k")), name);
    const int64_t panels = quant_panels(q.N), blocks = q.K / 32, groups = q.K / q.group;
    nb::object z = obj.attr("z"), m = obj.attr("m");
    if (z.is_none() == m.is_none()) fail_value(name + ": exactly one of z (zero points) and m (minimums) is set");
    if (q.group == 16 && z.is_none()) fail_value(name + ": group 16 needs zero points (z)");
    if (!quant_form_supported(q.bits, q.group, !m.is_none()))
        fail_value(name + ": no kernel for " + str(q.bits) + "-bit values with " + (m.is_none() ? "zero points" : "minimums") +
                   " in groups of " + str(q.group) + " (5 bits: groups of 32 or more; 6 bits: zero points in groups of 16)");
    q.act16 = nb::cast<bool>(nb::getattr(obj, "act16", nb::bool_(false)));
    q.fp4 = nb::cast<bool>(nb::getattr(obj, "fp4", nb::bool_(false)));
    if (q.fp4 && !quant_form_supported(q.bits, q.group, !m.is_none(), q.act16, true))
        fail_value(name + ": MXFP4 (fp4=True) is 4-bit codes in groups of 32 with their exponents in z, run with int8 "
                   "activations (act16=False); got " + str(q.bits) + " bits in groups of " + str(q.group));
    if (q.fp4 != obj.attr("d").is_none())
        fail_value(name + (q.fp4 ? ": an MXFP4 weight (fp4=True) has no d (its scales are the exponents in z)"
                                 : ": d (the group scales) is missing"));
    if (q.act16 && !quant_form_supported(q.bits, q.group, !m.is_none(), true))
        fail_value(name + ": no 16-bit-activation kernel for " + str(q.bits) + "-bit values in groups of " + str(q.group) +
                   " (4 or 8 bits in groups of 32 or more); set act16=False to run it with int8 activations");
    auto tensor = [&](nb::object o, const char *what) {
        In t;
        nb::detail::cleanup_list cleanup(nullptr);
        if (!t.load(o, uint8_t(nb::detail::cast_flags::convert), &cleanup)) {
            cleanup.release();
            fail_type(name + "." + what + " must be a tensor");
        }
        cleanup.release();
        keep.push_back(o);
        return t;
    };
    In qs = tensor(obj.attr("qs"), "qs");
    q.qs = static_cast<const uint8_t *>(
        flat_tensor(qs, name + ".qs", uint8_t(Code::UInt), 8, panels * blocks * 16 * 32 * q.bits / 8, "uint8"));
    if (!q.fp4) {
        In d = tensor(obj.attr("d"), "d");
        q.d = static_cast<const f16_t *>(flat_tensor(d, name + ".d", uint8_t(Code::Float), 16, panels * groups * 16, "float16"));
    }
    if (!z.is_none()) {
        In zt = tensor(z, "z");
        q.z = static_cast<const uint8_t *>(flat_tensor(zt, name + ".z", uint8_t(Code::UInt), 8, panels * groups * 16, "uint8"));
    } else {
        In mt = tensor(m, "m");
        q.m = static_cast<const f16_t *>(flat_tensor(mt, name + ".m", uint8_t(Code::Float), 16, panels * groups * 16, "float16"));
    }
    // perm (optional: act-order GPTQ) is read by index, so it must be a permutation of 0..k-1.
    nb::object perm = nb::getattr(obj, "perm", nb::none());
    if (!perm.is_none()) {
        In pt = tensor(perm, "perm");
        q.perm = static_cast<const int32_t *>(flat_tensor(pt, name + ".perm", uint8_t(Code::Int), 32, q.K, "int32"));
        std::vector<uint8_t> seen(size_t(q.K), 0);
        for (int64_t i = 0; i < q.K; ++i) {
            const int32_t v = q.perm[i];
            if (v < 0 || v >= q.K || seen[size_t(v)]++)
                fail_value(name + ".perm is not a permutation of 0.." + str(q.K - 1) + " (entry " + str(i) + " = " +
                           str(v) + "); the quantized weight is corrupt: rebuild it with cpuinfer.quantization");
        }
    }
    return q;
}

// A QuantWeight or QuantStack (object with `parts`) as a LinearWeight; n, k: its total shape.
inline LinearWeight quant_weight(nb::handle obj, const std::string &name, std::vector<nb::object> &keep, int64_t &n,
                                 int64_t &k) {
    LinearWeight w;
    std::vector<nb::handle> list;
    if (nb::hasattr(obj, "parts")) {
        nb::object parts = obj.attr("parts");
        keep.push_back(parts);
        for (nb::handle p : parts) list.push_back(p);
    } else {
        list.push_back(obj);
    }
    if (list.empty() || list.size() > 3) fail_value(name + " must have 1 to 3 quantized parts, got " + str(int64_t(list.size())));
    keep.push_back(nb::borrow(obj));
    n = 0;
    k = -1;
    for (size_t i = 0; i < list.size(); ++i) {
        QuantMatrix q = quant_part(list[i], list.size() == 1 ? name : name + ".parts[" + str(int64_t(i)) + "]", keep);
        if (k >= 0 && q.K != k) fail_value(name + ": parts have different in_features (" + str(k) + ", " + str(q.K) + ")");
        k = q.K;
        n += q.N;
        w.part[i] = q;
    }
    w.parts = int(list.size());
    return w;
}

inline bool is_quant_weight(nb::handle h) { return nb::hasattr(h, "parts") || nb::hasattr(h, "qs"); }

inline void py_quant_linear(Out out, In input, nb::handle weight, std::optional<In> bias) {
    DType dt = float_dtype(input, "input");
    const bool out_f32 = out_f32_or_same(float_dtype(out, "out"), dt);
    std::vector<nb::object> keep;
    int64_t N, K;
    LinearWeight w = quant_weight(weight, "weight", keep, N, K);
    Rows x = as_rows(input, "input"), o = as_rows(out, "out");
    if (x.cols != K) fail_value("input has " + str(x.cols) + " features but the weight's in_features is " + str(K));
    if (o.rows != x.rows || o.cols != N)
        fail_value("out must be [" + str(x.rows) + " rows, " + str(N) + "], got " + str(o.rows) + " rows of " + str(o.cols));
    check_no_overlap(o, "out", x, "input");
    const void *b = nullptr;
    if (bias) {
        check_same_dtype(float_dtype(*bias, "bias"), dt, "bias", "input");
        if (bias->ndim() != 1 || int64_t(bias->shape(0)) != N)
            fail_value("bias must be 1-D with out_features (" + str(N) + ") elements");
        b = bias->data();
    }
    nb::gil_scoped_release nogil;
    linear_weight(dt, out.data(), o.stride, input.data(), x.stride, w, b, x.rows, N, K, out_f32);
}

// Pack u [n, k] (uint8 values) with d and z or m [n, k / group] into a QuantWeight's tensors (MXFP4: the codes
// and their exponents in z, no d).
inline void py_quant_pack(nb::handle weight, In u, std::optional<In> d, std::optional<In> z, std::optional<In> m) {
    std::vector<nb::object> keep;
    QuantMatrix q = quant_part(weight, "weight", keep);
    const int64_t groups = q.K / q.group;
    const void *up = flat_tensor(u, "u", uint8_t(Code::UInt), 8, q.N * q.K, "uint8");
    if (bool(d) == q.fp4) fail_value(q.fp4 ? "an MXFP4 weight takes no d (its scales are the exponents in z)" : "pass d");
    const void *dp = d ? flat_tensor(*d, "d", uint8_t(Code::Float), 16, q.N * groups, "float16") : nullptr;
    if (bool(z) != bool(q.z) || bool(m) != bool(q.m)) fail_value("pass z or m as the weight has them");
    const void *zp = z ? flat_tensor(*z, "z", uint8_t(Code::UInt), 8, q.N * groups, "uint8") : nullptr;
    if (q.fp4) {  // quant_tile.h's fp4_scale is exact for these
        const uint8_t *e = static_cast<const uint8_t *>(zp);
        for (int64_t i = 0; i < q.N * groups; ++i)
            if (e[i] < 2 || e[i] > 254)
                fail_value("MXFP4 exponent " + str(e[i]) + " at group " + str(i) +
                           " is outside 2..254 (2^-126 .. 2^126); dequantize this weight instead");
    }
    const void *mp = m ? flat_tensor(*m, "m", uint8_t(Code::Float), 16, q.N * groups, "float16") : nullptr;
    if (q.bits < 8) {
        const uint8_t *v = static_cast<const uint8_t *>(up);
        const int top = (1 << q.bits) - 1;
        for (int64_t i = 0; i < q.N * q.K; ++i)
            if (v[i] > top)
                fail_value("u holds " + str(v[i]) + ", more than " + str(q.bits) + " bits, at index " + str(i));
    }
    nb::gil_scoped_release nogil;
    quant_pack(q, static_cast<const uint8_t *>(up), static_cast<const f16_t *>(dp), static_cast<const uint8_t *>(zp),
               static_cast<const f16_t *>(mp), const_cast<uint8_t *>(q.qs), const_cast<f16_t *>(q.d),
               const_cast<uint8_t *>(q.z), const_cast<f16_t *>(q.m));
}

// out[i] = row ids[i] of the dequantized weight (one part).
inline void py_quant_rows(Out out, nb::handle weight, In ids) {
    DType dt = float_dtype(out, "out");
    std::vector<nb::object> keep;
    QuantMatrix q = quant_part(weight, "weight", keep);
    check_cpu(ids, "ids");
    nb::dlpack::dtype idt = ids.dtype();
    if (idt.code != uint8_t(Code::Int) || idt.bits != 64 || ids.ndim() != 1 || (ids.shape(0) > 1 && ids.stride(0) != 1))
        fail_type("ids must be a contiguous 1-D int64 tensor");
    const int64_t n = int64_t(ids.shape(0));
    const int64_t *ip = static_cast<const int64_t *>(ids.data());
    for (int64_t i = 0; i < n; ++i)
        if (ip[i] < 0 || ip[i] >= q.N) fail_value("ids must be in [0, " + str(q.N) + "), got " + str(ip[i]));
    Rows o = as_rows(out, "out");
    if (o.rows != n || o.cols != q.K) fail_value("out must be [" + str(n) + ", " + str(q.K) + "]");
    nb::gil_scoped_release nogil;
    quant_rows(dt, out.data(), o.stride, q, ip, n);
}

inline void bind_quant(nb::module_ &m) {
    m.def("quant_linear", &py_quant_linear, nb::arg("out"), nb::arg("input"), nb::arg("weight"),
          nb::arg("bias").none(),
          "out = input @ W.T (+ bias) for a quantized weight (QuantWeight or QuantStack): int8 activations per "
          "block of 32 and the variant's integer dot product (or, for a part with act16, the input as it is against "
          "the widened weight), f32 accumulation, rounded once to out's dtype (input's, or float32 for the "
          "unrounded sums).");
    m.def("quant_pack", &py_quant_pack, nb::arg("weight"), nb::arg("u"), nb::arg("d").none(), nb::arg("z").none(),
          nb::arg("m").none(), "Fill weight's qs, d, z / m from values u [n, k] and per-group d and z or m.");
    m.def("quant_rows", &py_quant_rows, nb::arg("out"), nb::arg("weight"), nb::arg("ids"),
          "out[i] = dequantized row ids[i] of a quantized weight.");
    m.def("quant_tile_impl", [] { return std::string(quant_tile_impl()); },
          "The quantized linear's tile on this variant ('avx512vnni', 'neon_i8mm', 'vxe', 'portable', ...).");
}

}  // namespace cpuinfer::bind
