"""Linear layers that know how to hold their tensor-parallel shard.

Column-parallel layers split the output features over ranks (each rank
computes a slice); row-parallel layers split the input features and sum the
partial results with an all-reduce. Each parameter carries a ``weight_loader``
that cuts its own shard out of a full checkpoint tensor.
"""

import json
import logging
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.distributed import all_reduce, tp_rank, tp_size
from nanoengine.utils.cpu_info import cpu_model
from nanoengine.utils.default_model import cache_dir

logger = logging.getLogger(__name__)

# On the CPU, torch's F.linear calls MKL, which on AMD processors runs its AVX2 code; oneDNN picks its kernels
# by instruction set and runs AVX-512 there. On an Intel CPU both run AVX-512, and at one row MKL can be the
# faster. So the kernel is chosen by measurement: for each weight shape and row-count bucket, the faster one.
# oneDNN wants the weight in its own blocked layout, made once. torch exposes this pair of ops only privately
# (its compiler uses them), so both calls are kept to this file.
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
ONEDNN_ROWS_HINT = 32  # the layout barely depends on the batch size it is made for
ROW_BUCKETS = (1, 8, 32)  # a call with <= 1, <= 8 or more rows takes the kernel timed at these rows
KERNELS = ("auto", "onednn", "torch")


@dataclass
class PackedWeight:
    """A weight in oneDNN's layout, and per row bucket whether ``linear`` multiplies through it."""

    tensor: torch.Tensor
    used_at: tuple[bool, ...] = (True,) * len(ROW_BUCKETS)


def row_bucket(rows: int) -> int:
    return next((i for i, top in enumerate(ROW_BUCKETS[:-1]) if rows <= top), len(ROW_BUCKETS) - 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed_weight: PackedWeight | None = None) -> torch.Tensor:
    if packed_weight is not None and packed_weight.used_at[row_bucket(x.shape[:-1].numel())]:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight.tensor, bias, "none", [None], "")
    return F.linear(x, weight, bias)


def can_pack_for_onednn(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_for_onednn(weight: torch.Tensor) -> PackedWeight:
    """A copy of ``weight`` in oneDNN's layout, for ``linear(..., packed_weight=)`` at every row count."""
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT))


def choose_linear_kernels(model: nn.Module, kernel: str = "auto") -> None:
    """Give every linear layer (and the LM head) oneDNN's packed weight where, for its shape and row bucket,
    oneDNN beats F.linear: measured once per machine and cached (``kernel="auto"``), or forced."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    layers = [m for m in model.modules() if hasattr(m, "packed_weight") and can_pack_for_onednn(m.weight)]
    for module in layers:
        module.packed_weight = pack_for_onednn(module.weight)
    if kernel != "auto":
        choices = {shape_key(m.weight): (kernel == "onednn",) * len(ROW_BUCKETS) for m in layers}
    else:
        choices = measured_choices({shape_key(m.weight): m for m in layers})
    for module in layers:
        used_at = choices[shape_key(module.weight)]
        module.packed_weight = replace(module.packed_weight, used_at=used_at) if any(used_at) else None


def shape_key(weight: torch.Tensor) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')}"


def measured_choices(layers: dict[str, nn.Module]) -> dict[str, tuple[bool, ...]]:
    """Per shape, whether oneDNN is the faster at each row bucket; shapes this machine has not timed yet are
    timed now (the log says how long it took) and added to the cache file. Delete the file to time again
    (figures taken while other work loads the machine can pick the wrong kernel)."""
    path = cache_dir() / "linear-kernels.json"
    cache = json.loads(path.read_text()) if path.is_file() else {}
    machine = f"{cpu_model()}; torch {torch.__version__}; {torch.get_num_threads()} threads"
    known = cache.setdefault(machine, {})
    start = time.perf_counter()
    missing = {key: layer for key, layer in layers.items() if key not in known}
    known.update({key: onednn_faster_at(layer.weight, layer.packed_weight) for key, layer in missing.items()})
    if missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(f".tmp-{os.getpid()}")
        temp.write_text(json.dumps(cache, indent=1))
        temp.replace(path)
    names = ", ".join(f"{key}: " + "/".join("onednn" if faster else "torch" for faster in known[key])
                      for key in layers)
    how = f"measured in {time.perf_counter() - start:.2f} s" if missing else f"from {path}"
    logger.info("linear kernels at rows %s (%s): %s", "/".join(f"<={r}" for r in ROW_BUCKETS[:-1]) + "/more",
                how, names)
    return {key: tuple(known[key]) for key in layers}


def onednn_faster_at(weight: torch.Tensor, packed: PackedWeight) -> list[bool]:
    inputs = [torch.randn(rows, weight.shape[1], dtype=weight.dtype) for rows in ROW_BUCKETS]
    return [best_time(linear, x, weight, packed_weight=packed) < best_time(F.linear, x, weight) for x in inputs]


def best_time(fn, *args, reps: int = 3, **kwargs) -> float:
    fn(*args, **kwargs)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        self.packed_weight: PackedWeight | None = None  # see choose_linear_kernels

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, divide(out_features, tp_size(), "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        param.data.copy_(loaded.narrow(0, tp_rank() * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        for size in output_sizes:  # each part is split on its own, so each must divide
            divide(size, tp_size(), "output features")
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        local_sizes = [size // tp_size() for size in self.output_sizes]
        offset = sum(local_sizes[:shard_id])
        size = local_sizes[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Query, key and value projections in one matmul; each rank holds whole heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        divide(num_heads, tp_size(), "num_attention_heads")
        divide(num_kv_heads, tp_size(), "num_key_value_heads")
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        super().weight_loader(param, loaded, "qkv".index(shard_id))


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(divide(in_features, tp_size(), "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is added once, after the sum
            param.data.copy_(loaded)
            return
        shard = param.shape[1]
        param.data.copy_(loaded.narrow(1, tp_rank() * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if tp_rank() == 0 else None
        return all_reduce(linear(x, self.weight, bias, self.packed_weight))
