// The vector layer every CPU kernel is written against: Vec16, 16 float32 lanes, and the few operations the
// kernels need. One section per instruction set (the build's -march picks one):
//
// | section | Vec16 is         | registers | kVectorRegisters |
// | ------- | ---------------- | --------- | ---------------- |
// | AVX-512 | one __m512       | 32 zmm    | 32               |
// | AVX2    | two __m256       | 16 ymm    | 8 (16 / 2)       |
// | scalar  | float[16]        | (the compiler's)  | 8        |
//
// 16 lanes everywhere, so that every packed layout (16 outputs of a linear layer, 16 keys of a run) is the same
// on every CPU; kVectorRegisters says how many Vec16 a tile may keep live. Loads widen float32, bfloat16,
// float16 and int8 exactly (and 4-bit values where they lie in a word); stores round to nearest, ties to even, as
// torch does. Only the dot-product micro-kernels that have a special instruction (AVX512-BF16's vdpbf16ps) are
// written outside this layer.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
constexpr const char* kVectorIsa = "avx512";
constexpr int kVectorRegisters = 32;

struct Vec16 {
  __m512 v;
};

inline Vec16 zero16() { return {_mm512_setzero_ps()}; }
inline Vec16 broadcast16(float x) { return {_mm512_set1_ps(x)}; }
inline Vec16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec16 load16(const at::BFloat16* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))};
}
inline Vec16 load16(const at::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline Vec16 load16(const int8_t* p) {  // vpmovsxbd, vcvtdq2ps
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}

// float32 lanes rounded to bfloat16 (to nearest, ties to even), in the high 16 bits of each.
inline __m512i bfloat16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}
inline void store16(float* p, Vec16 x) { _mm512_storeu_ps(p, x.v); }
inline void store16(at::BFloat16* p, Vec16 x) {
  const __m256i narrow = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bfloat16_bits(x.v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow);
}
inline void store16(at::Half* p, Vec16 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT));
}

inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 fma16(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a b + c
// max16 and min16 return b where either is NaN, so that a NaN in b goes on.
inline Vec16 max16(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec16 min16(Vec16 a, Vec16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline float reduce_add16(Vec16 x) { return _mm512_reduce_add_ps(x.v); }
inline float reduce_max16(Vec16 x) { return _mm512_reduce_max_ps(x.v); }
// Lanes [0, n) of ``live``, the others of ``rest``.
inline Vec16 first_lanes16(int n, Vec16 live, Vec16 rest) {
  return {_mm512_mask_blend_ps(n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1), rest.v, live.v)};
}
inline Vec16 round_to_integer16(Vec16 x) {  // to nearest, ties to even
  return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline Vec16 times_pow2_16(Vec16 x, Vec16 n) { return {_mm512_scalef_ps(x.v, n.v)}; }  // x 2^n, n integral
// a / b, IEEE-rounded: vdivps itself, which -ffast-math may not turn into a reciprocal estimate.
inline Vec16 divide_exactly16(Vec16 a, Vec16 b) {
  __m512 quotient;
  asm("vdivps %2, %1, %0" : "=v"(quotient) : "v"(a.v), "v"(b.v));
  return {quotient};
}

// Lane t of the result is the sum of v[t]'s 16 lanes: 16 dot products finished with 45 shuffles and adds where
// 16 separate horizontal sums would take about 130.
inline Vec16 sum_each16(Vec16* vectors) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = vectors[i].v;
  for (int i = 0; i < 8; ++i)  // in each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of a = v[2i], b = v[2i+1]
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // in each 128-bit lane: that lane's sum of v[4i], v[4i+1], v[4i+2], v[4i+3]
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // then the lanes' sums, two 128-bit lanes at a time
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)))};
}

// 16 outputs' weights of two inputs, stored as bfloat16 pairs (k, k + 1) per output (64 bytes), widened to
// float32: input k's (the low halves) and input k + 1's (the high halves).
inline void widen_pairs16(const at::BFloat16* p, Vec16& first, Vec16& second) {
  const __m512i pairs = _mm512_loadu_si512(p);
  first = {_mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16))};
  second = {_mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xFFFF0000))))};
}

