"""Paged attention in plain torch: the oracle. Short and obviously correct, not fast.

Every other backend (``triton_backend``, and the CPU platform's ``CpuBackend`` in platforms/cpu/attention.py) is
tested against it.

Cache layout, per layer: ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``t`` of a request
lives in block ``block_table[t // block_size]`` at offset ``t % block_size``,
so its flat slot is ``block * block_size + offset``.

An int8 cache (``kv_cache_dtype="int8"``) holds each token's head vector x as q = round(x / s) with
s = absmax(x) / 127, and s in ``k_scale`` / ``v_scale`` ([num_blocks, block_size, num_kv_heads], float32); x
is read back as q * s. The scales are empty tensors for a cache in the model's dtype.
"""

import torch

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.quantization import quantize


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Write each new token's K and V ([num_tokens, num_kv_heads, head_dim]) at its slot (quantized, with their
    scales, in an int8 cache); slot -1 (a padding row) stores nothing."""
    real = slot_mapping >= 0
    if not real.all():
        slot_mapping, k, v = slot_mapping[real], k[real], v[real]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if cache.dtype == torch.int8:
            x, token_scales = quantize(x)
            scales.view(-1, scales.shape[-1])[slot_mapping] = token_scales
        cache.view(-1, *cache.shape[2:])[slot_mapping] = x


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                   scales: torch.Tensor) -> torch.Tensor:
    """The first ``seq_len`` tokens of one request, [seq_len, num_kv_heads, head_dim]: in float32 for an int8
    cache, dequantized by its ``scales``."""
    block_size = cache.shape[1]
    blocks = block_table[:(seq_len + block_size - 1) // block_size].long()
    context = cache[blocks].flatten(0, 1)[:seq_len]
    if cache.dtype != torch.int8:
        return context
    return context.float() * scales[blocks].flatten(0, 1)[:seq_len, :, None]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """Causal attention of every query row ([num_tokens, num_heads, head_dim]) over its own context."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        rows = slice(starts[i], starts[i + 1])
        k = gather_context(k_cache, meta.block_tables[i], seq_len, k_scale)
        v = gather_context(v_cache, meta.block_tables[i], seq_len, v_scale)
        out[rows] = attend(q[rows], k, v, scale)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ([query_len, num_heads, head_dim]) holds the last query_len positions of a context whose keys and
    values are ``k``, ``v`` ([seq_len, num_kv_heads, head_dim]); each query row sees the keys up to its own
    position. Computed in float32."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads  # GQA: KV head h serves query heads h * group .. (h + 1) * group - 1
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    query_pos = seq_len - query_len + torch.arange(query_len, device=q.device)
    visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
