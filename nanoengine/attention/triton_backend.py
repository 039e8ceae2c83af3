"""Paged attention in Triton: the same contract as ``torch_backend``, one kernel path for every batch.

The attention kernel runs one program per (query tile of one request, KV head, KV split). A query
tile holds ``BLOCK_Q`` consecutive query tokens of one request times *all* query heads of the KV
head's GQA group, flattened into ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, so every K/V tile is loaded
once per KV head and feeds a real matrix multiply. The program walks the request's block table
``TILE_N`` keys at a time (``TILE_N // BLOCK_SIZE`` blocks per step), applies the causal rule and
folds each tile into an online softmax. Decodes, prefill chunks on a cached prefix and fresh prompts
differ only in their query length.

Split-KV (flash-decoding): when a decode batch has too few (request, KV head) programs to fill the
device, the key range is split across programs; each writes a partial (max, sum, accumulator) and a
small second kernel merges them.

An int8 cache (``kv_cache_dtype="int8"``, the layout of torch_backend's docstring): the store kernel quantizes
each token's head vector as quantization.py's quantize does, and the attention kernel dequantizes each K
and V tile (int8 widened, times its tokens' scales) into q's dtype before its dot products.

Grid planning reads only host values (shapes and the metadata's host lists), never device tensors.
"""

import functools

import torch
import triton
import triton.language as tl

from nanoengine.attention.metadata import AttentionMetadata

LOG2_E = 1.4426950408889634
DECODE_ROWS = 16            # smallest tl.dot M dimension; enough rows for one decode token's group
PREFILL_ROWS = 64
DECODE_TILE_N = 32
PREFILL_TILE_N = 64
MAX_SPLIT_QUERY_LEN = 1     # auto split-KV only for decode-only batches
MIN_KEYS_PER_SPLIT = 256    # below this a split costs more to merge than it saves
MAX_KV_SPLITS = 64
CPU_TARGET_PROGRAMS = 64    # no SM count to ask for off-GPU (the interpreter); results don't depend on it
ROUNDING_SHIFT = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + this - this rounds |x| < 2**22 to an integer, half to even


@triton.jit
def _quantized(x):
    """x (one head vector) as quantization.py's quantize makes it: int8 round(x / s), s = absmax / 127."""
    x = x.to(tl.float32)
    scale = tl.max(tl.abs(x), axis=0) / 127.0
    quotient = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0) + tl.zeros_like(x))  # IEEE division, as torch's
    rounded = (quotient + ROUNDING_SHIFT) - ROUNDING_SHIFT
    return tl.minimum(tl.maximum(rounded, -127.0), 127.0).to(tl.int8), scale


@triton.jit
def _store_row(x, cache_ptr, offsets, scale_ptr, scale_offset, QUANTIZED: tl.constexpr):
    if QUANTIZED:
        x, scale = _quantized(x)
        tl.store(scale_ptr + scale_offset, scale)
    tl.store(cache_ptr + offsets, x.to(cache_ptr.dtype.element_ty))


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cache_slot, stride_cache_head,
                     HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return  # a padding token: nothing to store
    dims = tl.arange(0, HEAD_DIM)
    cache_offsets = slot * stride_cache_slot + head * stride_cache_head + dims
    scale_offset = slot * tl.num_programs(1) + head  # scales: [slots, num_kv_heads]
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims)
    _store_row(k, k_cache_ptr, cache_offsets, k_scale_ptr, scale_offset, QUANTIZED)
    _store_row(v, v_cache_ptr, cache_offsets, v_scale_ptr, scale_offset, QUANTIZED)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Write each new token's K and V ([num_tokens, num_kv_heads, head_dim]) at its slot (quantized, with their
    scales, in an int8 cache)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    quantized = _check_cache(k_cache, v_cache, k_scale, v_scale)
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, QUANTIZED=quantized)


