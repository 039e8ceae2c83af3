// y = x W^T + b for a few rows of x, on the vector layer (cpu_vec.h): the decode step's linear layers. At up to
// a few dozen rows a layer's time is reading its weight, and oneDNN reads it at about half the memory's speed
// there; this kernel reads the weight in long streams, each byte once per row chunk, and keeps its sums in
// registers (tiles of 8 rows x 3 blocks with AVX-512's 32 registers, 3 x 2 with AVX2's 16).
//
// The weight is packed once (platforms/cpu/linear.py), [N/16, K/step, 16, step], so that one step of the inputs
// holds 16 outputs' weights: one input in float32 (64 bytes) or int8 (16 bytes, W8A16: docs/quantization.md), a
// pair of inputs (k, k+1) in bfloat16 (64 bytes), or eight inputs in 4 bits (one 32-bit word an output, 64 bytes,
// W4A16: see Int4; [N/16, K/8, 16, 4] bytes). Each step is widened to float32 in registers and meets each
// row's broadcast x in an FMA; with AVX512-BF16, bfloat16 pairs (and int8 ones, see Int8Pairs) meet bfloat16 x in
// `vdpbf16ps` instead. The sums are float32 (an int8 weight's times its output's scale at the end), then the bias
// is added and each output rounded once to the output's dtype (to nearest, ties to even, as torch's matmul
// rounds). Tested in tests/test_layers.py and tests/test_quantization.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_simd.h"

