// Decode attention on the CPU: one query row per request, attended straight from the paged KV cache.
//
// Gathering a request's K and V into one tensor and calling SDPA reads every byte three times (gather,
// write, attend). Here each (request, KV head) walks its block table once: a block's 16 rows of one head
// are read for the scores, stay in L1 for the weighted sum of V, and the next block (elsewhere in memory)
// is prefetched meanwhile. Softmax is online, as in the Triton kernel: a running max ``m`` and sum ``l``
// per query head, the accumulator rescaled whenever the max grows. Everything is summed in float32,
// whatever the cache's dtype. Built on first use by nanoengine/attention/cpu_backend.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

// The query heads of one KV head (``group`` rows of ``q``, already scaled) over one request's context.
// HEAD_DIM > 0 fixes the head size at compile time, so the compiler unrolls and vectorizes every row loop;
// 0 is the general case. ``work`` holds the scores of one block and, per query head, m, l and the sum.
template <typename T, int HEAD_DIM>
void attend_group(const float* q, const T* k_cache, const T* v_cache, const int* block_table, int seq_len,
                  int block_size, long token_stride, int group, int head_dim_, T* out, float* work) {
  const int head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_;
  float *scores = work, *m = scores + block_size, *l = m + group, *acc = l + group;
  std::fill(m, m + group, -INFINITY);
  std::fill(l, l + group, 0.f);
  std::fill(acc, acc + group * head_dim, 0.f);
  const long block_stride = block_size * token_stride;
  const int num_blocks = (seq_len + block_size - 1) / block_size;
  for (int b = 0; b < num_blocks; ++b) {
    const T* k = k_cache + block_table[b] * block_stride;
    const T* v = v_cache + block_table[b] * block_stride;
    if (b + 1 < num_blocks)  // the next block lies elsewhere in memory: ask for its rows now
      for (int t = 0; t < block_size; ++t)
        for (int byte = 0; byte < head_dim * int(sizeof(T)); byte += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(k_cache + block_table[b + 1] * block_stride + t * token_stride) + byte);
          __builtin_prefetch(reinterpret_cast<const char*>(v_cache + block_table[b + 1] * block_stride + t * token_stride) + byte);
        }
    const int n = std::min(block_size, seq_len - b * block_size);
    for (int g = 0; g < group; ++g) {
      const float* q_row = q + g * head_dim;
      float block_max = m[g];
      for (int t = 0; t < n; ++t) {
        float dot = 0.f;
        for (int d = 0; d < head_dim; ++d) dot += q_row[d] * float(k[t * token_stride + d]);
        scores[t] = dot;
        block_max = std::max(block_max, dot);
      }
      const float rescale = std::exp(m[g] - block_max);  // 0 on the first block, where m is -inf
      float block_sum = 0.f;
      for (int t = 0; t < n; ++t) {
        scores[t] = std::exp(scores[t] - block_max);
        block_sum += scores[t];
      }
      m[g] = block_max;
      l[g] = l[g] * rescale + block_sum;
      float* acc_row = acc + g * head_dim;
      float a[HEAD_DIM > 0 ? HEAD_DIM : 256];
      for (int d = 0; d < head_dim; ++d) a[d] = acc_row[d] * rescale;
      for (int t = 0; t < n; ++t)
        for (int d = 0; d < head_dim; ++d) a[d] += scores[t] * float(v[t * token_stride + d]);
      for (int d = 0; d < head_dim; ++d) acc_row[d] = a[d];
    }
  }
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < head_dim; ++d) out[g * head_dim + d] = T(acc[g * head_dim + d] / l[g]);
}

// q, out: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables [num_decodes, max_blocks] and seq_lens [num_decodes] int32; rows [num_decodes] int64: the
// query row of each decoding request. Only those rows of ``out`` are written.
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                      double scale, at::Tensor& out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              rows.scalar_type() == at::kLong);
  const int num_heads = q.size(1), head_dim = q.size(2);
  const int block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  const long token_stride = long(num_kv_heads) * head_dim, table_stride = block_tables.stride(0);
  const int* tables = block_tables.data_ptr<int>();
  const int* lens = seq_lens.data_ptr<int>();
  const long* row_of = rows.data_ptr<long>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    auto attend = head_dim == 64 ? attend_group<scalar_t, 64>
                : head_dim == 128 ? attend_group<scalar_t, 128> : attend_group<scalar_t, 0>;
    const scalar_t* q_data = q.data_ptr<scalar_t>();
    scalar_t* out_data = out.data_ptr<scalar_t>();
    // One task per (request, KV head): two threads stay busy even with a single request.
    at::parallel_for(0, rows.size(0) * num_kv_heads, 1, [&](long begin, long end) {
      std::vector<float> q_scaled(group * head_dim), work(block_size + group * (2 + head_dim));
      for (long task = begin; task < end; ++task) {
        const long i = task / num_kv_heads, kv_head = task % num_kv_heads;
        const long first = (row_of[i] * num_heads + kv_head * group) * head_dim;  // the group's first q element
        for (int e = 0; e < group * head_dim; ++e) q_scaled[e] = float(q_data[first + e]) * float(scale);
        attend(q_scaled.data(), k_cache.data_ptr<scalar_t>() + kv_head * head_dim,
               v_cache.data_ptr<scalar_t>() + kv_head * head_dim, tables + i * table_stride, lens[i], block_size,
               token_stride, group, head_dim, out_data + first, work.data());
      }
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attention", &decode_attention); }
