// Every CPU kernel the extension holds, for the files that call one another's (the module's bindings in
// cpu_module.cpp, the decoder layers' loop in cpu_decoder.cpp).
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

// Attention, in cpu_decode.cpp and cpu_prefill.cpp.
// Caches in q's dtype take empty scales; an int8 cache its float32 scales [blocks, block_size, kv_heads].
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& rows, double scale, const at::Tensor& out);
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                       const at::Tensor& first_rows, const at::Tensor& query_lens, const at::Tensor& seq_lens,
                       double scale, const at::Tensor& out);
// The small per-layer ops, in cpu_ops.cpp.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out);
void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                  const at::Tensor& out);
void silu_and_mul(const at::Tensor& gate_up, const at::Tensor& out);
void rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping, const at::Tensor& k_scale, const at::Tensor& v_scale);
void argmax(const at::Tensor& x, const at::Tensor& out);
// The linear layers' kernel, in cpu_linear.cpp.
std::vector<std::string> linear_dtypes();
void linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
            const c10::optional<at::Tensor>& minimum, const c10::optional<at::Tensor>& bias, const at::Tensor& out);
// The decoder layers in one call, in cpu_decoder.cpp.
std::vector<at::Tensor> decoder_layers(const at::Tensor& hidden, const std::vector<c10::optional<at::Tensor>>& weights,
                                       const std::vector<at::Tensor>& caches, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& slot_mapping,
                                       const std::vector<at::Tensor>& decodes, const std::vector<at::Tensor>& prompts,
                                       int64_t num_heads, int64_t num_kv_heads, double scale, double eps);