namespace {

constexpr int kLanes = 16;  // outputs per packed block
// Tile shapes: rows x blocks of sums kept in registers, three quarters of them (24 of AVX-512's 32 Vec16, 6 of
// AVX2's 8), and the rows a tile holds at most.
constexpr int kAccumulators = kVectorRegisters * 3 / 4;
constexpr int kRowsPerChunk = kVectorRegisters >= 32 ? 8 : 3;
constexpr int64_t kSplitBytes = 1 << 20;  // an x above this (a core's L2 here) is cut into panels
constexpr int64_t kPanelBytes = 64 << 10;
// How far ahead (in 64-byte lines) each of a tile's weight streams asks for its next lines: a tile of 6-8 streams
// (up to 4 rows) asks for 6-8 lines a step, and 16 lines reach far enough; fewer streams (5 rows and more) ask
// for fewer lines a step, and need 32.
constexpr int prefetch_lines(int streams) { return streams >= 6 ? 16 : 32; }

// One step of the inputs: its weights for 16 outputs, widened to float32 once per step of a tile and shared by
// its rows, each input met by a row's broadcast x (float32) in an FMA.
template <typename T>
struct Step;

template <>
struct Step<float> {
  static constexpr int inputs = 1;
  static void widen(const float* w, Vec16* out) { out[0] = load16(w); }
};

// int8 (W8A16): 16 outputs' weights of one input are 16 bytes, sign-extended and converted to float32.
template <>
struct Step<int8_t> {
  static constexpr int inputs = 1;
  static void widen(const int8_t* w, Vec16* out) { out[0] = load16(w); }
};

// 4-bit (W4A16): a step is eight inputs of 16 outputs, one 32-bit word per output: input 2p's q (p = 0..3) at bits
// [4p, 4p + 4), input 2p + 1's at bits [16 + 4p, 20 + 4p). Each q is widened where it lies, as q 2^at (two
// operations: nibble_in_place16), and meets x pre-scaled by 2^-at (exact: a power of two, for any |x| over 2^-102,
// where the scaled x stays a normal float) in float32 FMAs, into partial sums of x q per group of 32 inputs, which
// become sums of x w at the group's end (add_group): sum(x w) = scale partial + min sum(x). Widening is the cost
// that limits few rows: shifting each q under 1.0's exponent first (1 + q/16) took three operations with AVX2, and
// one row ran at 0.75x the memory's speed.
struct Int4 {
  uint8_t byte;
};
template <>
struct Step<Int4> {
  static constexpr int inputs = 8;
};
template <typename W>
constexpr bool kGrouped = false;  // a scale and a minimum (or none: -8 scale) per output and group of 32 inputs
template <>
constexpr bool kGrouped<Int4> = true;
constexpr int64_t kStepsPerGroup = 4;
constexpr int kNibbleAt[8] = {0, 16, 4, 20, 8, 24, 12, 28};  // the bits of each input of a step
// What each input of a step's x is multiplied by to meet its q as nibble_in_place16 widens it (q 2^at, but the top
// one shifted down: q), for 16 inputs, as a Vec16 of x reads them.
constexpr std::array<float, 16> input_scales() {
  std::array<float, 16> scales{};
  for (int i = 0; i < 16; ++i) scales[i] = kNibbleAt[i % 8] == 28 ? 1.f : 1.f / float(1u << kNibbleAt[i % 8]);
  return scales;
}
constexpr std::array<float, 16> kInputScales = input_scales();

#if defined(__AVX512BF16__)
// With AVX512-BF16 a bfloat16 step is a pair of inputs (k, k + 1), which `vdpbf16ps` multiplies by a broadcast
// pair of x as they are: ``load`` a step's weights once per step of a tile, ``multiply_add`` them with each row's
// broadcast x.
template <>
struct Step<at::BFloat16> {
  static constexpr int inputs = 2;
  static __m512bh load(const at::BFloat16* w) { return load_pairs(w); }
  static __m512 multiply_add(__m512 sums, __m512i x, __m512bh w) { return _mm512_dpbf16_ps(sums, as_pairs(x), w); }
};

// An int8 weight times bfloat16 x where the CPU has AVX512-BF16: the int8 layout read two inputs a step (input k's
// 16 bytes, then input k + 1's), both widened to float32 and made the bfloat16 pairs that `vdpbf16ps` multiplies
// by a broadcast pair of x: an integer of at most 8 bits is exact in bfloat16 (its float32's low 16 bits are
// zero), so each product is exact in float32, as in the FMAs, at twice their rate.
struct Int8Pairs {
  int8_t value;
};
template <>
struct Step<Int8Pairs> {
  static constexpr int inputs = 2;
  static __m512bh load(const Int8Pairs* w) {
    const int8_t* bytes = reinterpret_cast<const int8_t*>(w);
    const __m512i first = _mm512_castps_si512(load16(bytes).v), second = _mm512_castps_si512(load16(bytes + kLanes).v);
    return as_pairs(_mm512_or_si512(_mm512_srli_epi32(first, 16), second));
  }
  static __m512 multiply_add(__m512 sums, __m512i x, __m512bh w) { return _mm512_dpbf16_ps(sums, as_pairs(x), w); }
};
// A 4-bit weight times bfloat16 x where the CPU has AVX512-BF16: the pairs of inputs (2p, 2p + 1) of a step as
// bfloat16 pairs of 1 + q/16 (q at the top of 1.0's 7-bit mantissa), which `vdpbf16ps` multiplies by a broadcast
// pair of x, each product exact in float32.
struct Int4Pairs {
  uint8_t byte;
};
template <>
struct Step<Int4Pairs> {
  static constexpr int inputs = 8;
};
template <>
constexpr bool kGrouped<Int4Pairs> = true;
inline __m512bh nibble_pairs_plus_one(Nibbles16 words, int p) {
  const __m512i q = shift_words(words.v, 3 - 4 * p);  // (q & mask) | one: vpternlogd's 0xEA
  return as_pairs(_mm512_ternarylogic_epi32(q, _mm512_set1_epi32(0x00780078), _mm512_set1_epi32(0x3F803F80), 0xEA));
}
template <typename T>
constexpr bool kPairs = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, Int8Pairs> || std::is_same_v<T, Int4Pairs>;
#else
// bfloat16 elsewhere: each 64-byte load of weight pairs (k, k + 1) is widened to float32 once per step of a tile
// (input k's weights by a shift, input k + 1's by a mask), and meets x, widened to float32 before the call, in two
// FMAs per row: float32's multiply rate at half its weight bytes.
template <>
struct Step<at::BFloat16> {
  static constexpr int inputs = 2;
  static void widen(const at::BFloat16* w, Vec16* out) { widen_pairs16(w, out[0], out[1]); }
};
template <typename T>
constexpr bool kPairs = false;
#endif

template <typename W>
constexpr int kInputsPerElement = kGrouped<W> ? 2 : 1;  // a 4-bit weight's byte holds two

template <typename W>
using Input = std::conditional_t<kPairs<W>, at::BFloat16, float>;  // what x is read as

template <typename W>
constexpr int64_t kBlockStep = kLanes * Step<W>::inputs / kInputsPerElement<W>;  // elements of one step of one block

template <typename W>
constexpr bool kScaled = sizeof(W) == 1 && !kGrouped<W>;  // int8: the sums times the output's scale

// W: the packed weight's type; T: the bias's and the output's (an int8 or 4-bit weight's x, bias and out are
// float32, bfloat16 or float16; any other weight's are of its own type).
template <typename W, typename T = W>
struct Operands {
  const Input<W>* x;              // [M, K]
  const W* packed;                // [N/16, K/step, 16, step]
  const float* scale;             // [N] for an int8 weight, else null
  const at::Half *group_scale, *group_min;  // [N/16, K/32, 16] for a 4-bit weight (min: null for Q4_0's), else null
  const float* x_sums;            // [M, K/32] for a 4-bit weight: each group's sum of x
  const T* bias;                  // [N] or null
  T* out;                         // [M, N]
  int64_t rows, steps, outputs;
};

template <typename W>
constexpr int64_t kStepsPerLine = 64 / (kBlockStep<W> * int64_t(sizeof(W)));  // 1, or 2 and 4 for int8

// Rows [row, row + R) of blocks [block, block + V): the sums (an int8 weight's times its scale) plus the bias,
// rounded once to out's dtype.
template <typename W, typename T, int R, int V>
void store_sums(const Operands<W, T>& op, int64_t row, int64_t block, Vec16 (&sums)[R][V]) {
  for (int v = 0; v < V; ++v) {
    const int64_t column = (block + v) * kLanes;
    const Vec16 bias = op.bias ? load16(op.bias + column) : zero16();
    if constexpr (kScaled<W>) {
      const Vec16 scale = load16(op.scale + column);
      for (int r = 0; r < R; ++r) sums[r][v] = sums[r][v] * scale;
    }
    for (int r = 0; r < R; ++r) store16(op.out + (row + r) * op.outputs + column, sums[r][v] + bias);
  }
}

// Rows [row, row + R) times packed blocks [block, block + V). At each step, each block's stream asks for the
// weight ``ahead`` elements further on.
template <typename W, typename T, int R, int V>
void dense_tile(const Operands<W, T>& op, int64_t row, int64_t block, int64_t ahead) {
  Vec16 sums[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) sums[r][v] = zero16();
  const W* streams[V];
  for (int v = 0; v < V; ++v) streams[v] = op.packed + (block + v) * op.steps * kBlockStep<W>;
  for (int64_t s = 0; s < op.steps; ++s) {
    if (s % kStepsPerLine<W> == 0)  // once per 64-byte line of each stream, into L2, as prefetch_block does
      for (int v = 0; v < V; ++v) __builtin_prefetch(streams[v] + s * kBlockStep<W> + ahead, 0, 2);
    if constexpr (kPairs<W>) {
#if defined(__AVX512BF16__)
      decltype(Step<W>::load(streams[0])) weights[V];
      for (int v = 0; v < V; ++v) weights[v] = Step<W>::load(streams[v] + s * kBlockStep<W>);
      const int32_t* x = reinterpret_cast<const int32_t*>(op.x) + row * op.steps;  // one int32 = one step of x
      for (int r = 0; r < R; ++r) {
        const __m512i broadcast = _mm512_set1_epi32(x[r * op.steps + s]);
        for (int v = 0; v < V; ++v) sums[r][v].v = Step<W>::multiply_add(sums[r][v].v, broadcast, weights[v]);
      }
#endif
    } else {
      constexpr int inputs = Step<W>::inputs;
      Vec16 wide[V][inputs];
      for (int v = 0; v < V; ++v) Step<W>::widen(streams[v] + s * kBlockStep<W>, wide[v]);
      const float* x = op.x + (row * op.steps + s) * inputs;  // row r's inputs: x[r inputs steps + i]
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < inputs; ++i) {
          const Vec16 broadcast = broadcast16(x[(r * op.steps) * inputs + i]);
          for (int v = 0; v < V; ++v) sums[r][v] = fma16(broadcast, wide[v][i], sums[r][v]);
        }
    }
  }
  store_sums<W, T, R, V>(op, row, block, sums);
}

// A 4-bit tile's partial sums come in two sets where registers allow, the step's inputs taking turns, so that
// each sum waits on half as many multiply-adds in a row: one row with AVX2 (one block, one sum) ran at 0.7-1.1x
// int8's speed in one set, 0.9-1.2x in two.
template <int R, int V>
constexpr int kPartialSets = 3 * R * V <= kAccumulators ? 2 : 1;

// One step of a 4-bit weight: each row's x times each block's q (x pre-scaled, Int4) or 1 + q/16 (Int4Pairs), added
// into ``partial``.
template <typename W, typename T, int R, int V>
void multiply_add_nibbles(const Operands<W, T>& op, int64_t row, int64_t s, const W* const* streams,
                          Vec16 (&partial)[kPartialSets<R, V>][R][V]) {
  Nibbles16 words[V];
  for (int v = 0; v < V; ++v) words[v] = load_nibbles16(&streams[v][s * kBlockStep<W>].byte);
  if constexpr (kPairs<W>) {
#if defined(__AVX512BF16__)
    const int32_t* x = reinterpret_cast<const int32_t*>(op.x) + (row * op.steps + s) * 4;  // an int32: two inputs
    for (int p = 0; p < 4; ++p) {
      __m512bh pairs[V];
      for (int v = 0; v < V; ++v) pairs[v] = nibble_pairs_plus_one(words[v], p);
      for (int r = 0; r < R; ++r) {
        const __m512bh broadcast = as_pairs(_mm512_set1_epi32(x[r * op.steps * 4 + p]));
        for (int v = 0; v < V; ++v) {
          Vec16& sum = partial[p % kPartialSets<R, V>][r][v];
          sum.v = _mm512_dpbf16_ps(sum.v, broadcast, pairs[v]);
        }
      }
    }
#endif
  } else {
    const float* x = op.x + (row * op.steps + s) * 8;  // row r's inputs: x[r 8 steps + i], scaled by 2^-at
    for (int i = 0; i < 8; ++i) {
      Vec16 wide[V];
      for (int v = 0; v < V; ++v) wide[v] = nibble_in_place16(words[v], kNibbleAt[i]);
      for (int r = 0; r < R; ++r) {
        const Vec16 broadcast = broadcast16(x[r * op.steps * 8 + i]);
        for (int v = 0; v < V; ++v) {
          Vec16& sum = partial[i % kPartialSets<R, V>][r][v];
          sum = fma16(broadcast, wide[v], sum);
        }
      }
    }
  }
}

// A group's partial sums made sums of x w and added: of x q (Int4), scale partial + min sum(x); of x (1 + q/16)
// (Int4Pairs), 16 scale partial + (min - 16 scale) sum(x), whose second factor is shared by a block's rows (three
// operations a row and block, where subtracting sum(x) from the partial sums first took four: a prompt's 4-bit
// layers took 5% less time). A weight without minimums (a Q4_0 file's) has min = -8 scale.
template <typename W, typename T, int R, int V>
void add_group(const Operands<W, T>& op, int64_t row, int64_t block, int64_t group,
               Vec16 (&partial)[kPartialSets<R, V>][R][V], Vec16 (&sums)[R][V]) {
  const int64_t groups = op.steps / kStepsPerGroup;
  for (int v = 0; v < V; ++v) {
    const int64_t at = ((block + v) * groups + group) * kLanes;
    Vec16 scale = load16(op.group_scale + at);
    Vec16 offset = op.group_min ? load16(op.group_min + at) : scale * broadcast16(-8.f);  // the minimum
    if constexpr (kPairs<W>) {
      scale = scale * broadcast16(16.f);
      offset = offset - scale;
    }
    for (int r = 0; r < R; ++r) {
      Vec16 both = partial[0][r][v];
      for (int set = 1; set < kPartialSets<R, V>; ++set) both = both + partial[set][r][v];
      sums[r][v] = fma16(broadcast16(op.x_sums[(row + r) * groups + group]), offset, fma16(both, scale, sums[r][v]));
    }
  }
}

template <typename W, typename T, int R, int V>
void grouped_tile(const Operands<W, T>& op, int64_t row, int64_t block, int64_t ahead) {
  Vec16 sums[R][V], partial[kPartialSets<R, V>][R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) sums[r][v] = zero16();
  const W* streams[V];
  for (int v = 0; v < V; ++v) streams[v] = op.packed + (block + v) * op.steps * kBlockStep<W>;
  for (int64_t group = 0; group < op.steps / kStepsPerGroup; ++group) {
    for (auto& set : partial)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < V; ++v) set[r][v] = zero16();
    for (int64_t s = group * kStepsPerGroup; s < (group + 1) * kStepsPerGroup; ++s) {
      for (int v = 0; v < V; ++v) __builtin_prefetch(streams[v] + s * kBlockStep<W> + ahead, 0, 2);  // a line a step
      multiply_add_nibbles<W, T, R, V>(op, row, s, streams, partial);
    }
    add_group<W, T, R, V>(op, row, block, group, partial, sums);
  }
  store_sums<W, T, R, V>(op, row, block, sums);
}

template <typename W, typename T, int R, int V>
void tile(const Operands<W, T>& op, int64_t row, int64_t block, int64_t ahead) {
  if constexpr (kGrouped<W>)
    grouped_tile<W, T, R, V>(op, row, block, ahead);
  else
    dense_tile<W, T, R, V>(op, row, block, ahead);
}

// The last rows (fewer than a chunk) as one tile of exactly that many (only those that fit in registers are
// built: run<V> never leaves more rows than that).
template <typename W, typename T, int V, int R = 1>
void last_rows(const Operands<W, T>& op, int64_t row, int64_t block, int64_t count, int64_t ahead) {
  if constexpr (R < kRowsPerChunk && R * V <= kAccumulators) {
    if (count == R) return tile<W, T, R, V>(op, row, block, ahead);
    last_rows<W, T, V, R + 1>(op, row, block, count, ahead);
  }
}

// The first row chunk reads the tile's weight from memory, each stream asking a few steps ahead. The second
// chunk (a whole one, or the last rows) finds it in L2 and asks for the next tile's instead (the same step of the
// block V on), where a whole next tile follows and both tiles' weights fit in kSplitBytes (a core's L2 here): the
// next tile's first chunk then finds its weight in L2 too (docs/cpu.md has the gain at 16 and 32 rows).
template <typename W, typename T, int V>
void blocks(const Operands<W, T>& op, int64_t block) {
  const int64_t ahead = prefetch_lines(V) * 64 / int64_t(sizeof(W)), tile_elements = V * op.steps * kBlockStep<W>;
  const bool next_fits =
      block + 2 * V <= op.outputs / kLanes && 2 * tile_elements * int64_t(sizeof(W)) <= kSplitBytes;
  const int64_t next_tile = next_fits ? tile_elements : ahead;
  const auto ahead_at = [&](int64_t row) { return row == kRowsPerChunk ? next_tile : ahead; };
  int64_t row = 0;
  if constexpr (kRowsPerChunk * V <= kAccumulators)
    for (; row + kRowsPerChunk <= op.rows; row += kRowsPerChunk)
      tile<W, T, kRowsPerChunk, V>(op, row, block, ahead_at(row));
  if (row < op.rows) last_rows<W, T, V>(op, row, block, op.rows - row, ahead_at(row));
}

// Blocks [block, block + count), count <= V, as one tile of exactly that many blocks.
template <typename W, typename T, int V>
void some_blocks(const Operands<W, T>& op, int64_t block, int64_t count) {
  if constexpr (V > 1)
    if (count < V) return some_blocks<W, T, V - 1>(op, block, count);
  blocks<W, T, V>(op, block);
}

// Few rows hold few sums: more blocks per tile keep the multiply units busy (each waits on its sum). An x larger
// than L2 would be read again from L3 by every tile: it is cut into equal panels of about 64 KiB (8 rows at
// least), which stay in L2 while every tile passes over them, the tasks taking panels in order. A smaller x
// stays whole: L2 holds it, and panels would read the weight once per panel.
template <typename W, typename T, int V>
void run(const Operands<W, T>& op) {
  const int64_t num_blocks = op.outputs / kLanes;
  const int64_t tiles = (num_blocks + V - 1) / V;
  const int64_t x_bytes = op.rows * op.steps * Step<W>::inputs * int64_t(sizeof(Input<W>));
  const int64_t max_panels = x_bytes > kSplitBytes ? x_bytes / kPanelBytes : 1;
  const int64_t panel_rows = std::max<int64_t>(kRowsPerChunk, round_up((op.rows + max_panels - 1) / max_panels,
                                                                       kRowsPerChunk));
  const int64_t panels = (op.rows + panel_rows - 1) / panel_rows;
  at::parallel_for(0, panels * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t first_row = i / tiles * panel_rows, t = i % tiles;
      Operands<W, T> panel = op;
      panel.x += first_row * op.steps * Step<W>::inputs;
      panel.out += first_row * op.outputs;
      if constexpr (kGrouped<W>) panel.x_sums += first_row * (op.steps / kStepsPerGroup);
      panel.rows = std::min(panel_rows, op.rows - first_row);
      some_blocks<W, T, V>(panel, t * V, std::min<int64_t>(V, num_blocks - t * V));
    }
  });
}

// The sum of each group of 32 of ``count`` inputs (as the kernel reads them: bfloat16 x widened exactly); where
// ``scaled`` is given, x widened to float32 into it, times kInputScales (Int4's x).
template <typename X>
std::vector<float> group_sums(const X* x, int64_t count, float* scaled = nullptr) {
  std::vector<float> sums(count / 32);
  const Vec16 scales = load16(kInputScales.data());
  for (size_t g = 0; g < sums.size(); ++g) {
    const Vec16 first = load16(x + 32 * g), second = load16(x + 32 * g + 16);
    sums[g] = reduce_add16(first + second);
    if (scaled) {
      store16(scaled + 32 * g, first * scales);
      store16(scaled + 32 * g + 16, second * scales);
    }
  }
  return sums;
}

// The tile shape for a call's rows.
template <typename W, typename T>
void run_in_tiles(const Operands<W, T>& op) {
  if constexpr (kGrouped<W>) {
    // A 4-bit tile keeps 1 + kPartialSets Vec16 a row and block (its sums and the group's partial sums).
    if constexpr (kVectorRegisters >= 32) {
      if (op.rows <= 2) return run<W, T, 4>(op);
      if (op.rows <= 4) return run<W, T, 2>(op);
    }
    run<W, T, 1>(op);
  } else {
    // An int8 step is 16 or 32 bytes a stream, and widening it costs more than its multiply: 4 streams read them
    // at the memory's speed at one row, where 8 ran slower (docs/quantization.md).
    if constexpr (kVectorRegisters >= 32) {
      if (op.rows <= 2) return run<W, T, sizeof(W) == 1 ? 4 : 8>(op);
      if (op.rows <= 4) return run<W, T, 6>(op);
    } else if (op.rows <= 2) {
      return run<W, T, 3>(op);
    }
    run<W, T, kAccumulators / kRowsPerChunk>(op);
  }
}

template <typename W, typename T = W>
void linear_as(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
               const c10::optional<at::Tensor>& minimum, const c10::optional<at::Tensor>& bias,
               const at::Tensor& out) {
  constexpr bool grouped = kGrouped<W>, scaled = std::is_same_v<W, Int4>;
  const at::Tensor input =
      kPairs<W> ? x : scaled ? at::empty(x.sizes(), x.options().dtype(at::kFloat)) : x.to(at::kFloat);
  std::vector<float> x_sums;
  if constexpr (scaled)
    x_sums = group_sums(x.data_ptr<T>(), x.numel(), input.data_ptr<float>());
  else if constexpr (grouped)
    x_sums = group_sums(input.data_ptr<Input<W>>(), x.numel());
  run_in_tiles(Operands<W, T>{input.data_ptr<Input<W>>(), static_cast<const W*>(packed.data_ptr()),
                              scale && !grouped ? scale->data_ptr<float>() : nullptr,
                              grouped ? scale->data_ptr<at::Half>() : nullptr,
                              grouped && minimum ? minimum->data_ptr<at::Half>() : nullptr, x_sums.data(),
                              bias ? bias->data_ptr<T>() : nullptr, out.data_ptr<T>(), x.size(0),
                              x.size(1) / Step<W>::inputs, out.size(1)});
}

bool multiplies(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar || dtype == at::kByte;
}

// An int8 or 4-bit weight's x (and bias and out): float32, bfloat16 or float16.
bool scales_for(at::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf; }

void check_scale(const at::Tensor& x, const c10::optional<at::Tensor>& scale, int64_t outputs) {
  TORCH_CHECK(scales_for(x.scalar_type()), "linear: an int8 weight's x is float32, bfloat16 or float16, not ",
              x.scalar_type());
  TORCH_CHECK(scale && scale->device().is_cpu() && scale->is_contiguous() && scale->scalar_type() == at::kFloat &&
                  scale->numel() == outputs,
              "linear: an int8 weight needs its scale, float32 [N]");
}

void check_groups(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
                  const c10::optional<at::Tensor>& minimum) {
  TORCH_CHECK(scales_for(x.scalar_type()), "linear: a 4-bit weight's x is float32, bfloat16 or float16, not ",
              x.scalar_type());
  TORCH_CHECK(x.size(1) % 32 == 0, "linear: a 4-bit weight's x [M, K] has whole groups of 32 inputs, not K = ",
              x.size(1));
  const std::vector<int64_t> shape{packed.size(0), x.size(1) / 32, 16};
  for (const auto& [t, name] : {std::pair{&scale, "scale"}, {&minimum, "minimum"}}) {
    const bool no_minimum = t == &minimum && !*t;  // a symmetric weight's (Q4_0's): min = -8 scale
    TORCH_CHECK(no_minimum || (*t && (*t)->device().is_cpu() && (*t)->is_contiguous() &&
                               (*t)->scalar_type() == at::kHalf && (*t)->sizes() == at::IntArrayRef(shape)),
                "linear: a 4-bit weight needs its ", name, ", float16 [N/16, K/32, 16]");
  }
}
}  // namespace

// The weight dtypes this build multiplies: float32 and bfloat16 (bfloat16 in dpbf16 with AVX512-BF16), int8
// (with a float32 scale per output; x float32, bfloat16 or float16) and 4-bit, "int4" (uint8 pairs of nibbles,
// with a float16 scale and minimum, or none (-8 scale), per output and group of 32 inputs; x as for int8).
std::vector<std::string> linear_dtypes() {
  std::vector<std::string> dtypes;
  for (const auto& [dtype, name] :
       {std::pair{at::kFloat, "float32"}, {at::kBFloat16, "bfloat16"}, {at::kChar, "int8"}, {at::kByte, "int4"}})
    if (multiplies(dtype)) dtypes.push_back(name);
  return dtypes;
}

// x: [M, K], contiguous; packed: [N/16, K/step, 16, step] (step 2 for bfloat16, 1 for float32 and int8), or for a
// 4-bit weight uint8 [N/16, K/8, 16, 4] (each lane's 4 bytes eight inputs, see Int4); scale: [N] float32 for an
// int8 weight, float16 [N/16, K/32, 16] for a 4-bit one, else None; minimum: a 4-bit weight's, as its scale, or
// None for a symmetric one (min = -8 scale), else None; bias: [N] or None; out: [M, N], contiguous. x, bias and out
// share one dtype, the weight's unless the weight is int8 or 4-bit.
void linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
            const c10::optional<at::Tensor>& minimum, const c10::optional<at::Tensor>& bias, const at::Tensor& out) {
  const at::ScalarType weight_dtype = packed.scalar_type(), dtype = x.scalar_type();
  const bool int8 = weight_dtype == at::kChar, int4 = weight_dtype == at::kByte;
  const int64_t per_lane = weight_dtype == at::kBFloat16 ? 2 : int4 ? 4 : 1, inputs = int4 ? 8 : per_lane;
  TORCH_CHECK(multiplies(weight_dtype), "linear: this build does not multiply ", weight_dtype, " weights");
  for (const at::Tensor* t : {&x, &packed, &out})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && (t == &packed || t->scalar_type() == dtype) &&
                    (int8 || int4 || t->scalar_type() == weight_dtype),
                "linear: x, packed and out are contiguous CPU tensors of one dtype (x and out of one, with int8 or "
                "4-bit)");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == per_lane &&
                  x.size(1) == inputs * packed.size(1) && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == 16 * packed.size(0),
              "linear: x [M, K], packed [N/16, K/", inputs, ", 16, ", per_lane, "], out [M, N]");
  if (bias)
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == dtype && bias->numel() == out.size(1),
                "linear: bias [N] of x's dtype");
  if (int8)
    check_scale(x, scale, out.size(1));
  else if (int4)
    check_groups(x, packed, scale, minimum);
  else
    TORCH_CHECK(!scale, "linear: a scale goes with an int8 or 4-bit weight only");
  TORCH_CHECK(int4 || !minimum, "linear: a minimum goes with a 4-bit weight only");
#if defined(__AVX512BF16__)
  if (int8 && dtype == at::kBFloat16 && x.size(1) % 2 == 0)
    return linear_as<Int8Pairs, at::BFloat16>(x, packed, scale, minimum, bias, out);
  if (int4 && dtype == at::kBFloat16) return linear_as<Int4Pairs, at::BFloat16>(x, packed, scale, minimum, bias, out);
#endif
  if (int8 && dtype == at::kBFloat16) return linear_as<int8_t, at::BFloat16>(x, packed, scale, minimum, bias, out);
  if (int8 && dtype == at::kHalf) return linear_as<int8_t, at::Half>(x, packed, scale, minimum, bias, out);
  if (int8) return linear_as<int8_t, float>(x, packed, scale, minimum, bias, out);
  if (int4 && dtype == at::kBFloat16) return linear_as<Int4, at::BFloat16>(x, packed, scale, minimum, bias, out);
  if (int4 && dtype == at::kHalf) return linear_as<Int4, at::Half>(x, packed, scale, minimum, bias, out);
  if (int4) return linear_as<Int4, float>(x, packed, scale, minimum, bias, out);
  if (dtype == at::kBFloat16) return linear_as<at::BFloat16>(x, packed, scale, minimum, bias, out);
  linear_as<float>(x, packed, scale, minimum, bias, out);
}
