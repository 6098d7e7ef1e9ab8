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
    } else {  // gelu_tanh (swiglu_oai goes through gated())
        vf inner = mul(splat(0.79788456080286536f), fma(mul(mul(x, x), x), splat(0.044715f), x));
        return mul(mul(x, splat(0.5f)), add(splat(1.0f), tanh(inner)));
    }
}

// gpt-oss's clamped SwiGLU constants (transformers' GptOssExperts: swiglu_alpha, swiglu_limit).
constexpr float kSwigluOaiAlpha = 1.702f, kSwigluOaiLimit = 7.0f;

// The gated MLP's output for one vector of gate and up values: act(gate) * up, or gpt-oss's
// (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g) with g = min(gate, L).
template <Activation A>
inline vec::vf gated(vec::vf gate, vec::vf up) {
    using namespace vec;
    if constexpr (A == Activation::swiglu_oai) {
        const vf lim = splat(kSwigluOaiLimit);
        vf g = min(gate, lim);
        vf u = add(max(min(up, lim), splat(-kSwigluOaiLimit)), splat(1.0f));
        vf glu = div(g, add(splat(1.0f), exp(mul(g, splat(-kSwigluOaiAlpha)))));
        return mul(u, glu);
    } else {
        return mul(activate<A>(gate), up);
    }
}

// f(tag) with tag an std::integral_constant of act.
template <typename F>
inline void with_activation(Activation act, F &&f) {
    switch (act) {
        case Activation::silu: f(std::integral_constant<Activation, Activation::silu>()); break;
        case Activation::gelu: f(std::integral_constant<Activation, Activation::gelu>()); break;
        case Activation::gelu_tanh: f(std::integral_constant<Activation, Activation::gelu_tanh>()); break;
        case Activation::swiglu_oai: f(std::integral_constant<Activation, Activation::swiglu_oai>()); break;
    }
}

}  // namespace cpuinfer
