// Decode attention on the CPU: one query row per request, attended straight from the paged KV cache.
//
// Gathering a request's K and V into one tensor and calling SDPA reads every byte three times (gather,
// write, attend). Here each (request, KV head) walks its block table: a block's K and V rows come from
// memory and are reused from L1 by the group's query heads (with AVX-512, by as many as their sums fit in 16
// vectors: 4 at head size 64, 2 at 128; a larger group walks the table once per such chunk), while the next
// block (elsewhere in memory) is prefetched. Softmax is online, as in the Triton kernel: a running max ``m``
// and sum ``l`` per query head, the accumulator rescaled whenever the max grows. Everything is summed in
// float32, whatever the cache's dtype (in bfloat16 with AVX512-BF16, P is rounded to bfloat16 before it
// multiplies V). An int8 cache's rows are widened to float32 in registers; a key's scale multiplies its dot
// product once, and a value's scale its weight p (the sum l takes p unscaled). Built on first use by
// nanoengine/platforms/cpu/build.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_simd.h"

// One KV head's K and V in the paged cache: rows of C (q's type, or int8_t) ``token_stride`` elements apart, and
// for an int8 cache each token's scale, ``scale_stride`` floats apart.
template <typename C>
struct HeadCache {
  const C *k, *v;
  const float *k_scale, *v_scale;
  int64_t token_stride, scale_stride;
  int block_size;

  int64_t first_token(const int32_t* block_table, int block) const { return int64_t(block_table[block]) * block_size; }
  void prefetch(const int32_t* block_table, int block, int head_dim) const {
    const int64_t token = first_token(block_table, block);
    prefetch_block(k + token * token_stride, v + token * token_stride, block_size, token_stride,
                   head_dim * int(sizeof(C)));
    if constexpr (std::is_same_v<C, int8_t>)  // the block's scales: one float a token, scale_stride apart
      for (int64_t byte = 0; byte < block_size * scale_stride * int64_t(sizeof(float)); byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k_scale + token * scale_stride) + byte, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(v_scale + token * scale_stride) + byte, 0, 2);
      }
  }
};

// The query heads of one KV head (``group`` rows of ``q``) over one request's context, in plain loops.
// HEAD_DIM > 0 fixes the head size at compile time, so the compiler unrolls and vectorizes every row loop
// and keeps a head's sum in registers; 0 is the general case. ``work`` holds q scaled, the scores of one
// block and, per query head, m, l and the sum.
template <typename T, typename C, int HEAD_DIM>
void attend_group(const T* q_raw, float scale, const HeadCache<C>& cache, const int32_t* block_table, int seq_len,
                  int group, int head_dim_, T* out, float* work) {
  const int head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_, block_size = cache.block_size;
  const int64_t token_stride = cache.token_stride;
  float *q = work, *scores = q + group * head_dim, *m = scores + block_size, *l = m + group, *acc = l + group;
  for (int e = 0; e < group * head_dim; ++e) q[e] = float(q_raw[e]) * scale;
  std::fill(m, m + group, kBelowEveryScore);
  std::fill(l, l + group, 0.f);
  std::fill(acc, acc + group * head_dim, 0.f);
  const int num_blocks = (seq_len + block_size - 1) / block_size;
  for (int b = 0; b < num_blocks; ++b) {
    const int64_t first = cache.first_token(block_table, b);
    const C *k = cache.k + first * token_stride, *v = cache.v + first * token_stride;
    if (b + 1 < num_blocks) cache.prefetch(block_table, b + 1, head_dim);
    const int n = std::min(block_size, seq_len - b * block_size);
    for (int g = 0; g < group; ++g) {
      const float* q_row = q + g * head_dim;
      float block_max = m[g];
      for (int t = 0; t < n; ++t) {
        float dot = 0.f;
        for (int d = 0; d < head_dim; ++d) dot += q_row[d] * float(k[t * token_stride + d]);
        scores[t] = dot * token_scale<C>(cache.k_scale, first + t, cache.scale_stride);
        block_max = std::max(block_max, scores[t]);
      }
      const float rescale = std::exp(m[g] - block_max);  // 0 on the first block
      float block_sum = 0.f;
      for (int t = 0; t < n; ++t) {
        scores[t] = std::exp(scores[t] - block_max);
        block_sum += scores[t];
      }
      m[g] = block_max;
      l[g] = l[g] * rescale + block_sum;
      float local[HEAD_DIM > 0 ? HEAD_DIM : 1];
      float* sum = HEAD_DIM > 0 ? local : acc + g * head_dim;  // the general case sums in place
      for (int d = 0; d < head_dim; ++d) sum[d] = acc[g * head_dim + d] * rescale;
      for (int t = 0; t < n; ++t) {
        const float p = scores[t] * token_scale<C>(cache.v_scale, first + t, cache.scale_stride);
        for (int d = 0; d < head_dim; ++d) sum[d] += p * float(v[t * token_stride + d]);
      }
      std::copy(sum, sum + head_dim, acc + g * head_dim);
    }
  }
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < head_dim; ++d) out[g * head_dim + d] = T(acc[g * head_dim + d] / l[g]);
}

