"""Paged attention in plain torch: the readable statement of the math.

It runs anywhere and is the oracle that the Triton kernels are tested against.

Cache layout, per layer: ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``t`` of a request
lives in block ``block_table[t // block_size]`` at offset ``t % block_size``,
so its flat slot is ``block * block_size + offset``.
"""

import torch
import torch.nn.functional as F

from nanoengine.attention.metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K and V ([num_tokens, num_kv_heads, head_dim]) at its slot."""
    real = slot_mapping >= 0
    slots = slot_mapping[real]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[real]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[real]


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request, [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of every query row ([num_tokens, num_heads, head_dim]) over its own context."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        rows = slice(starts[i], starts[i + 1])
        query_len = starts[i + 1] - starts[i]
        k = gather_context(k_cache, meta.block_tables[i], seq_len)
        v = gather_context(v_cache, meta.block_tables[i], seq_len)
        out[rows] = _attend(q[rows], k, v, seq_len - query_len, scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """Query rows at positions first_pos.. over keys 0..; GQA repeats each KV head for its group."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    query_pos = first_pos + torch.arange(q.shape[0], device=q.device)
    key_pos = torch.arange(k.shape[0], device=q.device)
    visible = key_pos[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, scale=scale)
    return out.transpose(0, 1)
