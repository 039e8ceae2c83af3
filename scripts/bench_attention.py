"""Decode attention on a Qwen3-0.6B-shaped layer: the Triton paged kernel against contiguous SDPA.

Decode attention reads the whole KV cache once per call, so it is bandwidth bound: the table
reports the bytes that read must move divided by the time, and that as a fraction of what a large
device-to-device copy achieves. Run on a CUDA machine: ``python scripts/bench_attention.py``.
``--dry-run`` runs the same code at toy sizes on the CPU under the Triton interpreter, to check the
plumbing (its timings mean nothing).
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from nanoengine.attention.metadata import AttentionMetadata  # noqa: E402


@dataclass
class Shape:
    batches: list[int]
    context_lens: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    warmup: int
    reps: int
    copy_bytes: int


QWEN3_0_6B = Shape(batches=[1, 16, 64, 256], context_lens=[512, 2048, 8192], num_heads=16, num_kv_heads=8,
                   head_dim=128, block_size=16, dtype=torch.bfloat16, warmup=10, reps=30, copy_bytes=1 << 30)
# The interpreter has no bf16 tl.dot (triton-lang/triton#11584), hence fp32.
DRY_RUN = Shape(batches=[1, 3], context_lens=[32, 528], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                dtype=torch.float32, warmup=1, reps=2, copy_bytes=1 << 20)
L2_FLUSH_BYTES = 256 << 20  # larger than any current GPU's L2, so every timed call reads from HBM


def load_backend(dry_run: bool) -> ModuleType:
    # TRITON_INTERPRET is read when @triton.jit decorates, so it must be set before triton is imported.
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    from nanoengine.attention import triton_backend
    return triton_backend


def median_seconds(fn, device: torch.device, warmup: int, reps: int, flush: torch.Tensor | None = None) -> float:
    """Median time of one call; on CUDA from events, with the L2 flushed before each call if given."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def copy_bandwidth(shape: Shape, device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy, counting both the read and the write."""
    src = torch.empty(shape.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, shape.warmup, shape.reps)
    return 2 * shape.copy_bytes / seconds


@dataclass
class DecodeBatch:
    q: torch.Tensor           # [batch, num_heads, head_dim]
    k: torch.Tensor           # [batch, num_kv_heads, context_len, head_dim], contiguous, for SDPA
    v: torch.Tensor
    k_cache: torch.Tensor     # the same keys, paged through shuffled block tables
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_decode_batch(shape: Shape, batch: int, context_len: int, device: torch.device) -> DecodeBatch:
    assert context_len % shape.block_size == 0
    blocks_per_seq = context_len // shape.block_size
    kv_shape = (batch, shape.num_kv_heads, context_len, shape.head_dim)
    k = torch.randn(kv_shape, dtype=shape.dtype, device=device)
    v = torch.randn(kv_shape, dtype=shape.dtype, device=device)
    block_tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq)
    k_cache, v_cache = (to_paged(t, block_tables, shape.block_size) for t in (k, v))
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context_len, dtype=torch.int32, device=device),
        block_tables=block_tables.to(torch.int32),
        max_query_len=1,
        max_seq_len=context_len,
        query_start_loc_cpu=list(range(batch + 1)),
        seq_lens_cpu=[context_len] * batch,
    )
    q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
    return DecodeBatch(q, k, v, k_cache, v_cache, meta)


def to_paged(t: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[batch, kv_heads, ctx, dim] -> cache [num_blocks, block_size, kv_heads, dim] with logical block j of
    request i stored at physical block block_tables[i, j]."""
    batch, kv_heads, context_len, head_dim = t.shape
    logical_blocks = t.transpose(1, 2).reshape(-1, block_size, kv_heads, head_dim)
    cache = torch.empty_like(logical_blocks)
    cache[block_tables.flatten()] = logical_blocks
    return cache


def bench_one(backend: ModuleType, shape: Shape, batch: int, context_len: int, device: torch.device,
              flush: torch.Tensor | None) -> dict:
    b = make_decode_batch(shape, batch, context_len, device)
    scale = shape.head_dim ** -0.5
    out = torch.empty_like(b.q)
    q_sdpa = b.q.unsqueeze(2)  # [batch, heads, 1, dim]: one query per request sees its whole context

    no_scales = torch.empty(0, device=device)  # a cache in the model's dtype has none

    def triton_call():
        backend.paged_attention(b.q, b.k_cache, b.v_cache, b.meta, scale, no_scales, no_scales, out=out)

    def sdpa_call():
        return F.scaled_dot_product_attention(q_sdpa, b.k, b.v, scale=scale, enable_gqa=True)

    triton_call()
    max_error = (out.float() - sdpa_call().squeeze(2).float()).abs().max().item()
    kv_bytes = 2 * b.k.numel() * b.k.element_size()
    return {
        "splits": backend.choose_num_kv_splits(b.meta, shape.num_kv_heads, device),
        "kv_bytes": kv_bytes,
        "triton_s": median_seconds(triton_call, device, shape.warmup, shape.reps, flush),
        "sdpa_s": median_seconds(sdpa_call, device, shape.warmup, shape.reps, flush),
        "max_error": max_error,
    }


def print_table(rows: list[tuple[int, int, dict]], copy_bps: float) -> None:
    print(f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + write)\n")
    header = (f"{'batch':>5} {'ctx':>5} {'KV MB':>8} {'splits':>6} | {'triton us':>9} {'GB/s':>6} {'%copy':>5} | "
              f"{'sdpa us':>9} {'GB/s':>6} {'%copy':>5} | {'speedup':>7} {'max err':>8}")
    print(header)
    print("-" * len(header))
    for batch, context_len, r in rows:
        triton_bps, sdpa_bps = r["kv_bytes"] / r["triton_s"], r["kv_bytes"] / r["sdpa_s"]
        print(f"{batch:>5} {context_len:>5} {r['kv_bytes'] / 1e6:>8.1f} {r['splits']:>6} | "
              f"{r['triton_s'] * 1e6:>9.1f} {triton_bps / 1e9:>6.0f} {100 * triton_bps / copy_bps:>5.0f} | "
              f"{r['sdpa_s'] * 1e6:>9.1f} {sdpa_bps / 1e9:>6.0f} {100 * sdpa_bps / copy_bps:>5.0f} | "
              f"{r['sdpa_s'] / r['triton_s']:>6.2f}x {r['max_error']:>8.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU under the Triton interpreter")
    args = parser.parse_args()
    if args.dry_run:
        shape, device, flush = DRY_RUN, torch.device("cpu"), None
    elif torch.cuda.is_available():
        shape, device = QWEN3_0_6B, torch.device("cuda")
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    else:
        sys.exit("bench_attention needs a CUDA GPU (or --dry-run to check the script on the CPU)")
    backend = load_backend(args.dry_run)

    copy_bps = copy_bandwidth(shape, device)
    rows = []
    for batch in shape.batches:
        for context_len in shape.context_lens:
            rows.append((batch, context_len, bench_one(backend, shape, batch, context_len, device, flush)))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the largest case holds ~17 GB; don't let it fragment the next
    print_table(rows, copy_bps)


if __name__ == "__main__":
    main()