// 16 lanes of 32-bit words, each holding eight 4-bit values (16 outputs' weights of eight inputs).
struct Nibbles16 {
  __m512i v;
};
inline Nibbles16 load_nibbles16(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
// Each word shifted left by n bits (right by -n).
inline __m512i shift_words(__m512i words, int n) {
  return n >= 0 ? _mm512_slli_epi32(words, n) : _mm512_srli_epi32(words, -n);
}
// The 4-bit q at bits [at, at + 4) of each word as a float, exactly, in two operations: masked in place and
// converted, q 2^at; the top one (at 28, whose mask would take the sign bit) shifted down and converted, q.
inline Vec16 nibble_in_place16(Nibbles16 words, int at) {
  const __m512i q = at == 28 ? _mm512_srli_epi32(words.v, 28) : _mm512_and_si512(words.v, _mm512_set1_epi32(15 << at));
  return {_mm512_cvtepi32_ps(q)};
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kVectorIsa = "avx2";
constexpr int kVectorRegisters = 8;

struct Vec16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline Vec16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 broadcast16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
inline Vec16 load16(const at::BFloat16* p) { return {load8(p), load8(p + 8)}; }
inline Vec16 load16(const at::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256 load8(const int8_t* p) {  // vpmovsxbd, vcvtdq2ps
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec16 load16(const int8_t* p) { return {load8(p), load8(p + 8)}; }

// float32 lanes rounded to bfloat16 (to nearest, ties to even), in the low 16 bits of each.
inline __m256i bfloat16_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}
inline void store16(float* p, Vec16 x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline void store16(at::BFloat16* p, Vec16 x) {
  // packus works within 128-bit lanes (lo0-3 hi0-3 lo4-7 hi4-7); the permute puts the quarters in order.
  const __m256i packed = _mm256_packus_epi32(bfloat16_bits(x.lo), bfloat16_bits(x.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}
inline void store16(at::Half* p, Vec16 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT));
}

inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec16 fma16(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 max16(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec16 min16(Vec16 a, Vec16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline float reduce_add8(__m256 x) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}
inline float reduce_add16(Vec16 x) { return reduce_add8(_mm256_add_ps(x.lo, x.hi)); }
inline float reduce_max16(Vec16 x) {
  const __m256 both = _mm256_max_ps(x.lo, x.hi);
  __m128 most = _mm_max_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  most = _mm_max_ps(most, _mm_movehl_ps(most, most));
  return _mm_cvtss_f32(_mm_max_ss(most, _mm_movehdup_ps(most)));
}
inline Vec16 first_lanes16(int n, Vec16 live, Vec16 rest) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), count = _mm256_set1_epi32(n);
  const __m256 low = _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, lane));
  const __m256 high = _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
  return {_mm256_blendv_ps(rest.lo, live.lo, low), _mm256_blendv_ps(rest.hi, live.hi, high)};
}
inline Vec16 round_to_integer16(Vec16 x) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, kNearest), _mm256_round_ps(x.hi, kNearest)};
}
// x 2^n for integral n in [-126, 127] (exp16's range): 2^n built from its exponent bits.
inline __m256 times_pow2_8(__m256 x, __m256 n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(x, _mm256_castsi256_ps(bits));
}
inline Vec16 times_pow2_16(Vec16 x, Vec16 n) { return {times_pow2_8(x.lo, n.lo), times_pow2_8(x.hi, n.hi)}; }
inline __m256 divide_exactly8(__m256 a, __m256 b) {
  __m256 quotient;
  asm("vdivps %2, %1, %0" : "=x"(quotient) : "x"(a), "x"(b));
  return quotient;
}
inline Vec16 divide_exactly16(Vec16 a, Vec16 b) { return {divide_exactly8(a.lo, b.lo), divide_exactly8(a.hi, b.hi)}; }

