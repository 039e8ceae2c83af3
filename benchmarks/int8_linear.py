"""The linear kernel per call, bfloat16 weights against int8 (W8A16) and 4-bit (W4A16, groups of 32), with each
weight read from memory as in a decode step of a model larger than the caches: each call takes the next of enough
copies of the weight to pass 256 MiB in bfloat16. Kernel level only (bench.py measures the engine).

    python benchmarks/int8_linear.py [--rows 1 8 32] [--rounds 7] [--threads N]
"""

import argparse
import statistics
import time

import torch

from nanoengine.platforms.cpu.build import load_cpu_kernels
from nanoengine.platforms.cpu.linear import linear, only_kernel
from nanoengine.platforms.cpu.quantize import quantize_int4
from nanoengine.quantization import quantize
from nanoengine.utils.cpu_info import cpu_model

SHAPES = {  # name: (out_features, in_features)
    "SmolLM2 qkv": (960, 576), "SmolLM2 o": (576, 576), "SmolLM2 gate_up": (3072, 576), "SmolLM2 down": (576, 1536),
    "Llama-3.2-1B o": (2048, 2048), "Llama-3.2-1B gate_up": (16384, 2048), "Llama-3.2-1B down": (2048, 8192)}
BYTES_READ = 256 << 20


def per_call_ms(choices: list, weights: list, x: torch.Tensor, rounds: int) -> float:
    """The median call over ``rounds`` passes over every copy (a median: other work on a shared machine preempts
    a few calls)."""
    times = []
    for _ in range(rounds):
        for weight, choice in zip(weights, choices):
            start = time.perf_counter()
            linear(x, weight, choice=choice)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_ops = load_cpu_kernels()
    print(f"{cpu_model()}, {cpu_ops.vector_isa()} kernels, {torch.get_num_threads()} threads; ms per call "
          "(bfloat16 / int8 / int4; int8's and int4's speed-up over bfloat16, int4's over int8)")
    print("| shape | " + " | ".join(f"{rows} rows" for rows in args.rows) + " |")
    print("| --- |" + " ---: |" * len(args.rows))
    for name, (out_features, in_features) in SHAPES.items():
        copies = max(2, BYTES_READ // (2 * out_features * in_features))
        bf16 = [torch.randn(out_features, in_features, dtype=torch.bfloat16) for _ in range(copies)]
        int8 = [quantize(weight) for weight in bf16]
        int4 = [quantize_int4(weight) for weight in bf16]
        bf16_choices = [only_kernel(weight, "tiled", cpu_ops) for weight in bf16]
        int8_choices = [only_kernel(q, "tiled", cpu_ops, scale) for q, scale in int8]
        int4_choices = [only_kernel(q, "tiled", cpu_ops, scale, minimum) for q, scale, minimum in int4]
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            bf16_ms = per_call_ms(bf16_choices, bf16, x, args.rounds)
            int8_ms = per_call_ms(int8_choices, [q for q, _ in int8], x, args.rounds)
            int4_ms = per_call_ms(int4_choices, [q for q, _, _ in int4], x, args.rounds)
            cells.append(f"{bf16_ms:.3f} / {int8_ms:.3f} / {int4_ms:.3f} ({bf16_ms / int8_ms:.2f}x, "
                         f"{bf16_ms / int4_ms:.2f}x; {int8_ms / int4_ms:.2f}x)")
        print(f"| {name} {out_features}x{in_features} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
