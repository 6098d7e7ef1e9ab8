// Validation of tensors arriving through DLPack: everything a kernel assumes
// (device, dtype, shape, strides, aliasing) is checked here and reported as a
// Python exception naming the argument, so no bad call can reach the kernels.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

#include "../common/dtype.h"
#include "../common/kernels.h"
#include "tensor_arg.h"

namespace cpuinfer::bind {

namespace nb = nanobind;
using In = TensorArg<true>;    // read only
using Out = TensorArg<false>;  // written in place

[[noreturn]] inline void fail_type(const std::string &msg) { throw nb::type_error(msg.c_str()); }
[[noreturn]] inline void fail_value(const std::string &msg) { throw nb::value_error(msg.c_str()); }

inline std::string dtype_name(nb::dlpack::dtype d) {
    using C = nb::dlpack::dtype_code;
    const char *kind = d.code == uint8_t(C::Float)    ? "float"
                       : d.code == uint8_t(C::Bfloat) ? "bfloat"
                       : d.code == uint8_t(C::Int)    ? "int"
                       : d.code == uint8_t(C::UInt)   ? "uint"
                       : d.code == uint8_t(C::Bool)   ? "bool"
                                                      : "other";
    return std::string(kind) + std::to_string(int(d.bits));
}

template <typename A>
inline void check_cpu(const A &a, const char *name) {
    if (a.device_type() != nb::device::cpu::value)
        fail_value(std::string(name) + " must be a CPU tensor (DLPack device type " +
                   std::to_string(a.device_type()) + " given)");
}

// The float dtype of a, one of f32 / bf16 / f16.
template <typename A>
inline DType float_dtype(const A &a, const char *name) {
    check_cpu(a, name);
    using C = nb::dlpack::dtype_code;
    nb::dlpack::dtype d = a.dtype();
    if (d.lanes == 1) {
        if (d.code == uint8_t(C::Float) && d.bits == 32) return DType::f32;
        if (d.code == uint8_t(C::Float) && d.bits == 16) return DType::f16;
        if (d.code == uint8_t(C::Bfloat) && d.bits == 16) return DType::bf16;
    }
    fail_type(std::string(name) + " has dtype " + dtype_name(d) +
              "; supported dtypes are float32, bfloat16 and float16");
}

inline const char *dtype_label(DType d) {
    switch (d) {
        case DType::f32: return "float32";
        case DType::bf16: return "bfloat16";
        case DType::f16: return "float16";
        default: return "float8_e5m2";
    }
}

// A tensor seen as a matrix of rows: the last dimension is contiguous and all
// leading dimensions collapse into one row index with a single stride.
struct Rows {
    int64_t rows = 1, cols = 0, stride = 0;
    const char *lo = nullptr, *hi = nullptr;  // byte range touched, for overlap checks
};

template <typename A>
inline Rows as_rows(const A &a, const char *name) {
    Rows r;
    if (a.ndim() < 1) fail_value(std::string(name) + " must have at least 1 dimension");
    size_t nd = a.ndim();
    r.cols = int64_t(a.shape(nd - 1));
    for (size_t i = 0; i + 1 < nd; ++i) r.rows *= int64_t(a.shape(i));
    if (r.cols > 1 && a.stride(nd - 1) != 1)
        fail_value(std::string(name) + " must be contiguous in its last dimension (stride " +
                   std::to_string(a.stride(nd - 1)) + "); call .contiguous() first");
    r.stride = nd >= 2 ? a.stride(nd - 2) : r.cols;
    for (size_t i = 0; i + 2 < nd; ++i) {
        if (a.shape(i) > 1 && a.stride(i) != a.stride(i + 1) * int64_t(a.shape(i + 1)))
            fail_value(std::string(name) + " has leading dimensions that cannot be viewed as rows; call .contiguous() first");
    }
    if (r.rows > 1 && r.stride < r.cols)
        fail_value(std::string(name) + " has overlapping rows (row stride " + std::to_string(r.stride) + " < " +
                   std::to_string(r.cols) + ")");
    size_t item = a.itemsize();
    r.lo = static_cast<const char *>(a.data());
    r.hi = r.rows == 0 || r.cols == 0 ? r.lo : r.lo + ((r.rows - 1) * r.stride + r.cols) * int64_t(item);
    return r;
}

inline void check_no_overlap(const Rows &a, const char *an, const Rows &b, const char *bn) {
    if (a.lo < b.hi && b.lo < a.hi)
        fail_value(std::string(an) + " and " + bn + " overlap in memory; pass separate tensors");
}

inline void check_same_dtype(DType got, DType want, const char *name, const char *ref) {
    if (got != want)
        fail_type(std::string(name) + " has dtype " + dtype_label(got) + " but " + ref + " is " + dtype_label(want));
}

// A linear layer's out: the input's dtype, or float32 for its unrounded sums; returns whether float32 (and
// the input is not).
inline bool out_f32_or_same(DType out, DType in) {
    if (out != in && out != DType::f32)
        fail_type(std::string("out has dtype ") + dtype_label(out) + " but input is " + dtype_label(in) +
                  " (out must be the input's dtype, or float32 for the unrounded sums)");
    return out != in;
}

// A weight of K input features can take the packed layout (linear_pack_pair) for dt.
inline void check_packable(int64_t K, DType dt, const char *name) {
    if (K % linear_pack_pair(dt) != 0)
        fail_value(std::string(name) + " has " + std::to_string(K) + " input features; the packed layout needs a " +
                   "multiple of " + std::to_string(linear_pack_pair(dt)) + " for " + dtype_label(dt) +
                   " (linear_pack_pair)");
}

}  // namespace cpuinfer::bind