// 8 vectors' sums: lane i of the result is the sum of v[i]'s 8 lanes.
inline __m256 sum_each8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a: [0 1 2 3 | 0 1 2 3] partial sums of v[0..3] in its low and high halves, b of v[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline Vec16 sum_each16(Vec16* vectors) {
  __m256 halves[16];
  for (int i = 0; i < 16; ++i) halves[i] = _mm256_add_ps(vectors[i].lo, vectors[i].hi);
  return {sum_each8(halves), sum_each8(halves + 8)};
}

inline void widen_pairs16(const at::BFloat16* p, Vec16& first, Vec16& second) {
  const __m256i mask = _mm256_set1_epi32(int(0xFFFF0000));
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  first = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  second = {_mm256_castsi256_ps(_mm256_and_si256(lo, mask)), _mm256_castsi256_ps(_mm256_and_si256(hi, mask))};
}

struct Nibbles16 {
  __m256i lo, hi;
};
inline Nibbles16 load_nibbles16(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline __m256 nibble_in_place8(__m256i words, int at) {
  const __m256i q = at == 28 ? _mm256_srli_epi32(words, 28) : _mm256_and_si256(words, _mm256_set1_epi32(15 << at));
  return _mm256_cvtepi32_ps(q);
}
inline Vec16 nibble_in_place16(Nibbles16 words, int at) {
  return {nibble_in_place8(words.lo, at), nibble_in_place8(words.hi, at)};
}

#else
// Plain loops over 16 floats: the compiler vectorizes them for whatever the target has (SSE on x86-64-v2).
constexpr const char* kVectorIsa = "scalar";
constexpr int kVectorRegisters = 8;

struct Vec16 {
  float v[16];
};

template <typename Fn>
inline Vec16 each16(Fn fn) {
  Vec16 out;
  for (int i = 0; i < 16; ++i) out.v[i] = fn(i);
  return out;
}
inline Vec16 zero16() { return each16([](int) { return 0.f; }); }
inline Vec16 broadcast16(float x) { return each16([=](int) { return x; }); }
template <typename T>
inline Vec16 load16(const T* p) {
  return each16([=](int i) { return float(p[i]); });
}
inline void store16(float* p, Vec16 x) { std::memcpy(p, x.v, sizeof(x.v)); }
template <typename T>
inline void store16(T* p, Vec16 x) {
  for (int i = 0; i < 16; ++i) p[i] = T(x.v[i]);  // c10's conversions round to nearest, ties to even
}
inline Vec16 operator+(Vec16 a, Vec16 b) { return each16([&](int i) { return a.v[i] + b.v[i]; }); }
inline Vec16 operator-(Vec16 a, Vec16 b) { return each16([&](int i) { return a.v[i] - b.v[i]; }); }
inline Vec16 operator*(Vec16 a, Vec16 b) { return each16([&](int i) { return a.v[i] * b.v[i]; }); }
inline Vec16 operator/(Vec16 a, Vec16 b) { return each16([&](int i) { return a.v[i] / b.v[i]; }); }
inline Vec16 fma16(Vec16 a, Vec16 b, Vec16 c) { return each16([&](int i) { return a.v[i] * b.v[i] + c.v[i]; }); }
// As the SIMD sections' max and min: b where either is NaN.
inline Vec16 max16(Vec16 a, Vec16 b) { return each16([&](int i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; }); }
inline Vec16 min16(Vec16 a, Vec16 b) { return each16([&](int i) { return a.v[i] < b.v[i] ? a.v[i] : b.v[i]; }); }
inline float reduce_add16(Vec16 x) {
  float sum = 0.f;
  for (float lane : x.v) sum += lane;
  return sum;
}
inline float reduce_max16(Vec16 x) {
  float most = x.v[0];
  for (float lane : x.v) most = lane > most ? lane : most;
  return most;
}
inline Vec16 first_lanes16(int n, Vec16 live, Vec16 rest) {
  return each16([&](int i) { return i < n ? live.v[i] : rest.v[i]; });
}
inline Vec16 round_to_integer16(Vec16 x) { return each16([&](int i) { return std::nearbyint(x.v[i]); }); }
inline Vec16 times_pow2_16(Vec16 x, Vec16 n) { return each16([&](int i) { return std::ldexp(x.v[i], int(n.v[i])); }); }
inline Vec16 divide_exactly16(Vec16 a, Vec16 b) {
  return each16([&](int i) {
    volatile float divisor = b.v[i];  // a value the compiler cannot replace by a reciprocal's product
    return a.v[i] / divisor;
  });
}
inline Vec16 sum_each16(Vec16* vectors) { return each16([&](int i) { return reduce_add16(vectors[i]); }); }
inline void widen_pairs16(const at::BFloat16* p, Vec16& first, Vec16& second) {
  first = each16([=](int i) { return float(p[2 * i]); });
  second = each16([=](int i) { return float(p[2 * i + 1]); });
}
struct Nibbles16 {
  uint32_t v[16];
};
inline Nibbles16 load_nibbles16(const uint8_t* p) {
  Nibbles16 words;
  std::memcpy(words.v, p, sizeof(words.v));
  return words;
}
inline Vec16 nibble_in_place16(Nibbles16 words, int at) {
  return each16([&](int i) { return float(at == 28 ? words.v[i] >> 28 : words.v[i] & (15u << at)); });
}
#endif

// What is written once, on the operations above.

inline Vec16 fnma16(Vec16 a, Vec16 b, Vec16 c) { return c - a * b; }  // c - a b

// x rounded to T and back: where torch rounds a bfloat16 or float16 result, so do we.
template <typename T>
inline Vec16 round16(Vec16 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    T narrow[16];
    store16(narrow, x);
    return load16(narrow);
  }
}

// e^x in each lane, to a few units in the last place: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// series to r^6 (the first term left out is below 2e-7 relative), times 2^n. x is first clamped to [-87, 88], so
// that the result stays a normal float: about 1e-38 where e^x is smaller still. A NaN stays NaN (max16 and min16
// return their second operand, x, when it is NaN), so a kernel that reads a poisoned slot shows it.
inline Vec16 exp16(Vec16 x) {
  x = min16(broadcast16(88.f), max16(broadcast16(-87.f), x));
  const Vec16 n = round_to_integer16(x * broadcast16(1.44269504f));
  Vec16 r = fnma16(n, broadcast16(0.693145752f), x);  // ln2 in two parts, for r's precision
  r = fnma16(n, broadcast16(1.42860677e-6f), r);
  Vec16 p = broadcast16(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fma16(p, r, broadcast16(c));
  return times_pow2_16(p, n);
}
