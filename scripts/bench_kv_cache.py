"""The CPU attention kernels over a bfloat16 KV cache against an int8 one, one layer's call at a time.

Decode attention reads every K and V byte of its contexts once, so an int8 cache (one byte an element and a
4-byte scale per token and KV head) reads (head_dim + 4) / (2 head_dim) of the bytes. Prompt attention is
mostly arithmetic. Each layer has its own cache, so a step's reads come from memory, as in a model; each case is
timed as the best of ``--reps`` calls, the two caches taking turns, so a burst of
other work on the machine weighs on both alike. ``python scripts/bench_kv_cache.py``.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from nanoengine.platforms.cpu.build import load_cpu_kernels  # noqa: E402
from nanoengine.quantization import quantize  # noqa: E402
from nanoengine.utils.cpu_info import cpu_model  # noqa: E402

BLOCK_SIZE = 16
SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3.2-1B": (32, 8, 64)}  # query heads, KV heads, head_dim
OVERFLOW_BYTES = 256 << 20  # the caches of all layers together, in bfloat16: more than any CPU's L3 here
# Requests, each one's context and its new tokens: decodes, a whole prompt, and prompt ends after a cached prefix.
CASES = [(32, 600, 1), (1, 4096, 1), (1, 1024, 1024), (32, 512, 16)]


def caches(num_tokens: int, num_kv_heads: int, head_dim: int, quantized: bool) -> list[torch.Tensor]:
    """K and V caches holding ``num_tokens`` random tokens (in bfloat16, or int8 with their scales)."""
    shape = (num_tokens // BLOCK_SIZE, BLOCK_SIZE, num_kv_heads, head_dim)
    k, v = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
    if not quantized:
        return [k, v, torch.empty(0), torch.empty(0)]
    (k, k_scale), (v, v_scale) = quantize(k), quantize(v)
    return [k, v, k_scale, v_scale]


def call(kernels, num_requests: int, tokens: int, new_tokens: int, shape: tuple[int, int, int], quantized: bool):
    """The case's attention call in each of enough layers that their caches overflow the CPU's caches, as a
    step's layers do: decodes (one new token) or prompts; returns (run them all, the number of layers)."""
    num_heads, num_kv_heads, head_dim = shape
    blocks_each = -(-tokens // BLOCK_SIZE)
    tables = torch.randperm(num_requests * blocks_each, dtype=torch.int32).view(num_requests, blocks_each)
    lens = torch.full((num_requests,), tokens, dtype=torch.int32)
    query_lens = torch.full((num_requests,), new_tokens, dtype=torch.int32)
    rows = num_requests * new_tokens
    q = torch.randn(rows, num_heads, head_dim, dtype=torch.bfloat16)
    out, scale = torch.empty_like(q), head_dim ** -0.5
    layer_bytes = num_requests * blocks_each * BLOCK_SIZE * num_kv_heads * head_dim * 2 * 2  # in bfloat16
    layers = [caches(num_requests * blocks_each * BLOCK_SIZE, num_kv_heads, head_dim, quantized)
              for _ in range(-(-OVERFLOW_BYTES // layer_bytes))]
    first_rows = torch.arange(num_requests, dtype=torch.int32) * new_tokens

    def run_layers():
        for cache in layers:
            if new_tokens == 1:
                kernels.decode_attention(q, *cache, tables, lens, torch.arange(rows), scale, out)
            else:
                kernels.prefill_attention(q, *cache, tables, first_rows, query_lens, lens, scale, out)
    return run_layers, len(layers)


def best_of_alternating(calls: list, reps: int) -> list[float]:
    best = [float("inf")] * len(calls)
    for fn in calls:
        fn()
    for _ in range(reps):
        for i, fn in enumerate(calls):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        sys.exit("the C++ kernels did not build")
    print(f"{cpu_model()}, {torch.get_num_threads()} threads; a layer's call, in the best of {args.reps} runs "
          "through every layer\n")
    print("| model shape | case | bfloat16 cache, us | int8 cache, us | int8 / bf16 |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, shape in SHAPES.items():
        for num_requests, tokens, new_tokens in CASES:
            (plain, layers), (quantized, _) = [call(kernels, num_requests, tokens, new_tokens, shape, q)
                                               for q in (False, True)]
            plain, quantized = (t / layers for t in best_of_alternating([plain, quantized], args.reps))
            case = ("decode" if new_tokens == 1 else "prompt" if new_tokens == tokens
                    else f"last {new_tokens} of a prompt")
            print(f"| {name} | {case}, {num_requests} x {tokens} tokens | {plain * 1e6:.0f} | {quantized * 1e6:.0f} "
                  f"| {quantized / plain:.2f} |")


if __name__ == "__main__":
    main()
