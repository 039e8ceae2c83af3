// Prompt (prefill) attention on the CPU: many query rows per request, attended straight from the paged KV cache.
//
// The flash-attention scheme, written for the CPU. Work is split into tasks, one per (request, KV head, tile of
// query tokens); a task stacks the query heads of its KV head's group as rows (row r: token r / group, head
// r % group), walks the keys its tile can see (the causal mask ends them at the tile's last position) in blocks,
// and keeps an online softmax per row: scores S = Q K^T in float32, then P = exp(S * scale - max), whose sum l
// and the output accumulator (+= P V) are rescaled whenever a row's max grows.
//
// Both products go through one small GEMM with float32 sums: C[rows, 64 columns] (+)= A[rows, k] B[k, 64]. B
// (K^T or V) is packed from the paged cache once per (request, KV head, key block), before the tasks run. With
// AVX512-BF16 a bfloat16 cache multiplies in bfloat16 pairs (each product exact in float32, about twice the
// float32 rate); P is then rounded to bfloat16, as torch's flash kernel does. Other caches (and CPUs) multiply
// in float32. An int8 cache's values are packed as they are (an integer up to 127 is exact in bfloat16), its
// scales beside them: a key's multiplies its column of S with the softmax scale, a value's its column of P (after
// P's sum is taken), so the GEMMs are those of a cache of q's dtype. Built with cpu_decode.cpp by
// nanoengine/platforms/cpu/build.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_simd.h"

#ifdef __AVX512BF16__
using BFloat16Compute = at::BFloat16;  // what a bfloat16 cache multiplies in
#else
using BFloat16Compute = float;
#endif

