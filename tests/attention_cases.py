"""Random attention steps shared by the backend tests: every backend is compared with the torch oracle."""

import functools
import math
from typing import NamedTuple

import torch

from nanoengine.attention.metadata import AttentionMetadata

BLOCK_SIZE = 16
NUM_KV_HEADS = 2


class Step(NamedTuple):
    q: torch.Tensor        # [num_tokens, num_heads, head_dim], a strided view
    k: torch.Tensor        # [num_tokens, num_kv_heads, head_dim]: this step's new keys
    v: torch.Tensor
    k_cache: torch.Tensor  # random everywhere, so cached prefixes (and unowned blocks) hold data
    v_cache: torch.Tensor
    meta: AttentionMetadata
    k_scale: torch.Tensor  # an int8 cache's scales [num_blocks, block_size, num_kv_heads], random; else empty
    v_scale: torch.Tensor


def make_step(requests, group, head_dim, dtype, device, seed, block_size=BLOCK_SIZE, cache_dtype=None) -> Step:
    """A random step for requests given as (cached_len, query_len), in a cache of ``block_size``-token blocks
    of ``cache_dtype`` (``dtype`` by default; torch.int8 with random scales).

    Physical blocks are handed out in shuffled order, with spare blocks, so block tables are
    non-contiguous and the caches hold blocks nobody owns.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + query for cached, query in requests]
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(requests), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = torch.tensor([free_blocks.pop() for _ in range(count)])

    query_lens = [query for _, query in requests]
    query_start_loc = [0]
    for query_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + query_len)
    slots = []
    for i, (cached, query) in enumerate(requests):
        for pos in range(cached, cached + query):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)

    num_tokens, num_heads = query_start_loc[-1], NUM_KV_HEADS * group
    cache_shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    to = functools.partial(torch.Tensor.to, device=device, dtype=dtype)
    # q and the new k, v are slices of one fused projection, as in the model.
    qkv = to(torch.randn(num_tokens, num_heads + 2 * NUM_KV_HEADS, head_dim, generator=gen))
    q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    k_cache, v_cache = (to(torch.randn(cache_shape, generator=gen)) for _ in range(2))
    k_scale = v_scale = torch.empty(0, device=device)
    if cache_dtype == torch.int8:
        k_cache, v_cache = (torch.randint(-127, 128, cache_shape, generator=gen, dtype=torch.int8).to(device)
                            for _ in range(2))
        # Dequantized values up to about 3, as a model's K and V (absmax / 127 per token and head).
        k_scale, v_scale = ((torch.rand(cache_shape[:3], generator=gen) * 0.025).to(device) for _ in range(2))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return Step(q, k, v, k_cache, v_cache, meta, k_scale, v_scale)
