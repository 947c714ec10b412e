// Scalar fp32 <-> bf16 / fp16 conversions with round-to-nearest-even, bit-exact with torch's casts.
// Used by the portable (scalar) vector path; the AVX paths convert in registers.
#pragma once
#include <cstdint>
#include <cstring>

namespace ds_ops {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // ties go to the even bf16 mantissa
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant units of 2^-24, exact in fp32
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return bits_f32(f32_bits(mag) | sign);
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN / inf
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest half: inf
  if (u < 0x38800000u) {
    // below 2^-14: the result is subnormal; adding 0.5 makes the fp32 ulp 2^-24 so the FPU rounds for us
    const float sum = bits_f32(u) + 0.5f;
    return sign | static_cast<uint16_t>(f32_bits(sum) - 0x3f000000u);
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias exponent 127 -> 15 and add the rounding bias
  return sign | static_cast<uint16_t>(u >> 13);
}

}  // namespace ds_ops