namespace {

// A GEMM call's tile: kTileRows rows of C in registers, by kTileVectors Vec16s of columns (6 x 4 of AVX-512's 32
// registers, 3 x 2 of AVX2's).
constexpr int kTileRows = kVectorRegisters >= 32 ? 6 : 3;
constexpr int kTileVectors = kVectorRegisters >= 32 ? 4 : 2;
constexpr int kTileCols = 64;    // GEMM widths are padded to multiples of this (of 16 kTileVectors)
constexpr int kKeyBlock = 256;   // keys per step of the online softmax
constexpr int kQueryRows = 192;  // about this many rows (tokens x group) per task

// Compute is the type the GEMM multiplies: at::BFloat16 (in pairs) or float. A is row-major; B is packed as
// [k / kPair][columns][kPair] so that one vector load takes the pairs of 16 columns.
template <typename Compute>
constexpr int kPair = sizeof(Compute) == 2 ? 2 : 1;

// C[ROWS, 16 kTileVectors] (+)= A[ROWS, k] B[k, 16 kTileVectors] for B's first columns (b_stride: B's packed
// width): C in registers and one row of A broadcast against kTileVectors vectors of B (in pairs for bfloat16:
// dpbf16).
template <typename Compute, int ROWS>
void gemm_tile(const Compute* a, int a_stride, const Compute* b, int b_stride, int k, float* c, int c_stride,
               bool accumulate) {
  Vec16 sum[ROWS][kTileVectors];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < kTileVectors; ++j) sum[i][j] = accumulate ? load16(c + i * c_stride + 16 * j) : zero16();
  for (int p = 0; p < k / kPair<Compute>; ++p) {
    const Compute* b_row = b + kPair<Compute> * p * b_stride;
    if constexpr (std::is_same_v<Compute, float>) {
      Vec16 column[kTileVectors];
      for (int j = 0; j < kTileVectors; ++j) column[j] = load16(b_row + 16 * j);
      for (int i = 0; i < ROWS; ++i) {
        const Vec16 row = broadcast16(a[i * a_stride + p]);
        for (int j = 0; j < kTileVectors; ++j) sum[i][j] = fma16(row, column[j], sum[i][j]);
      }
    } else {
#if defined(__AVX512BF16__)
      __m512bh column[kTileVectors];
      for (int j = 0; j < kTileVectors; ++j) column[j] = load_pairs(b_row + 32 * j);
      for (int i = 0; i < ROWS; ++i) {
        int32_t pair;
        std::memcpy(&pair, a + i * a_stride + 2 * p, sizeof(pair));
        const __m512i pairs = _mm512_set1_epi32(pair);  // row i's pair p, in every lane
        const __m512bh row = load_pairs(&pairs);
        for (int j = 0; j < kTileVectors; ++j) sum[i][j].v = _mm512_dpbf16_ps(sum[i][j].v, row, column[j]);
      }
#endif
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < kTileVectors; ++j) store16(c + i * c_stride + 16 * j, sum[i][j]);
}

// gemm_tile for 1, 2, ..., kTileRows rows.
template <typename Compute, int... R>
constexpr auto tiles_by_rows(std::integer_sequence<int, R...>) {
  return std::array{&gemm_tile<Compute, R + 1>...};
}

// Which product of a key block a GEMM computes: the scores S = Q K^T (B is K^T: its columns are keys) or the
// sum P V (its k are keys).
enum class Product { kScores, kValues };

// C[rows, columns] (+)= A[rows, k] B[k, columns]; columns a multiple of 64 (at most b_stride, B's packed
// width), k of kPair. ``visible(row)``: how many of the block's keys a row can see (the causal mask). Each tile
// of rows stops at the keys its last row sees, a column tile of 64 for the scores, a pair for P V: the keys
// after them count for nothing (softmax_step sets their P to 0), and skipping them is a fifth less work.
template <typename Compute, typename Visible>
void gemm(Product product, const Compute* a, int a_stride, const Compute* b, int b_stride, int columns, int k,
          float* c, int c_stride, int rows, Visible visible) {
  constexpr auto tiles = tiles_by_rows<Compute>(std::make_integer_sequence<int, kTileRows>());
  for (int i = 0; i < rows; i += kTileRows) {
    const int tile_rows = std::min(kTileRows, rows - i), keys = visible(i + tile_rows - 1);
    if (keys <= 0) continue;  // scores not needed, and P V adds nothing
    const bool scores = product == Product::kScores;
    const int tile_columns = scores ? std::min(columns, round_up(keys, kTileCols)) : columns;
    const int tile_k = scores ? k : std::min(k, round_up(keys, kPair<Compute>));
    for (int n = 0; n < tile_columns; n += 16 * kTileVectors)
      tiles[tile_rows - 1](a + i * a_stride, a_stride, b + n * kPair<Compute>, b_stride, tile_k,
                           c + i * c_stride + n, c_stride, !scores);
  }
}

#if defined(__AVX512F__)
// m[i]: row i of a 16 x 16 matrix of 32-bit elements; afterwards, its column i. Pairs of rows are interleaved
// by 32 then 64 bits (each 128-bit lane then holds a 4 x 4 block, transposed), then the lanes are exchanged.
inline void transpose16x16(__m512i* m) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // m[g + c], lane L: column 4L + c of rows g..g + 3
    m[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    m[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    m[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    m[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i low = _mm512_shuffle_i32x4(m[c], m[4 + c], _MM_SHUFFLE(1, 0, 1, 0));  // lanes 0, 1 of both
    const __m512i high = _mm512_shuffle_i32x4(m[c], m[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i low2 = _mm512_shuffle_i32x4(m[8 + c], m[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i high2 = _mm512_shuffle_i32x4(m[8 + c], m[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    t[c] = _mm512_shuffle_i32x4(low, low2, _MM_SHUFFLE(2, 0, 2, 0));
    t[4 + c] = _mm512_shuffle_i32x4(low, low2, _MM_SHUFFLE(3, 1, 3, 1));
    t[8 + c] = _mm512_shuffle_i32x4(high, high2, _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + c] = _mm512_shuffle_i32x4(high, high2, _MM_SHUFFLE(3, 1, 3, 1));
  }
  std::copy(t, t + 16, m);
}
#endif

struct Request {
  const int32_t* block_table;
  int first_row, query_len, seq_len;  // its query rows in q and out; its context, the query rows' last
  int first_block;                    // its first key block in the packed K and V
};

struct Task {
  int request, kv_head, first_token, num_tokens;
  int64_t cost;  // query rows x keys seen
};

// One thread's buffers for a task: its queries, one key block's scores and probabilities, and per row the
// running max, sum and output accumulator. The queries and probabilities are left uninitialized (a vector
// of bfloat16 fills itself one element at a time: 2% of a 288-token prompt); each task writes what it reads.
template <typename Compute>
struct Workspace {
  Workspace(int rows, int head_dim, int out_cols)
      : queries(new Compute[rows * head_dim]), scores(rows * kKeyBlock), probs(new Compute[rows * kKeyBlock]),
        acc(rows * out_cols), max(rows), sum(rows) {}
  std::unique_ptr<Compute[]> queries;
  std::vector<float> scores;
  std::unique_ptr<Compute[]> probs;
  std::vector<float> acc, max, sum;
};

// T: q's and out's type; C: the cache's (T, or int8_t with a float32 scale per token and KV head).
template <typename T, typename C, typename Compute>
class PrefillAttention {
 public:
  PrefillAttention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& k_scale, const at::Tensor& v_scale, float scale, const at::Tensor& out,
                   const std::vector<Request>& requests, int num_blocks)
      : q_(q.data_ptr<T>()), k_cache_(k_cache.data_ptr<C>()), v_cache_(v_cache.data_ptr<C>()),
        k_scale_(k_scale.data_ptr<float>()), v_scale_(v_scale.data_ptr<float>()), out_(out.data_ptr<T>()),
        requests_(requests), q_stride_(q.stride(0)), num_heads_(q.size(1)), head_dim_(q.size(2)),
        block_size_(k_cache.size(1)), num_kv_heads_(k_cache.size(2)),
        group_(num_heads_ / num_kv_heads_), scale_(scale), out_cols_(round_up(head_dim_, kTileCols)),
        keys_(at::empty({int64_t(num_blocks) * num_kv_heads_ * head_dim_ * kKeyBlock}, dtype())),
        values_(at::empty({int64_t(num_blocks) * num_kv_heads_ * kKeyBlock * out_cols_}, dtype())),
        scales_(at::empty({kQuantized ? 2 * int64_t(num_blocks) * num_kv_heads_ * kKeyBlock : 0}, at::kFloat)) {}

  static int tokens_per_task(int group) { return std::max(1, kQueryRows / group); }
  Workspace<Compute> workspace() const {
    return Workspace<Compute>(tokens_per_task(group_) * group_, head_dim_, out_cols_);
  }

  // K^T and V of one block of a request's keys, as gemm reads them (zero past the context): with AVX-512,
  // where the cache holds what gemm multiplies, 16 keys at a time for K^T and 2 at a time for V; the keys
  // these leave, one by one.
  void pack_block(int request, int kv_head, int block) {
    constexpr int pair = kPair<Compute>;
    const Request& r = requests_[request];
    Compute *keys = packed_keys(r, kv_head, block), *values = packed_values(r, kv_head, block);
    const int first_key = block * kKeyBlock, n = std::min(kKeyBlock, r.seq_len - first_key);
    if (n < kKeyBlock || head_dim_ < out_cols_) {
      std::fill(keys, keys + head_dim_ * kKeyBlock, Compute(0));
      std::fill(values, values + kKeyBlock * out_cols_, Compute(0));
    }
    const auto row = [&](const C* cache, int t) { return cache_row(r, cache, kv_head, first_key + t); };
    if constexpr (kQuantized) {  // a key's scale times the softmax scale, a value's; 0 past the context
      float *key_scales = packed_scales(r, kv_head, block), *value_scales = key_scales + kKeyBlock;
      std::fill(key_scales + n, key_scales + kKeyBlock, 0.f);
      std::fill(value_scales + n, value_scales + kKeyBlock, 0.f);
      for (int t = 0, run = 0; t < n; t += run) {  // runs of keys in one cache block: consecutive slots
        const int64_t first = slot(r, first_key + t) * num_kv_heads_ + kv_head;
        run = std::min(n - t, block_size_ - (first_key + t) % block_size_);
        for (int i = 0; i < run; ++i) {
          key_scales[t + i] = scale_ * k_scale_[first + i * num_kv_heads_];
          value_scales[t + i] = v_scale_[first + i * num_kv_heads_];
        }
      }
    }
    int keys_done = 0, values_done = 0;
#if defined(__AVX512BW__)
    if constexpr (std::is_same_v<C, Compute>) {
      if (head_dim_ * sizeof(C) % 64 == 0) {
        for (; keys_done + 16 <= n; keys_done += 16) transpose_keys(row, keys_done, keys);
        for (; values_done + pair <= n; values_done += pair) pair_values(row, values_done, values);
      }
    } else if constexpr (kQuantized) {  // 16 rows at a time widened to Compute (exactly), then packed as above
      if (head_dim_ % 32 == 0) {
        std::vector<Compute> widened(16 * head_dim_);
        const auto widened_row = [&](const C*, int t) -> const Compute* { return &widened[t % 16 * head_dim_]; };
        const auto widen = [&](const C* cache, int first) {
          for (int t = 0; t < 16; ++t)
            for (int d = 0; d < head_dim_; d += 32) widen32(row(cache, first + t) + d, &widened[t * head_dim_ + d]);
        };
        for (; keys_done + 16 <= n; keys_done += 16) {
          widen(k_cache_, keys_done);
          transpose_keys(widened_row, keys_done, keys);
        }
        for (; values_done + 16 <= n; values_done += 16) {
          widen(v_cache_, values_done);
          for (int t = values_done; t < values_done + 16; t += pair) pair_values(widened_row, t, values);
        }
      }
    }
#endif
    for (int t = keys_done; t < n; ++t) {
      const C* k = row(k_cache_, t);
      for (int d = 0; d < head_dim_; ++d) keys[(d / pair * kKeyBlock + t) * pair + d % pair] = Compute(float(k[d]));
    }
    for (int t = values_done; t < n; ++t) {
      const C* v = row(v_cache_, t);
      for (int d = 0; d < head_dim_; ++d) values[(t / pair * out_cols_ + d) * pair + t % pair] = Compute(float(v[d]));
    }
  }

#if defined(__AVX512BW__)
  // Keys first..first + 15 into K^T: each 64 bytes of a key's row (16 units of ``pair`` elements) is a row of a
  // 16 x 16 matrix of 32-bit units, whose transpose holds each unit of the 16 keys in one vector.
  template <typename Row>
  void transpose_keys(Row row, int first, Compute* keys) const {
    constexpr int pair = kPair<Compute>;
    for (int unit = 0; unit < head_dim_ / pair; unit += 16) {
      __m512i m[16];
      for (int t = 0; t < 16; ++t) m[t] = _mm512_loadu_si512(row(k_cache_, first + t) + unit * pair);
      transpose16x16(m);
      for (int u = 0; u < 16; ++u) _mm512_storeu_si512(keys + ((unit + u) * kKeyBlock + first) * pair, m[u]);
    }
  }

  // Keys first..first + pair - 1 into V's packed rows: a copy in float32; in bfloat16, the two keys' rows
  // interleaved, each column's pair of keys together.
  template <typename Row>
  void pair_values(Row row, int first, Compute* values) const {
    const auto* v = row(v_cache_, first);
    Compute* out = values + first * out_cols_;  // the row of pair first / 2, in elements
    if constexpr (kPair<Compute> == 1) {
      std::copy(v, v + head_dim_, out);
    } else {
      const auto* next = row(v_cache_, first + 1);
      for (int d = 0; d < head_dim_; d += 32) {
        const auto [low, high] = interleave_rows(_mm512_loadu_si512(v + d), _mm512_loadu_si512(next + d));
        _mm512_storeu_si512(out + 2 * d, low);
        _mm512_storeu_si512(out + 2 * d + 32, high);
      }
    }
  }
#endif

  void attend(const Task& task, Workspace<Compute>& w) {
    const Request& r = requests_[task.request];
    const int rows = task.num_tokens * group_;
    const int first_pos = r.seq_len - r.query_len + task.first_token;  // the tile's first query position
    load_queries(r, task, rows, w);
    std::fill(w.max.begin(), w.max.begin() + rows, kBelowEveryScore);
    std::fill(w.sum.begin(), w.sum.begin() + rows, 0.f);
    std::fill(w.acc.begin(), w.acc.begin() + rows * out_cols_, 0.f);
    const int num_keys = first_pos + task.num_tokens;  // the tile's last row sees these
    for (int block = 0; block * kKeyBlock < num_keys; ++block) {
      const int block_keys = std::min(kKeyBlock, num_keys - block * kKeyBlock);
      const int value_k = round_up(block_keys, kPair<Compute>);
      const auto visible = [&](int row) {
        return std::min(block_keys, first_pos + row / group_ + 1 - block * kKeyBlock);
      };
      gemm(Product::kScores, w.queries.get(), head_dim_, packed_keys(r, task.kv_head, block), kKeyBlock,
           round_up(block_keys, kTileCols), head_dim_, w.scores.data(), kKeyBlock, rows, visible);
      const float* key_scales = kQuantized ? packed_scales(r, task.kv_head, block) : nullptr;
      for (int row = 0; row < rows; ++row) softmax_step(row, visible(row), value_k, key_scales, w);
      gemm(Product::kValues, w.probs.get(), kKeyBlock, packed_values(r, task.kv_head, block), out_cols_,
           out_cols_, value_k, w.acc.data(), out_cols_, rows, visible);
    }
    store_outputs(r, task, rows, w);
  }

 private:
  static at::ScalarType dtype() { return std::is_same_v<Compute, float> ? at::kFloat : at::kBFloat16; }

  int64_t slot(const Request& r, int pos) const {
    return int64_t(r.block_table[pos / block_size_]) * block_size_ + pos % block_size_;
  }
  const C* cache_row(const Request& r, const C* cache, int kv_head, int pos) const {
    return cache + (slot(r, pos) * num_kv_heads_ + kv_head) * head_dim_;
  }
  Compute* packed_keys(const Request& r, int kv_head, int block) {
    return keys_.data_ptr<Compute>() + int64_t(r.first_block * num_kv_heads_ + kv_head * blocks(r) + block) *
                                           head_dim_ * kKeyBlock;
  }
  float* packed_scales(const Request& r, int kv_head, int block) {  // kKeyBlock keys' scales, then values'
    return scales_.data_ptr<float>() + int64_t(r.first_block * num_kv_heads_ + kv_head * blocks(r) + block) * 2 *
                                           kKeyBlock;
  }
  Compute* packed_values(const Request& r, int kv_head, int block) {
    return values_.data_ptr<Compute>() + int64_t(r.first_block * num_kv_heads_ + kv_head * blocks(r) + block) *
                                             kKeyBlock * out_cols_;
  }

  void load_queries(const Request& r, const Task& task, int rows, Workspace<Compute>& w) const {
    for (int row = 0; row < rows; ++row) {
      const int token = r.first_row + task.first_token + row / group_, head = task.kv_head * group_ + row % group_;
      const T* src = q_ + token * q_stride_ + head * head_dim_;
      std::transform(src, src + head_dim_, w.queries.get() + row * head_dim_,
                     [](T x) { return Compute(float(x)); });
    }
  }

  // One row's scores over the block's first ``visible`` keys (the rest are after its position) into P and
  // its running max, sum and accumulator. An int8 cache's ``scales`` (the block's keys' times the softmax scale,
  // then its values') scale each score, and each p as it goes into P (not into the sum).
  void softmax_step(int row, int visible, int value_k, const float* scales, Workspace<Compute>& w) const {
    Compute* p = w.probs.get() + row * kKeyBlock;
    if (visible <= 0) {
      std::fill(p, p + value_k, Compute(0));
      return;
    }
    const float* s = w.scores.data() + row * kKeyBlock;
    const int chunks = (visible + 15) / 16;  // 16 keys at a time; lanes past ``visible`` count for nothing
    const auto live = [&](int c) { return std::min(16, visible - 16 * c); };
    const auto scale = [&](int c) { return scales ? load16(scales + 16 * c) : broadcast16(scale_); };
    Vec16 most = broadcast16(w.max[row]);
    for (int c = 0; c < chunks; ++c)
      most = first_lanes16(live(c), max16(most, load16(s + 16 * c) * scale(c)), most);
    const float block_max = reduce_max16(most);
    Vec16 sums = zero16();
    for (int c = 0; c < chunks; ++c) {
      Vec16 e = first_lanes16(live(c), exp16(load16(s + 16 * c) * scale(c) - broadcast16(block_max)), zero16());
      sums = sums + e;
      if (scales) e = e * load16(scales + kKeyBlock + 16 * c);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<Compute, at::BFloat16>) {  // one instruction, rounding as store16 does
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * c), (__m256i)_mm512_cvtneps_pbh(e.v));
        continue;
      }
#endif
      store16(p + 16 * c, e);
    }
    const float block_sum = reduce_add16(sums);
    std::fill(p + std::min(16 * chunks, value_k), p + value_k, Compute(0));
    const float rescale = std::exp(w.max[row] - block_max);  // 0 on the first block
    w.max[row] = block_max;
    w.sum[row] = w.sum[row] * rescale + block_sum;
    float* acc = w.acc.data() + row * out_cols_;
    for (int d = 0; d < out_cols_; ++d) acc[d] *= rescale;
  }

  void store_outputs(const Request& r, const Task& task, int rows, const Workspace<Compute>& w) const {
    for (int row = 0; row < rows; ++row) {
      const int token = r.first_row + task.first_token + row / group_, head = task.kv_head * group_ + row % group_;
      T* dst = out_ + (int64_t(token) * num_heads_ + head) * head_dim_;
      const float* acc = w.acc.data() + row * out_cols_;
      const float inverse = 1.f / w.sum[row];
      for (int d = 0; d < head_dim_; ++d) dst[d] = T(acc[d] * inverse);
    }
  }

  static int blocks(const Request& r) { return (r.seq_len + kKeyBlock - 1) / kKeyBlock; }

  const T* q_;
  const C *k_cache_, *v_cache_;
  const float *k_scale_, *v_scale_;  // an int8 cache's; else unread
  T* out_;
  const std::vector<Request>& requests_;
  const int64_t q_stride_;
  const int num_heads_, head_dim_, block_size_, num_kv_heads_, group_;
  const float scale_;
  const int out_cols_;  // P V's columns: head_dim padded for gemm
  at::Tensor keys_, values_;  // per (request, KV head, key block), packed
  at::Tensor scales_;         // an int8 cache's: per (request, KV head, key block), its keys' then its values'
  static constexpr bool kQuantized = std::is_same_v<C, int8_t>;
};

// Calls a worker on every index below n: each thread makes its own (make_worker()) and takes the next index
// whenever it is done with one.
template <typename MakeWorker>
void share(size_t n, MakeWorker make_worker) {
  std::atomic<size_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto work = make_worker();
    for (size_t i = next++; i < n; i = next++) work(i);
  });
}

template <typename T, typename C, typename Compute>
void prefill_attention_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& k_scale, const at::Tensor& v_scale, std::vector<Request>& requests,
                             float scale, const at::Tensor& out) {
  using Attention = PrefillAttention<T, C, Compute>;
  const int num_kv_heads = k_cache.size(2), tokens_per_task = Attention::tokens_per_task(q.size(1) / num_kv_heads);
  std::vector<std::array<int, 3>> blocks;  // (request, KV head, key block) to pack
  std::vector<Task> tasks;
  int num_blocks = 0;
  for (int i = 0; i < int(requests.size()); ++i) {
    Request& r = requests[i];
    r.first_block = num_blocks;
    num_blocks += (r.seq_len + kKeyBlock - 1) / kKeyBlock;
    for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head)
      for (int block = 0; block * kKeyBlock < r.seq_len; ++block) blocks.push_back({i, kv_head, block});
    for (int first = 0; first < r.query_len; first += tokens_per_task) {
      const int n = std::min(tokens_per_task, r.query_len - first);
      const int64_t keys = r.seq_len - r.query_len + first + n;
      for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) tasks.push_back({i, kv_head, first, n, n * keys});
    }
  }
  // The longest tasks first: the threads finish together.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  Attention attention(q, k_cache, v_cache, k_scale, v_scale, scale, out, requests, num_blocks);
  share(blocks.size(), [&] {
    return [&](size_t i) { attention.pack_block(blocks[i][0], blocks[i][1], blocks[i][2]); };
  });
  share(tasks.size(), [&] {
    return [&, w = attention.workspace()](size_t i) mutable { attention.attend(tasks[i], w); };
  });
}

}  // namespace

