// Runs a generic lambda with the C++ element type that matches a DType.
#pragma once
#include <stdexcept>
#include "dtype.h"

namespace cpuinfer {

template <typename F>
inline void with_float_type(DType dt, F &&f) {
    switch (dt) {
        case DType::f32: f(float{}); return;
        case DType::bf16: f(bf16_t{}); return;
        case DType::f16: f(f16_t{}); return;
        default: throw std::invalid_argument("unsupported dtype for this kernel");
    }
}

// f(T{}, O{}) for inputs of dt and an output of dt, or of float with out_f32:
// the f32 sums left unrounded, for sums that others join before the one
// rounding (a tensor-parallel rank's share of a row-parallel projection).
template <typename F>
inline void with_float_types(DType dt, bool out_f32, F &&f) {
    with_float_type(dt, [&](auto t) {
        if (out_f32) f(t, float{});
        else f(t, t);
    });
}

// As with_float_type, plus fp8_e5m2 (KV cache element types).
template <typename F>
inline void with_cache_type(DType dt, F &&f) {
    if (dt == DType::fp8_e5m2) {
        f(fp8_e5m2_t{});
    } else {
        with_float_type(dt, f);
    }
}

}  // namespace cpuinfer