// q . k over HEAD_DIM elements, as 16 float32 partial sums, from q widened to float32 (``q_wide``) or, with
// AVX-512 BF16, from bfloat16 q and k in dpbf16: each product exact in float32 and added with its own rounding,
// as an FMA would (denormals flushed).
template <typename T, typename C, int HEAD_DIM>
inline Vec16 dot16(const T* q, const Vec16* q_wide, const C* k) {
  Vec16 sum = zero16();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, at::BFloat16>) {
    for (int c = 0; c < HEAD_DIM / 32; ++c)
      sum.v = _mm512_dpbf16_ps(sum.v, load_pairs(q + 32 * c), load_pairs(k + 32 * c));
    return sum;
  }
#endif
  for (int c = 0; c < HEAD_DIM / 16; ++c) sum = fma16(q_wide[c], load16(k + 16 * c), sum);
  return sum;
}

#if defined(__AVX512BF16__)
// sum[h] += p[h][t] v[t] over keys t < n, two keys at a time in dpbf16: each head's p rounded to bfloat16 (as
// prompt attention and SDPA round P), and the two keys' V rows interleaved by one permute per 16 columns, so
// each column's pair of keys is one 32-bit unit: half the multiply instructions of the float32 path (each V row
// widened, one FMA per key). A key past n (an odd n's last pair) is zero, whatever its row holds.
template <int HEAD_DIM, int HEADS>
inline void add_value_pairs(const float (*p)[16], const at::BFloat16* v, int n, int64_t token_stride,
                            Vec16 (*sum)[HEAD_DIM / 16]) {
  alignas(64) int32_t pairs[HEADS][8];  // per head, keys (2i, 2i + 1)'s p in bfloat16
  for (int h = 0; h < HEADS; ++h)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[h]), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p[h])));
  for (int t = 0; t < n; t += 2) {
    const at::BFloat16* row = v + t * token_stride;
    for (int c = 0; c < HEAD_DIM / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(row + 32 * c);
      const __m512i b = t + 1 < n ? _mm512_loadu_si512(row + token_stride + 32 * c) : _mm512_setzero_si512();
      const auto [first, second] = interleave_rows(a, b);  // columns 32c .. 32c + 15, then the next 16
      for (int h = 0; h < HEADS; ++h) {
        const __m512bh weight = as_pairs(_mm512_set1_epi32(pairs[h][t / 2]));
        sum[h][2 * c].v = _mm512_dpbf16_ps(sum[h][2 * c].v, as_pairs(first), weight);
        sum[h][2 * c + 1].v = _mm512_dpbf16_ps(sum[h][2 * c + 1].v, as_pairs(second), weight);
      }
    }
  }
}
#endif

