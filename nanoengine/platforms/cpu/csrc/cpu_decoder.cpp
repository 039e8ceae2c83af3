// The decoder layers of one step in one call: op for op what models/llama.py's DecoderLayer.forward does on the
// CPU, through the same kernels in the same order (so the result is the same to the bit), without going back
// to Python between the ops, where Python spends a few microseconds an op (docs/cpu.md). Every linear layer
// takes cpu_linear.cpp's kernel; platforms/cpu/one_call.py's LayersInOneCall says when that holds.
#include <torch/extension.h>

#include <vector>

#include "cpu_kernels.h"

namespace {

// Each layer's entries in ``weights``, in this order; an absent bias or norm is None, and so is the scale of a
// weight that is neither int8 nor 4-bit, and the minimum of a weight that is not 4-bit or is symmetric (-8 scale).
enum Weight {
  kInputNorm, kQkv, kQkvScale, kQkvMin, kQkvBias, kQNorm, kKNorm, kO, kOScale, kOMin, kOBias, kPostNorm, kGateUp,
  kGateUpScale, kGateUpMin, kDown, kDownScale, kDownMin, kPerLayer
};

// x W^T (+ b) with W packed for cpu_linear.cpp ([N/16, K/step, 16, step]) and, where W is int8 or 4-bit, its
// scale (and minimum), the weight's entry ``w[weight]`` followed by them.
at::Tensor linear_of(const at::Tensor& x, const c10::optional<at::Tensor>* w, Weight weight,
                     const c10::optional<at::Tensor>& bias) {
  const at::Tensor& packed = *w[weight];
  at::Tensor out = at::empty({x.size(0), 16 * packed.size(0)}, x.options());
  linear(x, packed, w[weight + 1], w[weight + 2], bias, out);
  return out;
}

at::Tensor normalized(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm(x, weight, eps, out);
  return out;
}

struct Step {  // what every layer's attention shares
  const at::Tensor &cos, &sin, &slot_mapping;
  const std::vector<at::Tensor>&decodes, &prompts;
  int64_t num_heads, num_kv_heads;
  double scale, eps;
};

// DecoderAttention.forward: the o projection of the attention of x's q over the cache, after x's k and v are
// stored. Its temporaries are freed on return, as the Python layer's are before the MLP.
// ``cache``: the layer's K cache, V cache, K scales and V scales (empty unless the cache is int8).
at::Tensor attention(const at::Tensor& x, const c10::optional<at::Tensor>* w, const at::Tensor* cache,
                     const Step& step) {
  const int64_t tokens = x.size(0), head_dim = cache[0].size(-1);
  const int64_t q_size = step.num_heads * head_dim, kv_size = step.num_kv_heads * head_dim;
  const at::Tensor qkv = linear_of(x, w, kQkv, w[kQkvBias]);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, step.num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, step.num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, step.num_kv_heads, head_dim});
  if (w[kQNorm]) {
    q = normalized(q, *w[kQNorm], step.eps);
    k = normalized(k, *w[kKNorm], step.eps);
  }
  rotary(q, step.cos, step.sin);
  rotary(k, step.cos, step.sin);
  store_kv(k, v, cache[0], cache[1], step.slot_mapping, cache[2], cache[3]);
  const at::Tensor attended = at::empty(q.sizes(), q.options());
  const std::vector<at::Tensor>&d = step.decodes, &p = step.prompts;
  if (!d.empty()) decode_attention(q, cache[0], cache[1], cache[2], cache[3], d[0], d[1], d[2], step.scale, attended);
  if (!p.empty())
    prefill_attention(q, cache[0], cache[1], cache[2], cache[3], p[0], p[1], p[2], p[3], step.scale, attended);
  return linear_of(attended.view({tokens, q_size}), w, kO, w[kOBias]);
}

// DecoderMLP.forward.
at::Tensor mlp(const at::Tensor& x, const c10::optional<at::Tensor>* w) {
  const at::Tensor gate_up = linear_of(x, w, kGateUp, c10::nullopt);
  const at::Tensor activated = at::empty({x.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul(gate_up, activated);
  return linear_of(activated, w, kDown, c10::nullopt);
}

void check_weights(const std::vector<c10::optional<at::Tensor>>& weights, size_t num_layers) {
  TORCH_CHECK(num_layers > 0 && weights.size() == kPerLayer * num_layers,
              "decoder_layers: at least one layer, ", int(kPerLayer), " weights and four caches a layer");
  for (size_t layer = 0; layer < num_layers; ++layer) {
    const c10::optional<at::Tensor>* w = weights.data() + layer * kPerLayer;
    for (const Weight needed : {kInputNorm, kQkv, kO, kPostNorm, kGateUp, kDown})
      TORCH_CHECK(w[needed].has_value(), "decoder_layers: layer ", layer, " lacks weight ", int(needed));
    TORCH_CHECK(w[kQNorm].has_value() == w[kKNorm].has_value(), "decoder_layers: a q norm goes with a k norm");
  }
}

}  // namespace

// hidden: the embeddings [tokens, hidden_size], which become the residual stream (updated in place, as the
// Python layers update it); weights: kPerLayer a layer; caches: each layer's K and V cache and their scales
// (empty unless the cache is int8); cos, sin: the rotation
// of every token; decodes: decode_attention's (block_tables, seq_lens, rows) and prompts: prefill_attention's
// (block_tables, first_rows, query_lens, seq_lens), either empty where the step has none. Returns the last
// layer's output and the residual stream.
std::vector<at::Tensor> decoder_layers(const at::Tensor& hidden, const std::vector<c10::optional<at::Tensor>>& weights,
                                       const std::vector<at::Tensor>& caches, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& slot_mapping,
                                       const std::vector<at::Tensor>& decodes, const std::vector<at::Tensor>& prompts,
                                       int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2 && caches.size() % 4 == 0,
              "decoder_layers: CPU hidden [tokens, hidden_size], four caches a layer");
  check_weights(weights, caches.size() / 4);
  TORCH_CHECK((decodes.size() == 3 || prompts.size() == 4) && (decodes.empty() || decodes.size() == 3) &&
                  (prompts.empty() || prompts.size() == 4),
              "decoder_layers: decode_attention's three plan tensors, prefill_attention's four, or both");
  const Step step{cos, sin, slot_mapping, decodes, prompts, num_heads, num_kv_heads, scale, eps};
  at::Tensor x = hidden, residual = hidden;
  for (size_t layer = 0; layer < caches.size() / 4; ++layer) {
    const c10::optional<at::Tensor>* w = weights.data() + layer * kPerLayer;
    at::Tensor normed = at::empty_like(x);
    if (layer == 0)
      rms_norm(x, *w[kInputNorm], eps, normed);
    else
      add_rms_norm(x, residual, *w[kInputNorm], eps, normed);
    const at::Tensor o = attention(normed, w, caches.data() + 4 * layer, step);
    normed = at::empty_like(o);
    add_rms_norm(o, residual, *w[kPostNorm], eps, normed);
    x = mlp(normed, w);
  }
  return {x, residual};
}
