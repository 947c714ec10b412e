// One fixed-width float vector type for the ISA chosen at build time (DS_SIMD_LEVEL: 2 = AVX-512,
// 1 = AVX2 + FMA + F16C, 0 = portable loops the compiler auto-vectorizes). Kernels are written once
// against this interface; loads widen bf16/fp16 to fp32 and stores round to nearest even.
#pragma once
#include <cmath>
#include <cstdint>

#include "half.h"

#ifndef DS_SIMD_LEVEL
#error "DS_SIMD_LEVEL must be defined by the op builder (0 scalar, 1 avx2, 2 avx512)"
#endif

#if DS_SIMD_LEVEL >= 1
#include <immintrin.h>
#endif

namespace ds_ops {

// Storage types; distinct structs so overloads pick the conversion.
struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = -1 };

#if DS_SIMD_LEVEL == 2
#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "DS_SIMD_LEVEL=2 needs -mavx512f -mavx512bw"
#endif
constexpr const char* kSimdName = "avx512";
constexpr int kW = 16;
struct Vec { __m512 v; };
inline Vec set1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vsqrt(Vec a) { return {_mm512_sqrt_ps(a.v)}; }
inline Vec vsign(Vec a) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, zero, _CMP_GT_OQ), zero, _mm512_set1_ps(1.0f));
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, zero, _CMP_LT_OQ), r, _mm512_set1_ps(-1.0f))};
}
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec load(const bf16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline Vec load(const fp16* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline __m256i bf16_bits(Vec a) {
  __m512i u = _mm512_castps_si512(a.v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}
inline void store(bf16* p, Vec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(a)); }
inline void store(fp16* p, Vec a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// Non-temporal stores for write-only outputs (the low-precision copy): they skip reading the line
// first. The caller guarantees 64-byte (float) / 32-byte (16-bit) alignment.
inline void store_stream(float* p, Vec a) { _mm512_stream_ps(p, a.v); }
inline void store_stream(bf16* p, Vec a) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits(a)); }
inline void store_stream(fp16* p, Vec a) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
constexpr int64_t kStreamAlign = 64;

#elif DS_SIMD_LEVEL == 1
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "DS_SIMD_LEVEL=1 needs -mavx2 -mfma -mf16c"
#endif
constexpr const char* kSimdName = "avx2";
constexpr int kW = 8;
struct Vec { __m256 v; };
inline Vec set1(float x) { return {_mm256_set1_ps(x)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vsqrt(Vec a) { return {_mm256_sqrt_ps(a.v)}; }
inline Vec vsign(Vec a) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 pos = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_GT_OQ), one);
  __m256 neg = _mm256_and_ps(_mm256_cmp_ps(a.v, zero, _CMP_LT_OQ), one);
  return {_mm256_sub_ps(pos, neg)};
}
inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec load(const bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline Vec load(const fp16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline __m128i bf16_bits(Vec a) {
  __m256i u = _mm256_castps_si256(a.v);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, nan);
  // packus works per 128-bit lane; the permute gathers the two low halves
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}
inline void store(bf16* p, Vec a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits(a)); }
inline void store(fp16* p, Vec a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
}
// Non-temporal stores for write-only outputs; the caller guarantees 32-byte alignment.
inline void store_stream(float* p, Vec a) { _mm256_stream_ps(p, a.v); }
inline void store_stream(bf16* p, Vec a) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), bf16_bits(a)); }
inline void store_stream(fp16* p, Vec a) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
}
constexpr int64_t kStreamAlign = 32;

#else
constexpr const char* kSimdName = "scalar";
constexpr int kW = 8;
struct Vec { float v[kW]; };
#define DS_LANES for (int i = 0; i < kW; ++i)
inline Vec set1(float x) { Vec r; DS_LANES r.v[i] = x; return r; }
inline Vec operator+(Vec a, Vec b) { Vec r; DS_LANES r.v[i] = a.v[i] + b.v[i]; return r; }
inline Vec operator-(Vec a, Vec b) { Vec r; DS_LANES r.v[i] = a.v[i] - b.v[i]; return r; }
inline Vec operator*(Vec a, Vec b) { Vec r; DS_LANES r.v[i] = a.v[i] * b.v[i]; return r; }
inline Vec operator/(Vec a, Vec b) { Vec r; DS_LANES r.v[i] = a.v[i] / b.v[i]; return r; }
inline Vec fma(Vec a, Vec b, Vec c) { Vec r; DS_LANES r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
inline Vec vsqrt(Vec a) { Vec r; DS_LANES r.v[i] = std::sqrt(a.v[i]); return r; }
inline Vec vsign(Vec a) {
  Vec r;
  DS_LANES r.v[i] = static_cast<float>((a.v[i] > 0.0f) - (a.v[i] < 0.0f));
  return r;
}
inline Vec load(const float* p) { Vec r; DS_LANES r.v[i] = p[i]; return r; }
inline Vec load(const bf16* p) { Vec r; DS_LANES r.v[i] = bf16_to_f32(p[i].bits); return r; }
inline Vec load(const fp16* p) { Vec r; DS_LANES r.v[i] = f16_to_f32(p[i].bits); return r; }
inline void store(float* p, Vec a) { DS_LANES p[i] = a.v[i]; }
inline void store(bf16* p, Vec a) { DS_LANES p[i].bits = f32_to_bf16(a.v[i]); }
inline void store(fp16* p, Vec a) { DS_LANES p[i].bits = f32_to_f16(a.v[i]); }
template <class T>
inline void store_stream(T* p, Vec a) { store(p, a); }
constexpr int64_t kStreamAlign = 1;
#undef DS_LANES
#endif

// Streaming stores pay off only for whole aligned vectors; fence so other threads see them after the region.
template <class T>
inline bool can_stream(const T* p) {
  return p != nullptr && reinterpret_cast<uintptr_t>(p) % kStreamAlign == 0;
}
inline void stream_fence() {
#if DS_SIMD_LEVEL >= 1
  _mm_sfence();
#endif
}

// Tail handling: the last n < kW elements go through the same vector code via a zero-padded buffer,
// so every element sees identical arithmetic.
template <class T>
struct Tail {
  alignas(64) T buf[kW];
  T* src;
  int64_t n;
  Tail(T* p, int64_t count) : src(p), n(count) {
    for (int i = 0; i < kW; ++i) buf[i] = T{};
    for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  }
  void flush() {
    for (int64_t i = 0; i < n; ++i) src[i] = buf[i];
  }
};

}  // namespace ds_ops