// HEADS query heads of one group over a request's context, 16 keys at a time in Vec16s, each head's output sum
// kept in HEADS x HEAD_DIM / 16 vectors (16 at most) for the whole context. For each query head,
// its 16 dot products are finished by one sum_each16 and scaled, and the softmax runs on their 16 lanes; then
// each V row is widened to float32 and added into every head's sum (in bfloat16, two rows at a time by
// add_value_pairs). HEADS is the exact count (a test per head in the loop over V rows cost 15% at 3 heads), so a
// group is cut into calls of different HEADS.
template <typename T, typename C, int HEAD_DIM, int HEADS>
void attend_heads(const T* q, float scale, const HeadCache<C>& cache, const int32_t* block_table, int seq_len,
                  T* out) {
  constexpr int kVectors = HEAD_DIM / 16;
  constexpr bool kQuantized = std::is_same_v<C, int8_t>;
#if defined(__AVX512BF16__)
  // With bfloat16 q, an int8 run's rows are widened once to bfloat16 (exact: integers up to 256 are), for every
  // head to take in the bfloat16 cache's dpbf16 code.
  constexpr bool kAsPairs = kQuantized && std::is_same_v<T, at::BFloat16>;
#else
  constexpr bool kAsPairs = false;
#endif
  using Row = std::conditional_t<kAsPairs, at::BFloat16, C>;  // what the run's K and V rows are read as
  alignas(64) at::BFloat16 widened[kAsPairs ? 32 : 1][HEAD_DIM];  // the run's K rows, then its V rows
  const int block_size = cache.block_size;
  const int64_t token_stride = cache.token_stride;
  float m[HEADS];
  Vec16 l[HEADS], sum[HEADS][kVectors];  // per head: the sums of p by lane, and the output sum
  for (int h = 0; h < HEADS; ++h) {
    m[h] = kBelowEveryScore;
    l[h] = zero16();
    for (int c = 0; c < kVectors; ++c) sum[h][c] = zero16();
  }
  for (int start = 0, n = 0; start < seq_len; start += n) {  // runs of up to 16 keys, none across two blocks
    const int b = start / block_size, first = start % block_size;
    n = std::min({16, seq_len - start, block_size - first});
    const int64_t token = cache.first_token(block_table, b) + first;
    const Row *k, *v;
    int64_t row_stride = token_stride;
    if constexpr (kAsPairs) {
      for (int t = 0; t < n; ++t)
        for (int d = 0; d < HEAD_DIM; d += 32) {
          widen32(cache.k + (token + t) * token_stride + d, widened[t] + d);
          widen32(cache.v + (token + t) * token_stride + d, widened[16 + t] + d);
        }
      k = widened[0], v = widened[16], row_stride = HEAD_DIM;
    } else {
      k = cache.k + token * token_stride, v = cache.v + token * token_stride;
    }
    if (first == 0 && start + block_size < seq_len) cache.prefetch(block_table, b + 1, HEAD_DIM);
    Vec16 score_scale = broadcast16(scale), value_scale = broadcast16(1.f);
    if constexpr (kQuantized) {  // the run's tokens' scales (1 past n: a slot there may hold anything)
      alignas(64) float k_scales[16], v_scales[16];
      for (int t = 0; t < 16; ++t) {
        k_scales[t] = t < n ? cache.k_scale[(token + t) * cache.scale_stride] : 1.f;
        v_scales[t] = t < n ? cache.v_scale[(token + t) * cache.scale_stride] : 1.f;
      }
      score_scale = score_scale * load16(k_scales);
      value_scale = load16(v_scales);
    }
    alignas(64) float p[HEADS][16];  // each head's weights of the run's V rows (times their scales)
    for (int h = 0; h < HEADS; ++h) {
      const T* q_row = q + h * HEAD_DIM;
      Vec16 q_wide[kVectors], partial[16];
      for (int c = 0; c < kVectors; ++c) q_wide[c] = load16(q_row + 16 * c);
      if (n == 16) {  // the common case, unrolled without a test per key
        for (int t = 0; t < 16; ++t) partial[t] = dot16<T, Row, HEAD_DIM>(q_row, q_wide, k + t * row_stride);
      } else {  // rows past n are never read: they may hold anything, NaN included
        for (int t = 0; t < 16; ++t)
          partial[t] = t < n ? dot16<T, Row, HEAD_DIM>(q_row, q_wide, k + t * row_stride) : zero16();
      }
      const Vec16 scores = first_lanes16(n, sum_each16(partial) * score_scale, broadcast16(kBelowEveryScore));
      const float block_max = reduce_max16(scores);
      if (block_max > m[h]) {  // a new max: what was summed so far shrinks by exp(old max - new max)
        const Vec16 rescale = exp16(broadcast16(m[h] - block_max));  // about 0 on the first keys
        for (int c = 0; c < kVectors; ++c) sum[h][c] = sum[h][c] * rescale;
        l[h] = l[h] * rescale;
        m[h] = block_max;
      }
      const Vec16 p_live = first_lanes16(n, exp16(scores - broadcast16(m[h])), zero16());
      store16(p[h], p_live * value_scale);
      l[h] = l[h] + p_live;
    }
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<Row, at::BFloat16>) {
      add_value_pairs<HEAD_DIM, HEADS>(p, v, n, row_stride, sum);
      continue;
    }
#endif
    // A column of every head's sums at a time, over the run's keys: where the sums do not all fit in registers
    // (AVX2 at head size 128), each is loaded and stored once a run, not once a key.
    for (int c = 0; c < kVectors; ++c)
      for (int t = 0; t < n; ++t) {
        const Vec16 value = load16(v + t * row_stride + 16 * c);
        for (int h = 0; h < HEADS; ++h) sum[h][c] = fma16(broadcast16(p[h][t]), value, sum[h][c]);
      }
  }
  for (int h = 0; h < HEADS; ++h) {
    const float total = reduce_add16(l[h]);
    alignas(64) float row[HEAD_DIM];
    for (int c = 0; c < kVectors; ++c) store16(row + 16 * c, sum[h][c]);
    for (int d = 0; d < HEAD_DIM; ++d) out[h * HEAD_DIM + d] = T(row[d] / total);
  }
}

