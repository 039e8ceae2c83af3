"""The roofline: a step's FLOPs over a measured matmul rate and its bytes over a measured read bandwidth."""

import functools
import os
import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from benchmarks.common import Step, sync
from nanoengine.models.llama import head_dim_of
from nanoengine.platforms.cpu.linear import kernels_for, linear, only_kernel
from nanoengine.utils.cpu_info import cpu_flags, cpu_model


def time_best(fn, reps: int) -> float:
    """Best wall time of ``reps`` calls after one warm-up (synchronizing the GPU around each)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best

def matmul_flops_per_s(device: str, dtype: torch.dtype) -> float:
    """The fastest of the kernels our linears can use: torch's matmul and, on the CPU, oneDNN's (torch's goes
    through MKL, which can leave half of an AMD CPU's vector width unused) and the weight widened to float32
    (faster for bfloat16 on a CPU without AMX)."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    seconds = time_best(lambda: a @ b, reps=10)
    for kernel in kernels_for(b)[1:]:
        seconds = min(seconds, time_best(functools.partial(linear, a, b, choice=only_kernel(b, kernel)), reps=10))
    return 2 * n**3 / seconds


def read_bytes_per_s(device: str) -> float:
    """Memory read bandwidth: a sum over a tensor far larger than any cache reads each byte once."""
    data = torch.ones((1 << 30 if device == "cuda" else 1 << 28) // 4, device=device)
    return data.numel() * 4 / time_best(data.sum, reps=10)


@dataclass
class Hardware:
    matmul_flops: float
    read_bytes: float

    @classmethod
    def measure(cls, device: str, dtype: torch.dtype) -> "Hardware":
        return cls(matmul_flops_per_s(device, dtype), read_bytes_per_s(device))


def machine(device: str, hw: Hardware) -> dict:
    """What a reader needs to place the figures: the processor, the ISA that picks its kernels, its rates."""
    rates = {"matmul_tflops": hw.matmul_flops / 1e12, "read_gb_per_s": hw.read_bytes / 1e9}
    if device == "cuda":
        return {"name": torch.cuda.get_device_name(), **rates}
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in cpu_flags()]
    return {"name": cpu_model(), "isa": " ".join(flags) or "none of avx2/avx512/amx", "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), **rates}

@dataclass
class ModelShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: PretrainedConfig) -> "ModelShape":
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim_of(config), config.intermediate_size, config.vocab_size)

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matmuls: q, k, v, o, and gate, up, down."""
        qkv = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return qkv + self.num_heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        return self.num_layers * self.layer_params + self.vocab * self.hidden  # with the LM head

    def itemsizes(self, dtype: torch.dtype, quantization: str | None = None, kv_cache_dtype: str = "auto"):
        """Bytes a weight and bytes a K or V value take with these engine options (an int8 cache's float32
        scale, one per head vector, spread over its values)."""
        weight = 1 if quantization == "int8" else dtype.itemsize
        return weight, 1 + 4 / self.head_dim if kv_cache_dtype == "int8" else dtype.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def step_flops(self, step: "Step") -> int:
        """Every new token goes through every layer; each sampling request needs the LM head once; a token
        at position p attends to p + 1 keys (QK^T and PV: 4 FLOPs per key and head dim)."""
        tokens = sum(new for new, _, _ in step)
        linear = 2 * self.num_layers * self.layer_params * tokens + 2 * self.vocab * self.hidden * sum(
            samples for _, _, samples in step)
        # New tokens at positions context - new .. context - 1 see context - new + 1 .. context keys.
        keys = sum(new * context - new * (new - 1) // 2 for new, context, _ in step)
        return linear + 4 * self.num_layers * self.num_heads * self.head_dim * keys

    def step_bytes(self, step: "Step", itemsize: float, kv_itemsize: float | None = None) -> float:
        """The least a step must read: every weight once (``itemsize`` bytes each), and the K and V of every live
        token once (``kv_itemsize`` bytes a value, by default ``itemsize``)."""
        live_tokens = sum(context for _, context, _ in step)
        kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
        return self.matmul_params * itemsize + live_tokens * self.kv_bytes_per_token * kv_itemsize

@dataclass
class Roofline:
    compute_s: float  # the steps' FLOPs over the matmul rate
    memory_s: float  # the steps' bytes over the read bandwidth
    floor_s: float  # per step the larger of the two, summed over the steps

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s > self.compute_s else "compute"


def roofline(shape: ModelShape, steps: list[Step], itemsize: float, hw: Hardware,
             kv_itemsize: float | None = None) -> Roofline:
    compute = [shape.step_flops(step) / hw.matmul_flops for step in steps]
    memory = [shape.step_bytes(step, itemsize, kv_itemsize) / hw.read_bytes for step in steps]
    return Roofline(sum(compute), sum(memory), sum(map(max, compute, memory)))
