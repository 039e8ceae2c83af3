"""The attention layer: write this step's K/V into the paged cache, then attend through it."""

import torch
from torch import nn

from nanoengine.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Set by the model runner once the cache is allocated: a module or object with store_kv, paged_attention.
        self.backend = None
        # An int8 cache's float32 scales, one per token per KV head ([blocks, block_size, kv_heads]); empty when
        # the cache holds the model's dtype. Every backend takes them with the caches.
        self.k_cache = self.v_cache = self.k_scale = self.v_scale = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim]."""
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self.backend.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.k_scale,
                                            self.v_scale)
