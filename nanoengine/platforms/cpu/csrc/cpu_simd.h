// What the CPU kernels share (cpu_decode.cpp, cpu_prefill.cpp, cpu_ops.cpp, cpu_linear.cpp) besides the vector
// layer (cpu_vec.h): the prefetch of a KV block, the attention kernels' checks, round_up, and the AVX512-BF16
// micro-kernels' pieces.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_vec.h"

// A running max's start: below every score, and finite, because -ffast-math (which lets the compiler call a
// vectorized exp) assumes there are no infinities.
constexpr float kBelowEveryScore = -3.0e38f;

// Asks for a KV block's rows of one head (``row_bytes`` each, ``token_stride`` elements apart) while the
// block before it is being read: a block table scatters blocks over memory, where no prefetcher follows.
// Into L2 (locality 2: prefetcht1), not L1: a prefetch into L1 holds one of L1's few miss buffers until its
// line arrives, so a block's 64 lines queue; into L2 they are all in flight at once.
template <typename T>
inline void prefetch_block(const T* k, const T* v, int block_size, int64_t token_stride, int row_bytes) {
  for (int t = 0; t < block_size; ++t)
    for (int byte = 0; byte < row_bytes; byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k + t * token_stride) + byte, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(v + t * token_stride) + byte, 0, 2);
    }
}

// The checks both attention kernels make of q, out, the paged caches and their scales (empty, or for an int8
// cache float32 [blocks, block_size, kv_heads]); ``name`` starts each message. True for an int8 cache.
inline bool check_attention_tensors(const char* name, const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
                                    const at::Tensor& out) {
  for (const at::Tensor* t : {&k_cache, &v_cache, &k_scale, &v_scale, &out})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), name, " takes contiguous CPU caches, scales and out");
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), name,
              ": each row of q (a token's heads) contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), name,
              ": q and out [tokens, heads, head_dim], caches [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0, name,
              ": the caches' head_dim or KV heads do not fit q");
  const bool quantized = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (quantized || k_cache.scalar_type() == q.scalar_type()),
              name, ": q and out share one dtype, the caches q's or int8");
  const auto scale_shape = k_cache.sizes().slice(0, 3);
  TORCH_CHECK(quantized ? k_scale.sizes() == scale_shape && v_scale.sizes() == scale_shape &&
                              k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat
                        : k_scale.numel() == 0 && v_scale.numel() == 0,
              name, ": an int8 cache takes float32 scales [blocks, block_size, kv_heads], another none");
  return quantized;
}

// A token's scale in an int8 cache's scales (``scales`` at the KV head, ``stride`` floats a token); 1 for a
// cache in the model's dtype, which has none.
template <typename C>
inline float token_scale(const float* scales, int64_t token, int64_t stride) {
  if constexpr (std::is_same_v<C, int8_t>)
    return scales[token * stride];
  else
    return 1.f;
}

// n rounded up to a multiple of m.
template <typename N, typename M>
constexpr N round_up(N n, M m) { return (n + m - 1) / m * m; }

// The AVX512-BF16 micro-kernels' pieces: vdpbf16ps multiplies pairs of bfloat16 values.
#if defined(__AVX512BF16__)
// 32 bfloat16 values as dpbf16's pairs, loaded straight into a register (a cast from __m512i goes through memory
// on GCC 12).
inline __m512bh load_pairs(const void* p) {
  __m512bh pairs;
  std::memcpy(&pairs, p, sizeof(pairs));
  return pairs;
}
inline __m512bh as_pairs(__m512i x) { return load_pairs(&x); }

// 32 int8 values widened to bfloat16, exactly: every integer up to 256 is a bfloat16. In one whole 64-byte store,
// so that a later 64-byte load of them is forwarded from the store rather than stalled.
inline void widen32(const int8_t* x, at::BFloat16* out) {
  const __m512bh both = _mm512_cvtne2ps_pbh(load16(x + 16).v, load16(x).v);  // the second operand is the low half
  std::memcpy(out, &both, sizeof(both));
}
#endif

// 32 int8 values widened to float32.
inline void widen32(const int8_t* x, float* out) {
  store16(out, load16(x));
  store16(out + 16, load16(x + 16));
}

#if defined(__AVX512BW__)
// Two rows of 32 16-bit values interleaved, each column's pair one 32-bit unit (what dpbf16 multiplies):
// {a0 b0 a1 b1 ... a15 b15} and {a16 b16 ... a31 b31}.
inline std::array<__m512i, 2> interleave_rows(__m512i a, __m512i b) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                       37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  return {_mm512_permutex2var_epi16(a, low, b), _mm512_permutex2var_epi16(a, high, b)};
}
#endif
