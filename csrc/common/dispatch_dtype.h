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

}  // namespace cpuinfer