@triton.jit
def _find_request(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Binary search for the request that owns query tile ``tile``.

    Request ``i`` owns the tiles starting at ``query_start_loc[i] // BLOCK_Q + i``: that is at least
    as many as its ``ceil(query_len / BLOCK_Q)`` tiles need, so tiles are numbered without a host
    pass. Returns (request, tile index within the request).
    """
    lo: tl.int32 = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(mid_first_tile <= tile, mid, lo)
        hi = tl.where(mid_first_tile <= tile, hi, mid - 1)
    first_tile = tl.load(query_start_loc_ptr + lo) // BLOCK_Q + lo
    return lo, tile - first_tile


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
        part_max_ptr, part_sum_ptr, part_acc_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
        num_seqs, num_tokens, num_heads, scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cache_block, stride_cache_slot, stride_cache_head, stride_block_table,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLIT_KV: tl.constexpr, QUANTIZED: tl.constexpr):
    """One program: one query tile of one request, one KV head, one split of the keys.

    A worked example: three requests with query lengths 1, 5 and 17 (a decode, a short prompt, a
    chunk), so ``query_start_loc = [0, 1, 6, 23]``, with 8 query heads over 2 KV heads (``GROUP = 4``),
    ``BLOCK_Q = 16`` and ``BLOCK_M = 64``. Request i's tiles start at ``query_start_loc[i] // 16 + i``:
    0, 1 and 2. The host launches ``23 // 16 + 3 = 4`` tiles per KV head:

        program_id(0) | request | tile | query tokens (batch rows) | rows in use
        0             | 0       | 0    | 0       (row 0)           | 1 token  x 4 heads = 4 of 64
        1             | 1       | 0    | 0..4    (rows 1..5)       | 5 tokens x 4 heads = 20 of 64
        2             | 2       | 0    | 0..15   (rows 6..21)      | 64 of 64
        3             | 2       | 1    | 16      (row 22)          | 4 of 64

    Program 3 finds its request by binary search: the last request whose first tile is <= 3. The
    numbering may leave a request spare tile numbers (a request of 16 tokens gets tile numbers for 2
    tiles); a program that lands on one returns at once.

    Inside a tile, row r holds query token ``r // GROUP_PAD`` and head ``r % GROUP_PAD`` of the KV
    head's group. For program (2, kv_head=1): rows 0..3 are token 0 with query heads 4, 5, 6, 7; rows
    4..7 are token 1 with heads 4..7; and so on. So one K/V tile loaded for KV head 1 meets all four
    heads that share it in one ``tl.dot``. With a group of 3 (SmolLM2: 9 heads, 3 KV heads),
    ``GROUP_PAD`` is 4 and every fourth row is padding, masked by ``row_valid``.

    The softmax is folded in tile by tile (tests/test_online_softmax.py states it in NumPy).
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    seq, q_tile = _find_request(query_start_loc_ptr, num_seqs, tl.program_id(0), BLOCK_Q)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_tile * BLOCK_Q >= query_len:
        return  # a spare tile of this request's numbering range
    seq_len = tl.load(seq_lens_ptr + seq)
    cached_len = seq_len - query_len  # context before this step's first query token

    # Row r of the tile is query token r // GROUP_PAD, query head r % GROUP_PAD of this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    q_index = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (q_index < query_len) & (rows % GROUP_PAD < GROUP)
    token = query_start + q_index
    q_pos = cached_len + q_index
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None], other=0.0)

    # Keys this program reads: its split of the context, cut at the tile's last causal position.
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE_N) * TILE_N
    kv_start = split * keys_per_split
    last_row_pos = cached_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, query_len) - 1
    kv_end = tl.minimum(tl.minimum(kv_start + keys_per_split, seq_len), last_row_pos + 1)

    # Online softmax state, in the log2 domain (scores are pre-multiplied by log2(e)).
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table = block_tables_ptr + seq * stride_block_table
    for tile_start in range(kv_start, kv_end, TILE_N):
        key_pos = tile_start + tl.arange(0, TILE_N)
        key_valid = key_pos < kv_end
        # Block-table walk: logical block key_pos // BLOCK_SIZE -> physical block, then the slot in it.
        block = tl.load(block_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_offsets = (block * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot
                      + kv_head * stride_cache_head)
        kv_ptrs = kv_offsets[:, None] + dims[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=key_valid[:, None], other=0.0)
        if QUANTIZED:  # scales: [blocks, BLOCK_SIZE, num_kv_heads]
            scale_offsets = (block * BLOCK_SIZE + key_pos % BLOCK_SIZE) * tl.num_programs(1) + kv_head
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=key_valid, other=0.0)
            k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)

        # ieee: exact fp32 products when the cache is fp32; bf16/fp16 inputs are unaffected.
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        causal = key_pos[None, :] <= q_pos[:, None]
        scores = tl.where(causal & key_valid[None, :], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row that has seen no visible key yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
        running_max = new_max

    if SPLIT_KV:
        # Partials are [num_splits, num_tokens, num_heads(, HEAD_DIM)]; an empty split writes (-inf, 0, 0).
        part_row = (split * num_tokens + token.to(tl.int64)) * num_heads + head
        tl.store(part_max_ptr + part_row, running_max, mask=row_valid)
        tl.store(part_sum_ptr + part_row, running_sum, mask=row_valid)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
    else:
        out = acc / running_sum[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
                         num_tokens, num_heads, num_splits, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    part_row = (splits.to(tl.int64) * num_tokens + token) * num_heads + head
    part_max = tl.load(part_max_ptr + part_row, mask=split_valid, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part_row, mask=split_valid, other=0.0)
    part_acc = tl.load(part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
                       mask=split_valid[:, None], other=0.0)
    # Split 0 always holds key 0, which every query sees, so the global max is finite.
    weight = tl.exp2(part_max - tl.max(part_max, axis=0))
    out = tl.sum(part_acc * weight[:, None], axis=0) / tl.sum(part_sum * weight, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor, *, out: torch.Tensor | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Causal attention of every query row ([num_tokens, num_heads, head_dim]) over its own context.

    ``out`` (same shape as ``q``) receives the result if given; rows past ``query_start_loc[-1]``
    (padding tokens) are left untouched. ``num_kv_splits`` forces the split-KV count (1 = off).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    quantized = _check_cache(k_cache, v_cache, k_scale, v_scale)
    assert q.stride(2) == 1, "head_dim must be contiguous"
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert num_heads % num_kv_heads == 0
    if out is None:
        out = torch.empty_like(q)
    num_real_tokens = meta.query_start_loc_cpu[-1]
    if num_real_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    decode_sized = meta.max_query_len * group_pad <= DECODE_ROWS
    block_m = max(DECODE_ROWS if decode_sized else PREFILL_ROWS, group_pad)
    block_q = block_m // group_pad
    tile_n = DECODE_TILE_N if decode_sized else PREFILL_TILE_N
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(meta, num_kv_heads, q.device)
    split_kv = num_kv_splits > 1

    num_tiles = num_real_tokens // block_q + meta.num_seqs
    if split_kv:
        part_max = q.new_empty((num_kv_splits, num_tokens, num_heads), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = q.new_empty((num_kv_splits, num_tokens, num_heads, head_dim), dtype=torch.float32)
    else:
        part_max = part_sum = part_acc = out  # unused: SPLIT_KV=False compiles the partial stores away
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, k_scale, v_scale, out, part_max, part_sum, part_acc,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.num_seqs, num_tokens, num_heads, scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_N=tile_n, SPLIT_KV=split_kv, QUANTIZED=quantized)
    if split_kv:
        _merge_splits_kernel[(num_real_tokens, num_heads)](
            out, part_max, part_sum, part_acc, num_tokens, num_heads, num_kv_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_kv_splits))
    return out


def choose_num_kv_splits(meta: AttentionMetadata, num_kv_heads: int, device: torch.device) -> int:
    """Split the keys only when a decode batch leaves the device underfilled and contexts are long."""
    if meta.max_query_len > MAX_SPLIT_QUERY_LEN:
        return 1
    programs = meta.num_seqs * num_kv_heads
    target = _target_programs(device)
    if programs >= target:
        return 1
    splits = min(triton.cdiv(target, programs), meta.max_seq_len // MIN_KEYS_PER_SPLIT, MAX_KV_SPLITS)
    return max(splits, 1)


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_TARGET_PROGRAMS
    return _cuda_target_programs(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_target_programs(device_index: int) -> int:
    # Two programs per SM hide most of the load latency of a decode program.
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> bool:
    """True for an int8 cache, whose scales must be contiguous [blocks, block_size, kv_heads]."""
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1, "head_dim must be contiguous"
    quantized = k_cache.dtype == torch.int8
    if quantized:
        assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.is_contiguous() \
            and v_scale.is_contiguous() and k_scale.dtype == torch.float32, "an int8 cache needs its scales"
    return quantized
