"""Paged attention tuned for the CPU: the contract of ``torch_backend``, faster.

Three things make it faster than the plain oracle, each measured (docs/performance.md):

- Decodes (one query row) are attended in padded batches of up to ``DECODE_BATCH`` requests of similar
  context length, planned once per step (every layer gets the same metadata object).
- A batch's K and V are gathered into buffers kept between calls: a fresh tensor this large
  (megabytes, per layer and step) comes from the OS and pays a page fault for every 4 KiB of it.
- A request with several query rows goes to SDPA's flash kernel (causal when it is a whole prompt).

The plan and the buffers live in a ``CpuBackend`` object, one per model runner: two engines in one
process share nothing. Tested against the oracle in tests/test_cpu_attention.py.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.attention.torch_backend import gather_context, store_kv

# Decodes per batched call: sorted by length, small batches pad little, and on the CPU a batch's
# gathered K/V (megabytes) is still in the cache when attention reads it back: twice as fast as one batch.
DECODE_BATCH = 8


@dataclass
class DecodeBatch:
    rows: torch.Tensor     # [batch]: the requests' query rows
    slots: torch.Tensor    # [batch, max_seq_len] int64: the cache slot of each context position
    mask: torch.Tensor     # [batch, 1, 1, max_seq_len]: 0 on context, -inf on padding (a float mask: SDPA
                           # would convert a boolean one in every layer)


class CpuBackend:
    def __init__(self):
        self.planned: tuple[AttentionMetadata | None, list[DecodeBatch]] = (None, [])
        self.gather_buffers: dict[tuple, torch.Tensor] = {}

    store_kv = staticmethod(store_kv)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of every query row ([num_tokens, num_heads, head_dim]) over its own context."""
        out = torch.empty_like(q)
        for batch in self.decode_batches(meta, k_cache.shape[1], q.dtype):
            out[batch.rows] = self.decode_attention(q[batch.rows], k_cache, v_cache, batch, scale)
        starts = meta.query_start_loc_cpu
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            query_len = starts[i + 1] - starts[i]
            if query_len > 1:
                rows = slice(starts[i], starts[i + 1])
                k = gather_context(k_cache, meta.block_tables[i], seq_len)
                v = gather_context(v_cache, meta.block_tables[i], seq_len)
                out[rows] = flash_attend(q[rows], k, v, seq_len - query_len, scale)
        return out

    def decode_batches(self, meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> list[DecodeBatch]:
        if self.planned[0] is not meta:
            self.planned = (meta, plan_decode_batches(meta, block_size, dtype))
        return self.planned[1]

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                         scale: float) -> torch.Tensor:
        """One query row per request ([batch, num_heads, head_dim]), each over its own context."""
        k = self.gather_slots(k_cache, batch.slots, "k").transpose(1, 2)  # [batch, kv_heads, max_seq_len, dim]
        v = self.gather_slots(v_cache, batch.slots, "v").transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=batch.mask,
                                             scale=scale, enable_gqa=True)
        return out.squeeze(2)

    def gather_slots(self, cache: torch.Tensor, slots: torch.Tensor, name: str) -> torch.Tensor:
        """The cache entries at ``slots`` ([batch, len] -> [batch, len, num_kv_heads, head_dim]), written into
        this backend's buffer for ``name``."""
        entry_shape = cache.shape[2:]
        numel = slots.numel() * math.prod(entry_shape)
        key = (name, cache.device, cache.dtype)
        if key not in self.gather_buffers or self.gather_buffers[key].numel() < numel:
            with torch.inference_mode(False):  # a normal tensor may be written in and out of inference mode
                self.gather_buffers[key] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        out = self.gather_buffers[key][:numel].view(-1, *entry_shape)
        torch.index_select(cache.flatten(0, 1), 0, slots.flatten(), out=out)
        return out.view(*slots.shape, *entry_shape)


def plan_decode_batches(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> list[DecodeBatch]:
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decodes = sorted((i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1), key=seq_lens.__getitem__)
    return [decode_batch(meta, decodes[b:b + DECODE_BATCH], block_size, dtype)
            for b in range(0, len(decodes), DECODE_BATCH)]


def decode_batch(meta: AttentionMetadata, requests: list[int], block_size: int, dtype: torch.dtype) -> DecodeBatch:
    device = meta.seq_lens.device
    positions = torch.arange(meta.seq_lens_cpu[requests[-1]], device=device)  # the longest is last
    visible = positions < meta.seq_lens[requests, None]
    # Padding re-reads the request's token 0: a slot never written may hold anything, even NaN,
    # which would survive the mask.
    positions = torch.where(visible, positions, 0)
    blocks = meta.block_tables[requests].gather(1, positions // block_size).long()
    rows = torch.tensor([meta.query_start_loc_cpu[i] for i in requests], device=device)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return DecodeBatch(rows, blocks * block_size + positions % block_size, mask[:, None, None, :])


def flash_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
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