// attend_heads for 1, 2, ..., sizeof...(H) heads.
template <typename T, typename C, int HEAD_DIM, int... H>
constexpr auto attend_heads_by_count(std::integer_sequence<int, H...>) {
  return std::array{&attend_heads<T, C, HEAD_DIM, H + 1>...};
}

// attend_group's contract for head sizes that are a multiple of 32 (up to 256): the group kHeads query heads
// at a time, as many as keep their sums in 16 Vec16s (AVX-512's registers hold them; on AVX2 they live in L1,
// each loaded and stored once a run of keys, which costs less than reading the K and V rows again per head).
template <typename T, typename C, int HEAD_DIM>
void attend_group_vectors(const T* q, float scale, const HeadCache<C>& cache, const int32_t* block_table,
                          int seq_len, int group, int, T* out, float*) {
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "add_value_pairs takes 32 columns at a time");
  constexpr int kHeads = 16 / (HEAD_DIM / 16);
  constexpr auto attend = attend_heads_by_count<T, C, HEAD_DIM>(std::make_integer_sequence<int, kHeads>());
  for (int h = 0; h < group; h += kHeads)
    attend[std::min(kHeads, group - h) - 1](q + h * HEAD_DIM, scale, cache, block_table, seq_len,
                                            out + h * HEAD_DIM);
}

constexpr int64_t kTaskOverhead = 16;  // a task's fixed cost, in keys

