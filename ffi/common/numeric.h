// Scalar conversions between the storage types the handlers accept (bf16, f16, f32, f64)
// and their accumulation types (f32, or f64 for f64), with round-to-nearest-even.
// Internal linkage (anonymous namespace): translation units compiled for different instruction
// sets each keep their own copy instead of sharing one through the linker.
#pragma once

#include <cstdint>
#include <cstring>

namespace jax_dsa {
namespace {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

inline float BitsToFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t FloatToBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float ToFloat(bf16_t x) { return BitsToFloat(uint32_t(x.bits) << 16); }

inline bf16_t FromFloatBf16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}

inline float ToFloat(f16_t x) {
  uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t man = x.bits & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return BitsToFloat(sign);
    // Subnormal half: value = man * 2^-24, exact in float.
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

inline f16_t FromFloatF16(float f) {
  uint32_t u = FloatToBits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16_t{uint16_t(sign | 0x7e00u)};  // NaN
  if (a >= 0x477ff000u) return f16_t{uint16_t(sign | 0x7c00u)};  // overflow to inf (after rounding)
  if (a < 0x38800000u) {
    // Result is subnormal or zero: round a * 2^24 to an integer, nearest even.
    float v = BitsToFloat(a) * 16777216.0f;
    uint32_t i = uint32_t(v);
    float rem = v - float(i);
    if (rem > 0.5f || (rem == 0.5f && (i & 1u))) ++i;
    return f16_t{uint16_t(sign | i)};
  }
  uint32_t e = (a >> 23) - 112u;
  uint32_t m = a & 0x7fffffu;
  uint32_t h = (e << 10) | (m >> 13);
  uint32_t rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into the exponent correctly
  return f16_t{uint16_t(sign | h)};
}

// Storage type -> accumulation type.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };


template <typename A, typename T> inline A ToAcc(T x);
template <> inline float ToAcc<float, float>(float x) { return x; }
template <> inline double ToAcc<double, double>(double x) { return x; }
template <> inline float ToAcc<float, bf16_t>(bf16_t x) { return ToFloat(x); }
template <> inline float ToAcc<float, f16_t>(f16_t x) { return ToFloat(x); }

template <typename T, typename A> inline T FromAcc(A x);
template <> inline float FromAcc<float, float>(float x) { return x; }
template <> inline double FromAcc<double, double>(double x) { return x; }
template <> inline bf16_t FromAcc<bf16_t, float>(float x) { return FromFloatBf16(x); }
template <> inline f16_t FromAcc<f16_t, float>(float x) { return FromFloatF16(x); }

}  // namespace
}  // namespace jax_dsa
