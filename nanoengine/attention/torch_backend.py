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
    """Causal attention of every query row ([num_tokens, num_heads, head_dim]) over its own context.

    Decodes (one query row) go through one padded batched call; a request with several query rows
    (a prompt or a prompt's chunk) is attended on its own.
    """
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    query_lens = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=q.device)
        out[rows] = decode_attention(q[rows], k_cache, v_cache, meta.block_tables[decodes],
                                     meta.seq_lens[decodes], max(meta.seq_lens_cpu[i] for i in decodes), scale)
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        if query_lens[i] > 1:
            rows = slice(starts[i], starts[i + 1])
            k = gather_context(k_cache, meta.block_tables[i], seq_len)
            v = gather_context(v_cache, meta.block_tables[i], seq_len)
            out[rows] = _attend(q[rows], k, v, seq_len - query_lens[i], scale)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
    """One query row per request ([num_seqs, num_heads, head_dim]), each over its own context: the
    contexts are gathered into one [num_seqs, max_seq_len] batch and a mask hides the padding."""
    block_size = k_cache.shape[1]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    blocks = block_tables[:, :num_blocks].clamp(min=0).long()  # -1 (unused) reads block 0, which the mask hides
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2)  # [num_seqs, num_kv_heads, padded_len, head_dim]
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    visible = torch.arange(k.shape[2], device=q.device) < seq_lens[:, None]
    # Padding reads slots never written (the CPU cache comes from empty()): a NaN there would survive the mask.
    k, v = (torch.where(visible[:, None, :, None], x, 0) for x in (k, v))
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=visible[:, None, None, :], scale=scale,
                                         enable_gqa=True)
    return out.squeeze(2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """Query rows at positions first_pos.. over keys 0..; each KV head serves its group of query heads."""
    # [1, heads, tokens, head_dim]: with a batch dimension the CPU takes its flash kernel, not the math path.
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if first_pos == 0:  # a whole prompt: the plain causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = first_pos + torch.arange(q.shape[2], device=q.device)
        visible = torch.arange(k.shape[2], device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