template <typename T, typename C>
void decode_attention_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, float scale, const at::Tensor& out) {
  const int num_heads = q.size(1), head_dim = q.size(2);
  const int block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t table_stride = block_tables.stride(0), q_token_stride = q.stride(0);
  auto attend = head_dim == 64    ? attend_group_vectors<T, C, 64>
                : head_dim == 128 ? attend_group_vectors<T, C, 128>
                                  : attend_group<T, C, 0>;
  const T* q_data = q.data_ptr<T>();
  const C *k_data = k_cache.data_ptr<C>(), *v_data = v_cache.data_ptr<C>();
  const float *k_scales = k_scale.data_ptr<float>(), *v_scales = v_scale.data_ptr<float>();  // null if empty
  const int32_t *tables = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  // One task per (request, KV head), so that two threads stay busy even with a single request. Each thread
  // takes a run of tasks of about the same cost (keys read), not the same count: a step's contexts differ
  // by several times.
  const int64_t num_tasks = rows.size(0) * num_kv_heads;
  const int threads = int(std::min<int64_t>(at::get_num_threads(), num_tasks));
  std::vector<int64_t> first_task(threads + 1, num_tasks);  // thread t takes [first_task[t], first_task[t + 1])
  int64_t total = 0, before = 0;
  for (int64_t i = 0; i < rows.size(0); ++i) total += (lens[i] + kTaskOverhead) * num_kv_heads;
  first_task[0] = 0;
  for (int64_t task = 0, t = 1; task < num_tasks; ++task) {
    const int64_t cost = lens[task / num_kv_heads] + kTaskOverhead;
    // A task goes to the thread whose share of the total holds its midpoint, before + cost / 2.
    for (; t < threads && (2 * before + cost) * threads >= 2 * t * total; ++t) first_task[t] = task;
    before += cost;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(group * head_dim + block_size + group * (2 + head_dim));  // attend_group's
    for (int64_t task = first_task[begin]; task < first_task[end]; ++task) {
      const int64_t i = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t head = kv_head * group * head_dim;  // the group's first element in a row of q and out
      const HeadCache<C> cache{k_data + kv_head * head_dim, v_data + kv_head * head_dim,
                               k_scales ? k_scales + kv_head : nullptr, v_scales ? v_scales + kv_head : nullptr,
                               int64_t(num_kv_heads) * head_dim, num_kv_heads, block_size};
      attend(q_data + row_of[i] * q_token_stride + head, scale, cache, tables + i * table_stride, lens[i], group,
             head_dim, out_data + row_of[i] * num_heads * head_dim + head, work.data());
    }
  });
}

// q, out: [num_tokens, num_heads, head_dim] (q's rows may be strided: a view of the QKV projection);
// caches: [num_blocks, block_size, num_kv_heads, head_dim] of q's dtype (scales empty) or int8 (scales float32
// [num_blocks, block_size, num_kv_heads]); block_tables [num_decodes, max_blocks] and seq_lens [num_decodes]
// int32; rows [num_decodes] int64: the query row of each decoding request. Only those rows of ``out`` are
// written.
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& rows, double scale, const at::Tensor& out) {
  const bool quantized = check_attention_tensors("decode_attention", q, k_cache, v_cache, k_scale, v_scale, out);
  for (const at::Tensor* t : {&block_tables, &seq_lens, &rows})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "decode_attention takes contiguous CPU tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              rows.scalar_type() == at::kLong, "decode_attention: int32 block tables and lengths, int64 rows");
  TORCH_CHECK(block_tables.size(0) == rows.size(0) && seq_lens.size(0) == rows.size(0),
              "decode_attention: one block table, length and row per decoding request");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t table_tokens = block_tables.size(1) * k_cache.size(1);
  TORCH_CHECK(std::all_of(lens, lens + seq_lens.numel(), [&](int32_t n) { return n >= 1 && n <= table_tokens; }),
              "decode_attention: a context is empty or longer than its block table");
  const auto run = [&](auto element) {
    using T = decltype(element);
    if (quantized)
      decode_attention_typed<T, int8_t>(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, rows,
                                        float(scale), out);
    else
      decode_attention_typed<T, T>(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, rows,
                                   float(scale), out);
  };
  switch (q.scalar_type()) {
    case at::kFloat: return run(float());
    case at::kBFloat16: return run(at::BFloat16());
    case at::kHalf: return run(at::Half());
    default: TORCH_CHECK(false, "decode_attention: float32, bfloat16 or float16 only, not ", q.scalar_type());
  }
}