// q, out: [num_tokens, num_heads, head_dim] (q's rows may be strided: a view of the QKV projection); caches:
// [num_blocks, block_size, num_kv_heads, head_dim] of q's dtype (scales empty) or int8 (scales float32
// [num_blocks, block_size, num_kv_heads]); per prompt request: block_tables [num_requests, max_blocks],
// first_rows (its first query row in q and out), query_lens and seq_lens, all int32. A request's query rows are
// the last query_len positions of its context; only they are written in ``out``.
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                       const at::Tensor& first_rows, const at::Tensor& query_lens, const at::Tensor& seq_lens,
                       double scale, const at::Tensor& out) {
  const bool quantized = check_attention_tensors("prefill_attention", q, k_cache, v_cache, k_scale, v_scale, out);
  TORCH_CHECK(q.size(2) % 2 == 0, "prefill_attention: head_dim even");
  for (const at::Tensor* t : {&block_tables, &first_rows, &query_lens, &seq_lens})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "prefill_attention takes contiguous CPU tensors");
  const int num_requests = block_tables.size(0);
  for (const at::Tensor* t : {&block_tables, &first_rows, &query_lens, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->size(0) == num_requests,
                "prefill_attention: int32 block tables, first rows and lengths, one per request");
  std::vector<Request> requests;
  for (int i = 0; i < num_requests; ++i) {
    const Request r{block_tables.data_ptr<int32_t>() + i * block_tables.size(1), first_rows.data_ptr<int32_t>()[i],
                    query_lens.data_ptr<int32_t>()[i], seq_lens.data_ptr<int32_t>()[i], 0};
    TORCH_CHECK(r.query_len >= 0 && r.query_len <= r.seq_len && r.first_row >= 0 &&
                    r.first_row + r.query_len <= q.size(0) && r.seq_len <= block_tables.size(1) * k_cache.size(1),
                "prefill_attention: a request's rows or lengths do not fit q or its block table");
    requests.push_back(r);
  }
  const auto run = [&](auto element, auto compute) {
    using T = decltype(element);
    using Compute = decltype(compute);
    if (quantized)
      prefill_attention_typed<T, int8_t, Compute>(q, k_cache, v_cache, k_scale, v_scale, requests, float(scale), out);
    else
      prefill_attention_typed<T, T, Compute>(q, k_cache, v_cache, k_scale, v_scale, requests, float(scale), out);
  };
  switch (q.scalar_type()) {
    case at::kFloat: return run(float(), float());
    case at::kBFloat16: return run(at::BFloat16(), BFloat16Compute());
    case at::kHalf: return run(at::Half(), float());
    default: TORCH_CHECK(false, "prefill_attention: float32, bfloat16 or float16 only, not ", q.scalar_type());
  }
}
