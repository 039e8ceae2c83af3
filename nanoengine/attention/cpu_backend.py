"""Paged attention tuned for the CPU: the contract of ``torch_backend``, faster.

Four things make it faster than the plain oracle, each measured (docs/performance.md):

- Decodes (one query row) are attended in padded batches of up to ``DECODE_BATCH`` requests of similar
  context length, planned once per step (every layer gets the same metadata object).
- A batch's K and V are gathered into buffers kept between calls: a fresh tensor this large
  (megabytes, per layer and step) comes from the OS and pays a page fault for every 4 KiB of it.
- A request with several query rows goes to SDPA's flash kernel (causal when it is a whole prompt).
- A bfloat16 or float16 cache is attended in float32: SDPA's CPU kernel runs one reduced-precision query row
  about 7x slower than a float32 one, so the gathered K and V are widened into head-major float32 buffers
  (still in the cache) first. Scores and sums are float32 either way.

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
    mask: torch.Tensor     # [batch, 1, 1, max_seq_len] float32: 0 on context, -inf on padding (a float mask:
                           # SDPA would convert a boolean one in every layer)


class CpuBackend:
    def __init__(self):
        self.planned: tuple[AttentionMetadata | None, list[DecodeBatch]] = (None, [])
        self.buffers: dict[tuple, torch.Tensor] = {}

    store_kv = staticmethod(store_kv)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of every query row ([num_tokens, num_heads, head_dim]) over its own context."""
        out = torch.empty_like(q)
        for batch in self.decode_batches(meta, k_cache.shape[1]):
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

    def decode_batches(self, meta: AttentionMetadata, block_size: int) -> list[DecodeBatch]:
        if self.planned[0] is not meta:
            self.planned = (meta, plan_decode_batches(meta, block_size))
        return self.planned[1]

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: DecodeBatch,
                         scale: float) -> torch.Tensor:
        """One query row per request ([batch, num_heads, head_dim]), each over its own context."""
        k = self.gather_slots(k_cache, batch.slots, "k").transpose(1, 2)  # [batch, kv_heads, max_seq_len, dim]
        v = self.gather_slots(v_cache, batch.slots, "v").transpose(1, 2)
        if k.dtype != torch.float32:
            k, v = self.widened(k, "k"), self.widened(v, "v")
        out = F.scaled_dot_product_attention(q.unsqueeze(2).float(), k, v, attn_mask=batch.mask,
                                             scale=scale, enable_gqa=True)
        return out.squeeze(2).to(q.dtype)

    def gather_slots(self, cache: torch.Tensor, slots: torch.Tensor, name: str) -> torch.Tensor:
        """The cache entries at ``slots`` ([batch, len] -> [batch, len, num_kv_heads, head_dim])."""
        entry_shape = cache.shape[2:]
        out = self.buffer(name, (slots.numel(), *entry_shape), cache.dtype, cache.device)
        torch.index_select(cache.flatten(0, 1), 0, slots.flatten(), out=out)
        return out.view(*slots.shape, *entry_shape)

    def widened(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A contiguous float32 copy of ``x``."""
        return self.buffer(name, x.shape, torch.float32, x.device).copy_(x)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This backend's buffer for ``name`` and ``dtype``, kept between calls, viewed as ``shape``."""
        numel, key = math.prod(shape), (name, dtype, device)
        if key not in self.buffers or self.buffers[key].numel() < numel:
            with torch.inference_mode(False):  # a normal tensor may be written in and out of inference mode
                self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return self.buffers[key][:numel].view(shape)


def plan_decode_batches(meta: AttentionMetadata, block_size: int) -> list[DecodeBatch]:
    starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decodes = sorted((i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1), key=seq_lens.__getitem__)
    return [decode_batch(meta, decodes[b:b + DECODE_BATCH], block_size)
            for b in range(0, len(decodes), DECODE_BATCH)]


def decode_batch(meta: AttentionMetadata, requests: list[int], block_size: int) -> DecodeBatch:
    device = meta.seq_lens.device
    positions = torch.arange(meta.seq_lens_cpu[requests[-1]], device=device)  # the longest is last
    visible = positions < meta.seq_lens[requests, None]
    # Padding re-reads the request's token 0: a slot never written may hold anything, even NaN,
    # which would survive the mask.
    positions = torch.where(visible, positions, 0)
    blocks = meta.block_tables[requests].gather(1, positions // block_size).long()
    rows = torch.tensor([meta.query_start_loc_cpu[i] for i in requests], device=device)
    mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
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
