// Scalar element types and exact scalar conversions, shared by every ISA.
// bf16/f16 are distinct structs (not bare uint16_t) so that the vector
// layer can overload load/store on the element type.
#pragma once
#include <cstdint>
#include <cstring>

namespace cpuinfer {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };
struct fp8_e5m2_t { uint8_t bits; };  // IEEE-style 1-5-2 float: the top byte of an f16

enum class DType : int { f32 = 0, bf16 = 1, f16 = 2, fp8_e5m2 = 3 };

// Bytes per element.
inline int64_t dtype_size(DType dt) { return dt == DType::f32 ? 4 : dt == DType::fp8_e5m2 ? 1 : 2; }

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) { return bits_f32(uint32_t(x.bits) << 16); }

// Round to nearest even; NaN stays a quiet NaN (as torch does).
inline uint16_t f32_to_bf16_bits(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

// IEEE half <-> float, exact, with subnormals, infinities and NaN.
inline float half_bits_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        u = sign;
    } else {  // subnormal half: normalise
        int e = -1;
        do { mant <<= 1; ++e; } while ((mant & 0x400u) == 0);
        u = sign | (uint32_t(112 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
    return bits_f32(u);
}

inline uint16_t f32_to_half_bits(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
    if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to inf
    if (a < 0x38800000u) {  // result is subnormal or zero: let the FPU round
        float r = bits_f32(a) + 0.5f;  // 0.5 = 2^-1; ulp of half subnormals is 2^-24
        return uint16_t(sign | uint16_t(f32_bits(r) - 0x3f000000u));
    }
    uint32_t rounded = a + 0x0fffu + ((a >> 13) & 1u) - 0x38000000u;
    return uint16_t(sign | uint16_t(rounded >> 13));
}

inline float to_f32(f16_t x) { return half_bits_to_f32(x.bits); }

// e5m2 is f16 with the low 8 mantissa bits dropped, so widening is exact.
inline float to_f32(fp8_e5m2_t x) { return half_bits_to_f32(uint16_t(x.bits) << 8); }

// f32 -> e5m2 exactly as torch's c10::Float8_e5m2 does it: round to nearest
// even; |x| >= 2^16 (the first value past the largest finite 57344 that does
// not round down to it) becomes inf, NaN becomes 0x7f. Torch does not clamp
// overflow to the largest finite value, and bit-for-bit agreement with
// tensor.to(torch.float8_e5m2) is the contract, so neither do we.
inline uint8_t f32_to_e5m2_bits(float f) {
    uint32_t u = f32_bits(f);
    uint8_t sign = uint8_t((u >> 24) & 0x80u);
    uint32_t a = u & 0x7fffffffu;
    uint8_t r;
    if (a >= (143u << 23)) {
        r = a > 0x7f800000u ? 0x7f : 0x7c;
    } else if (a < (113u << 23)) {  // subnormal or zero in e5m2: let the FPU round
        float x = bits_f32(a) + bits_f32(134u << 23);
        r = uint8_t(f32_bits(x) - (134u << 23));
    } else {
        uint32_t odd = (a >> 21) & 1u;
        a += (uint32_t(15 - 127) << 23) + 0xfffffu + odd;
        r = uint8_t(a >> 21);
    }
    return uint8_t(r | sign);
}

template <typename T> inline T from_f32(float f);
template <> inline float from_f32<float>(float f) { return f; }
template <> inline bf16_t from_f32<bf16_t>(float f) { return bf16_t{f32_to_bf16_bits(f)}; }
template <> inline f16_t from_f32<f16_t>(float f) { return f16_t{f32_to_half_bits(f)}; }
template <> inline fp8_e5m2_t from_f32<fp8_e5m2_t>(float f) { return fp8_e5m2_t{f32_to_e5m2_bits(f)}; }

}  // namespace cpuinfer
