// The gated MLP's activations on f32 vectors, shared by act_and_mul
// (activation.cpp) and the packed GEMM's fused gate/up epilogue
// (linear_packed.cpp), so that both give an element the same bits.
#pragma once
#include <type_traits>

#include "kernels.h"
#include "vec.h"

namespace cpuinfer {

template <Activation A>
inline vec::vf activate(vec::vf x) {
    using namespace vec;
    if constexpr (A == Activation::silu) {
        return div(x, add(splat(1.0f), exp(mul(x, splat(-1.0f)))));
    } else if constexpr (A == Activation::gelu) {
        return mul(mul(x, splat(0.5f)), add(splat(1.0f), erf(mul(x, splat(0.70710678118654752f)))));
    } else {
        vf inner = mul(splat(0.79788456080286536f), fma(mul(mul(x, x), x), splat(0.044715f), x));
        return mul(mul(x, splat(0.5f)), add(splat(1.0f), tanh(inner)));
    }
}

// f(tag) with tag an std::integral_constant of act.
template <typename F>
inline void with_activation(Activation act, F &&f) {
    switch (act) {
        case Activation::silu: f(std::integral_constant<Activation, Activation::silu>()); break;
        case Activation::gelu: f(std::integral_constant<Activation, Activation::gelu>()); break;
        case Activation::gelu_tanh: f(std::integral_constant<Activation, Activation::gelu_tanh>()); break;
    }
}

}  // namespace cpuinfer
