// y = x W^T + b for a few rows of bfloat16 x, in AVX512-BF16: the decode step's linear layers. At up to a few
// dozen rows a layer's time is reading its weight, and oneDNN reads it at half the memory's speed there; this
// kernel reads each weight byte once per 8 rows, in long streams, and keeps 24 accumulators in registers.
//
// The weight is packed once (layers/linear.py): [N/16, K/2, 16, 2], so one 64-byte load holds a pair of inputs
// (k, k+1) for 16 outputs, which `vdpbf16ps` multiplies by a broadcast pair of x in float32. Each task computes
// V blocks of 16 outputs for all rows, 8 rows at a time; a block's packed weight stays in L2 between row chunks.
// The sums are float32 and rounded to bfloat16 once, to nearest, ties to even, as torch's bfloat16 matmul rounds.
// Built with the attention kernels by nanoengine/attention/cpu_backend.py; tested in tests/test_layers.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "cpu_simd.h"

#if defined(__AVX512BF16__)
namespace {

constexpr int kLanes = 16;            // outputs per packed block
constexpr int kAccumulators = 24;     // of the 32 registers: rows x blocks a tile sums in
constexpr int kRowsPerChunk = 8;      // rows a tile holds, at most
constexpr int kPrefetchPairs = 16;    // how far ahead (in input pairs) each stream asks for its next lines

struct Operands {
  const at::BFloat16* x;       // [M, K]
  const at::BFloat16* packed;  // [N/16, K/2, 16, 2]
  const at::BFloat16* bias;    // [N] or null
  at::BFloat16* out;           // [M, N]
  int64_t rows, pairs, outputs;
};

// Rows [row, row + R) times packed blocks [block, block + V).
template <int R, int V>
void tile(const Operands& op, int64_t row, int64_t block) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  const at::BFloat16* streams[V];
  for (int v = 0; v < V; ++v) streams[v] = op.packed + (block + v) * op.pairs * 2 * kLanes;
  const int32_t* x = reinterpret_cast<const int32_t*>(op.x + row * op.pairs * 2);  // one int32 = one input pair
  for (int64_t p = 0; p < op.pairs; ++p) {
    __m512bh w[V];
    for (int v = 0; v < V; ++v) {
      __builtin_prefetch(streams[v] + (p + kPrefetchPairs) * 2 * kLanes);
      w[v] = load_pairs(streams[v] + p * 2 * kLanes);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(x[r * op.pairs + p]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pair, w[v]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t column = (block + v) * kLanes;
    const __m512 bias = op.bias ? load16(op.bias + column) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) store16(op.out + (row + r) * op.outputs + column, _mm512_add_ps(acc[r][v], bias));
  }
}

// The last rows (fewer than a chunk) as one tile of exactly that many (only those that fit in registers are
// built: run<V> never leaves more rows than that).
template <int V, int R = 1>
void last_rows(const Operands& op, int64_t row, int64_t block, int64_t count) {
  if constexpr (R < kRowsPerChunk && R * V <= kAccumulators) {
    if (count == R) return tile<R, V>(op, row, block);
    last_rows<V, R + 1>(op, row, block, count);
  }
}

template <int V>
void blocks(const Operands& op, int64_t block) {
  int64_t row = 0;
  if constexpr (kRowsPerChunk * V <= kAccumulators)
    for (; row + kRowsPerChunk <= op.rows; row += kRowsPerChunk) tile<kRowsPerChunk, V>(op, row, block);
  if (row < op.rows) last_rows<V>(op, row, block, op.rows - row);
}

// Blocks [block, block + count), count <= V, as one tile of exactly that many blocks.
template <int V>
void some_blocks(const Operands& op, int64_t block, int64_t count) {
  if constexpr (V > 1)
    if (count < V) return some_blocks<V - 1>(op, block, count);
  blocks<V>(op, block);
}

// Few rows hold few accumulators: more blocks per tile keep the multiply units busy (dpbf16 waits on its sum).
template <int V>
void run(const Operands& op) {
  const int64_t num_blocks = op.outputs / kLanes;
  at::parallel_for(0, (num_blocks + V - 1) / V, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) some_blocks<V>(op, t * V, std::min<int64_t>(V, num_blocks - t * V));
  });
}

}  // namespace
#endif

bool has_linear_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x: [M, K] bfloat16, contiguous; packed: [N/16, K/2, 16, 2]; bias: [N] or None; out: [M, N], contiguous.
void linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                 const at::Tensor& out) {
  TORCH_CHECK(has_linear_bf16(), "linear_bf16: built without AVX512-BF16");
  for (const at::Tensor* t : {&x, &packed, &out})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kBFloat16,
                "linear_bf16: x, packed and out are contiguous bfloat16 CPU tensors");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 &&
                  x.size(1) == 2 * packed.size(1) && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == 16 * packed.size(0),
              "linear_bf16: x [M, K], packed [N/16, K/2, 16, 2], out [M, N]");
  if (bias)
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == at::kBFloat16 && bias->numel() == out.size(1),
                "linear_bf16: bias [N] bfloat16");
#if defined(__AVX512BF16__)
  const Operands op{x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(),
                    bias ? bias->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(),
                    x.size(0), packed.size(1), out.size(1)};
  if (op.rows <= 2) return run<8>(op);
  if (op.rows <= 4) return run<6>(op);
  run<kAccumulators / kRowsPerChunk>(op);
#endif
}
