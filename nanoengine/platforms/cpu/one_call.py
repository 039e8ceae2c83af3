"""The decoder layers as one C++ call (csrc/cpu_decoder.cpp): the CPU's counterpart of CUDA graphs.

For a step whose linear layers all take cpu_linear.cpp's kernel at its row count, the model's forward runs as the
embedding and rotary lookups, one C++ call through every decoder layer, and the final norm: DecoderLayer.forward's
kernels in the same order, so the same bits, without Python between the ops. The runner asks ``can_run(meta)``
and calls ``run(input_ids, positions, meta)``, as it does with engine/cuda_graphs.py's DecodeGraphs. It has no
all-reduce: one rank only, and only the Llama family's DecoderLayer (models/llama.py).
"""

from types import ModuleType

import torch
from torch import nn

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.layers.attention import Attention
from nanoengine.models.llama import DecoderLayer
from nanoengine.platforms.cpu.linear import ROW_BUCKETS, bucket_of, kernel_at


class LayersInOneCall:
    def __init__(self, model: nn.Module, cpu_ops: ModuleType):
        """``model``'s weights and KV caches as they are now: a new cache or kernel choice needs a new one."""
        self.decoder, self.cpu_ops = model.model, cpu_ops
        layers = self.decoder.layers
        self.attention = layers[0].self_attn
        self.eps = layers[0].input_layernorm.eps
        self.weights = [weight for layer in layers for weight in layer_weights(layer)]
        self.caches = [cache for layer in layers for cache in layer_caches(layer.self_attn.attn)]
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.runs_at = [all(kernel_at(m.kernel_choice, bucket) == "tiled" for m in linears)
                        for bucket in range(len(ROW_BUCKETS))]

    @classmethod
    def for_model(cls, model: nn.Module, cpu_ops: ModuleType) -> "LayersInOneCall | None":
        """The layers in one call, or None where no step could take it (another layer type, a kernel choice
        without cpu_linear.cpp's kernel at any row count)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers or not all(type(layer) is DecoderLayer for layer in layers):
            return None
        one_call = cls(model, cpu_ops)
        return one_call if any(one_call.runs_at) else None

    def can_run(self, meta: AttentionMetadata) -> bool:
        return self.runs_at[bucket_of(meta.query_start_loc_cpu[-1])]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's hidden states, as its forward leaves them."""
        decoder, attention = self.decoder, self.attention
        hidden = decoder.embed_tokens(input_ids)
        rotation = decoder.rotary_emb(positions, hidden.dtype)
        backend = attention.attn.backend
        decodes, prompts = backend.decode_plan(meta), backend.prefill_plan(meta)
        hidden, residual = self.cpu_ops.decoder_layers(
            hidden, self.weights, self.caches, rotation.cos, rotation.sin, meta.slot_mapping,
            () if decodes is None else decodes.kernel_args(), () if prompts is None else prompts.kernel_args(),
            attention.num_heads, attention.num_kv_heads, attention.attn.scale, self.eps)
        return decoder.norm(hidden, residual)[0]


def layer_caches(attn: Attention) -> list[torch.Tensor]:
    """A layer's K and V caches and their scales (empty unless the cache is int8), in cpu_decoder.cpp's order."""
    return [attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale]


def layer_weights(layer: DecoderLayer) -> list[torch.Tensor | None]:
    """A layer's weights in cpu_decoder.cpp's order (the linear layers' packed for cpu_linear.cpp, each followed by
    its scale and minimum: the scale where it is int8 or 4-bit, the minimum where it is 4-bit with minimums)."""
    attention, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = (None if norm is None else norm.weight for norm in (attention.q_norm, attention.k_norm))
    qkv, o, gate_up, down = ([getattr(m.kernel_choice, name, None) for name in ("steps", "steps_scale", "steps_min")]
                             for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj))
    return [layer.input_layernorm.weight, *qkv, attention.qkv_proj.bias, q_norm, k_norm, *o, attention.o_proj.bias,
            layer.post_attention_layernorm.weight, *gate_up, *down]
