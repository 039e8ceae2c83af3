// AVX-512 helpers shared by the CPU kernels (attention/cpu_decode.cpp, layers/cpu_ops.cpp); each kernel keeps
// a plain loop for CPUs without AVX-512.
#pragma once
#if defined(__AVX512F__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <type_traits>

// 16 values of T from memory as float32 lanes (a 16-bit float widens exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float32 lanes rounded to bfloat16 (to nearest, ties to even, as torch rounds), in the high 16 bits of each.
inline __m512i bfloat16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}

// 16 float32 lanes rounded to T and stored.
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(at::BFloat16* p, __m512 x) {
  const __m256i narrow = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bfloat16_bits(x), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow);
}
inline void store16(at::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

// x rounded to T and back: where torch rounds a bfloat16 or float16 result, so do we.
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, at::BFloat16>)
    return _mm512_castsi512_ps(_mm512_and_si512(bfloat16_bits(x), _mm512_set1_epi32(int(0xFFFF0000))));
  else if constexpr (std::is_same_v<T, at::Half>)
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  else
    return x;
}

// e^x in each lane, to about one unit in the last place: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// series to r^6 (the first term left out is below 2e-7 relative), times 2^n. x is first clamped to [-87, 88],
// so that the result stays a normal float: about 1e-38 where e^x is smaller still.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2 in two parts: n * ln2's first is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif
