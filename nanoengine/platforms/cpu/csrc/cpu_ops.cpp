// The small per-layer ops on the CPU: RMSNorm, SiLU(gate) * up and rotary, one pass over each row where
// torch runs four to six kernels (and dispatches each of them: at a decode's few rows, most of the time); and the
// greedy sampler's argmax.
// Each rounds to the model's dtype exactly where the torch modules in layers/ do (and so Hugging Face's),
// so that a bfloat16 result is theirs bit for bit, bar the last bit of an exp or a sum. Built with the
// decode kernel by nanoengine/platforms/cpu/build.py; tested against the torch modules in tests/test_layers.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"
#include "cpu_simd.h"

namespace {

// x rounded to T and back: a bfloat16 or float16 product or sum in torch is rounded once, here too.
template <typename T>
inline float rounded(float x) {
  return float(T(x));
}

// Rows of ``x`` addressed as (outer, inner) pairs: [tokens, hidden] or the heads of [tokens, heads, head_dim].
struct Rows {
  int64_t inner, outer_stride, inner_stride;
  int64_t offset(int64_t row) const { return row / inner * outer_stride + row % inner * inner_stride; }
};

Rows rows_of(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.stride(-1) == 1 && (x.dim() == 2 || x.dim() == 3),
              "cpu_ops: a CPU tensor [rows, dim] or [tokens, heads, dim] whose last dimension is contiguous");
  if (x.dim() == 2) return {1, x.stride(0), 0};
  return {x.size(1), x.stride(0), x.stride(1)};
}

template <typename Fn>
void for_each_dtype(const at::Tensor& x, const char* name, const Fn& fn) {
  switch (x.scalar_type()) {
    case at::kFloat: return fn(float());
    case at::kBFloat16: return fn(at::BFloat16());
    case at::kHalf: return fn(at::Half());
    default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16 only, not ", x.scalar_type());
  }
}

template <typename T>
void normalize_row(const T* row, const T* weight, int64_t dim, float eps, T* out) {
  float squares = 0.f;
  for (int64_t d = 0; d < dim; ++d) squares += float(row[d]) * float(row[d]);
  const float inverse_rms = 1.f / std::sqrt(squares / float(dim) + eps);
  for (int64_t d = 0; d < dim; ++d) out[d] = T(float(weight[d]) * rounded<T>(float(row[d]) * inverse_rms));
}

void check_norm(const char* name, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && weight.is_contiguous() &&
              weight.numel() == x.size(-1) && weight.scalar_type() == x.scalar_type() &&
              out.scalar_type() == x.scalar_type(), name, ": out contiguous and of x's shape, weight [dim], one dtype");
}

}  // namespace

// out = weight * T(x / sqrt(mean(x^2) + eps)), the normalization in float32 (layers/norm.py).
// x: [rows, dim] or [tokens, heads, dim]; out: contiguous, of x's shape.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  const Rows rows = rows_of(x);
  const int64_t dim = x.size(-1), num_rows = x.numel() / dim;
  check_norm("rms_norm", x, weight, out);
  for_each_dtype(x, "rms_norm", [&](auto element) {
    using T = decltype(element);
    const T *x_data = x.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* out_data = out.data_ptr<T>();
    at::parallel_for(0, num_rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        normalize_row(x_data + rows.offset(r), w, dim, float(eps), out_data + r * dim);
    });
  });
}

// The residual stream's add and the norm after it in one pass: residual = T(residual + x) in place, then
// out = rms_norm(residual). x, residual, out: contiguous [rows, dim].
void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                  const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() &&
              residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: contiguous CPU x and residual [rows, dim], one dtype");
  check_norm("add_rms_norm", x, weight, out);
  const int64_t dim = x.size(1);
  for_each_dtype(x, "add_rms_norm", [&](auto element) {
    using T = decltype(element);
    const T *x_data = x.data_ptr<T>(), *w = weight.data_ptr<T>();
    T *sum = residual.data_ptr<T>(), *out_data = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = sum + r * dim;
        for (int64_t d = 0; d < dim; ++d) row[d] = T(float(row[d]) + float(x_data[r * dim + d]));
        normalize_row(row, w, dim, float(eps), out_data + r * dim);
      }
    });
  });
}

// out = T(silu(gate)) * up, for gate_up = [gate | up] ([rows, 2 * dim], contiguous); out: [rows, dim].
void silu_and_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  const int64_t dim = gate_up.size(-1) / 2, num_rows = gate_up.numel() / (2 * dim);
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() && out.is_contiguous() &&
              out.size(0) == num_rows && out.size(1) == dim && out.scalar_type() == gate_up.scalar_type(),
              "silu_and_mul: contiguous CPU [rows, 2 * dim] in, [rows, dim] out, one dtype");
  for_each_dtype(gate_up, "silu_and_mul", [&](auto element) {
    using T = decltype(element);
    const T* in = gate_up.data_ptr<T>();
    T* out_data = out.data_ptr<T>();
    at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *gate = in + r * 2 * dim, *up = gate + dim;
        T* o = out_data + r * dim;
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16) {  // in float32 lanes: exp16 and the division a few units off, as torch's are
          const Vec16 g = load16(gate + d);
          const Vec16 silu = g / (broadcast16(1.f) + exp16(zero16() - g));
          store16(o + d, round16<T>(silu) * load16(up + d));
        }
        for (; d < dim; ++d) {
          // In double (the argument capped: -ffast-math assumes no infinities), so it rounds as torch's float
          // silu does but where that is a unit off; the vector lanes above differ from torch in about 0.1%.
          const double g = double(gate[d]);
          o[d] = T(rounded<T>(float(g / (1.0 + std::exp(std::min(-g, 700.0))))) * float(up[d]));
        }
      }
    });
  });
}

// x = x * cos + rotate_half(x) * sin, in place, each product and the sum rounded to T (layers/rotary.py).
// x: [tokens, heads, head_dim] (a view into the fused QKV output is fine); cos, sin: [tokens, head_dim],
// contiguous, each half a copy of the other, as RotaryEmbedding makes them.
void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const Rows rows = rows_of(x);
  const int64_t head_dim = x.size(-1), half = head_dim / 2, heads = x.size(1), num_rows = x.size(0) * heads;
  TORCH_CHECK(x.dim() == 3 && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * head_dim &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type() && head_dim % 2 == 0,
              "rotary: x [tokens, heads, head_dim] (even head_dim), cos and sin [tokens, head_dim], one dtype");
  for_each_dtype(x, "rotary", [&](auto element) {
    using T = decltype(element);
    T* x_data = x.data_ptr<T>();
    const T *cos_data = cos.data_ptr<T>(), *sin_data = sin.data_ptr<T>();
    at::parallel_for(0, num_rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = x_data + rows.offset(r);
        const T *c = cos_data + r / heads * head_dim, *s = sin_data + r / heads * head_dim;
        for (int64_t d = 0; d < half; ++d) {
          const float first = float(row[d]), second = float(row[d + half]);
          row[d] = T(rounded<T>(first * float(c[d])) + rounded<T>(-second * float(s[d])));
          row[d + half] = T(rounded<T>(second * float(c[d + half])) + rounded<T>(first * float(s[d + half])));
        }
      }
    });
  });
}

namespace {

// One head vector x (n values) as int8 q = round(x / s), rounded half to even and clamped to [-127, 127], with
// s = absmax(x) / 127 (a zero vector: s = 0 and q = 0): torch_backend.quantize's bytes exactly. Returns s.
// -ffast-math lets GCC turn a division by a constant, or several by one value, into a product with the
// reciprocal, and a vector division into a reciprocal estimate and a Newton step: each is a unit in the last
// place off now and then, and a quotient near k + 1/2 then rounds the other way. So the divisors are read from
// volatiles, whose values the compiler cannot know or share, and the vector division is vdivps itself.
template <typename T>
float quantize_row(const T* x, int n, int8_t* q) {
  float absmax = 0.f;
  for (int d = 0; d < n; ++d) absmax = std::max(absmax, std::abs(float(x[d])));
  volatile float levels = 127.f;
  const float scale = absmax / levels;
  volatile float divisor = scale > 0.f ? scale : 1.f;
  int d = 0;
  const Vec16 divisors = broadcast16(divisor);
  for (; d + 16 <= n; d += 16) {
    const Vec16 rounded = round_to_integer16(divide_exactly16(load16(x + d), divisors));
    alignas(64) float clamped[16];
    store16(clamped, min16(broadcast16(127.f), max16(broadcast16(-127.f), rounded)));
    for (int i = 0; i < 16; ++i) q[d + i] = int8_t(clamped[i]);  // integral already: the conversion is exact
  }
  for (; d < n; ++d) q[d] = int8_t(std::clamp(std::nearbyint(float(x[d]) / divisor), -127.f, 127.f));
  return scale;
}

// store_kv into an int8 cache: each token's head vectors quantized, their scales beside them.
template <typename T>
void store_quantized(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scales, const int64_t* slots) {
  const int64_t heads = x.size(1), head_dim = x.size(2);
  const T* data = x.data_ptr<T>();
  int8_t* out = cache.data_ptr<int8_t>();
  float* out_scales = scales.data_ptr<float>();
  for (int64_t t = 0; t < x.size(0); ++t)
    for (int64_t h = 0; slots[t] >= 0 && h < heads; ++h) {
      const int64_t row = slots[t] * heads + h;
      out_scales[row] = quantize_row(data + t * x.stride(0) + h * head_dim, head_dim, out + row * head_dim);
    }
}

}  // namespace

// k_cache.view(-1, kv_heads, head_dim)[slot] = k[t] (and so for v) for every token t whose slot is not -1 (a
// padding row): torch_backend.store_kv's two index_put calls and its padding check, in one pass; into an int8
// cache, quantized as torch_backend.quantize does, with each scale at k_scale.view(-1, kv_heads)[slot] (v_scale
// for v). k, v: [tokens, kv_heads, head_dim] with each token's heads contiguous (views of the QKV projection's
// rows); caches contiguous [blocks, block_size, kv_heads, head_dim]; scales empty, or float32 [blocks,
// block_size, kv_heads] for an int8 cache; slot_mapping [tokens] int64.
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping, const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
              k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2) && slot_mapping.numel() == k.size(0),
              "store_kv: k, v [tokens, kv_heads, head_dim], caches [blocks, block_size, kv_heads, head_dim], a slot "
              "per token");
  const bool quantized = k_cache.scalar_type() == at::kChar;
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                t->scalar_type() == k.scalar_type() && (quantized || t->scalar_type() == k_cache.scalar_type()),
                "store_kv: each token's heads contiguous, of the cache's dtype (or any float dtype into int8)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slot_mapping.is_contiguous() &&
              v_cache.scalar_type() == k_cache.scalar_type() && slot_mapping.scalar_type() == at::kLong,
              "store_kv: contiguous caches of one dtype, int64 slots");
  const auto scale_shape = k_cache.sizes().slice(0, 3);
  TORCH_CHECK(quantized ? k_scale.sizes() == scale_shape && v_scale.sizes() == scale_shape &&
                              k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                              k_scale.is_contiguous() && v_scale.is_contiguous()
                        : k_scale.numel() == 0 && v_scale.numel() == 0,
              "store_kv: an int8 cache takes contiguous float32 scales [blocks, block_size, kv_heads], another none");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] < num_slots, "store_kv: slot ", slots[t], " is outside the cache");
  if (quantized) {
    const auto run = [&](auto element) {
      using T = decltype(element);
      store_quantized<T>(k, k_cache, k_scale, slots);
      store_quantized<T>(v, v_cache, v_scale, slots);
    };
    switch (k.scalar_type()) {
      case at::kFloat: return run(float());
      case at::kBFloat16: return run(at::BFloat16());
      case at::kHalf: return run(at::Half());
      default: TORCH_CHECK(false, "store_kv: float32, bfloat16 or float16 into int8, not ", k.scalar_type());
    }
  }
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const char *k_data = static_cast<const char*>(k.data_ptr()), *v_data = static_cast<const char*>(v.data_ptr());
  char *k_out = static_cast<char*>(k_cache.data_ptr()), *v_out = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < k.size(0); ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(k_out + slots[t] * row_bytes, k_data + t * k.stride(0) * k.element_size(), row_bytes);
    std::memcpy(v_out + slots[t] * row_bytes, v_data + t * v.stride(0) * v.element_size(), row_bytes);
  }
}

namespace {

// The first index of the row's largest value, or of its first NaN (torch's NaN is larger than everything):
// one pass for the max, then one to the first index that holds it. NaN is found by its bits: -ffast-math lets
// the compiler assume that a float compare never sees one.
int64_t argmax_row(const float* row, int64_t n) {
  const auto is_nan = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    return (bits & 0x7FFFFFFFu) > 0x7F800000u;
  };
  Vec16 most16 = broadcast16(row[0]);
  bool any_nan = false;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    most16 = max16(most16, load16(row + j));
    for (int i = 0; i < 16; ++i) any_nan |= is_nan(row[j + i]);
  }
  float most = reduce_max16(most16);
  for (; j < n; ++j) {
    most = std::max(most, row[j]);
    any_nan |= is_nan(row[j]);
  }
  j = 0;
  if (any_nan) {
    while (!is_nan(row[j])) ++j;
    return j;
  }
  for (; j + 16 <= n; j += 16) {  // to the first 16 that hold the max, 16 compares at a time
    bool hit = false;
    for (int i = 0; i < 16; ++i) hit |= row[j + i] == most;
    if (hit) break;
  }
  while (row[j] != most) ++j;
  return j;
}

}  // namespace

// out[i] = torch.argmax(x[i]) for float32 rows [rows, n]: torch's own takes many times its amax on the CPU.
void argmax(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
              x.size(1) > 0 && out.is_contiguous() && out.scalar_type() == at::kLong && out.numel() == x.size(0),
              "argmax: x contiguous float32 [rows, n > 0], out int64 [rows]");
  const int64_t n = x.size(1);
  const float* data = x.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) index[i] = argmax_row(data + i * n, n);
  });
}
