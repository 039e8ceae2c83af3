// The decoder layers of one step in one call: op for op what models/llama.py's DecoderLayer.forward does on the
// CPU, through the same kernels in the same order (so the result is the same to the bit), without going back
// to Python between the ops. Between them Python spends a few microseconds an op: about 3 ms of a 30 ms decode
// step of 32 requests (SmolLM2's 30 layers on a 2-core Zen 5), where this loop spends a tenth of that. Every
// linear layer takes cpu_linear.cpp's kernel; models/llama.py's LayersInOneCall says when that holds.
#include <torch/extension.h>

#include <vector>

#include "cpu_kernels.h"

namespace {

// Each layer's entries in ``weights``, in this order; an absent bias or norm is None.
enum Weight { kInputNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kOBias, kPostNorm, kGateUp, kDown, kPerLayer };

// x W^T (+ b) with W packed for cpu_linear.cpp: [N/16, K/step, 16, step].
at::Tensor linear_of(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({x.size(0), 16 * packed.size(0)}, x.options());
  linear(x, packed, bias, out);
  return out;
}

at::Tensor normalized(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm(x, weight, eps, out);
  return out;
}

}  // namespace

// hidden: the embeddings [tokens, hidden_size]; weights: kPerLayer a layer; caches: each layer's K and V cache;
// cos, sin: the rotation of every token; decodes: decode_attention's (block_tables, seq_lens, rows) and
// prompts: prefill_attention's (block_tables, first_rows, query_lens, seq_lens), each empty where the step has
// none. Returns the last layer's output and the residual stream, as the Python layers do.
std::vector<at::Tensor> decoder_layers(const at::Tensor& hidden, const std::vector<c10::optional<at::Tensor>>& weights,
                                       const std::vector<at::Tensor>& caches, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& slot_mapping,
                                       const std::vector<at::Tensor>& decodes, const std::vector<at::Tensor>& prompts,
                                       int64_t num_heads, int64_t num_kv_heads, double scale, double eps) {
  const int64_t num_layers = int64_t(caches.size()) / 2, tokens = hidden.size(0);
  TORCH_CHECK(caches.size() % 2 == 0 && int64_t(weights.size()) == kPerLayer * num_layers,
              "decoder_layers: ", int(kPerLayer), " weights and two caches a layer");
  TORCH_CHECK((decodes.empty() || decodes.size() == 3) && (prompts.empty() || prompts.size() == 4),
              "decoder_layers: decode_attention's three plan tensors and prefill_attention's four, or none");
  const int64_t head_dim = caches[0].size(-1), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = hidden, residual;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const c10::optional<at::Tensor>* w = weights.data() + layer * kPerLayer;
    const at::Tensor &k_cache = caches[2 * layer], &v_cache = caches[2 * layer + 1];
    if (layer == 0) {
      residual = x;
      x = normalized(x, *w[kInputNorm], eps);
    } else {
      at::Tensor normed = at::empty_like(x);
      add_rms_norm(x, residual, *w[kInputNorm], eps, normed);
      x = normed;
    }
    const at::Tensor qkv = linear_of(x, *w[kQkv], w[kQkvBias]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    if (w[kQNorm]) {
      q = normalized(q, *w[kQNorm], eps);
      k = normalized(k, *w[kKNorm], eps);
    }
    rotary(q, cos, sin);
    rotary(k, cos, sin);
    store_kv(k, v, k_cache, v_cache, slot_mapping);
    const at::Tensor attended = at::empty(q.sizes(), q.options());
    if (!decodes.empty())
      decode_attention(q, k_cache, v_cache, decodes[0], decodes[1], decodes[2], scale, attended);
    if (!prompts.empty())
      prefill_attention(q, k_cache, v_cache, prompts[0], prompts[1], prompts[2], prompts[3], scale, attended);
    const at::Tensor o = linear_of(attended.view({tokens, q_size}), *w[kO], w[kOBias]);
    at::Tensor normed = at::empty_like(o);
    add_rms_norm(o, residual, *w[kPostNorm], eps, normed);
    const at::Tensor gate_up = linear_of(normed, *w[kGateUp], c10::nullopt);
    const at::Tensor activated = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(gate_up, activated);
    x = linear_of(activated, *w[kDown], c10::nullopt);
  }
  return {x, residual};
}
