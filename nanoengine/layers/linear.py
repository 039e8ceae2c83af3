"""Linear layers that know how to hold their tensor-parallel shard.

Column-parallel layers split the output features over ranks (each rank
computes a slice); row-parallel layers split the input features and sum the
partial results with an all-reduce. Each parameter carries a ``weight_loader``
that cuts its own shard out of a full checkpoint tensor.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.distributed import all_reduce, tp_rank, tp_size

# On the CPU, torch's F.linear calls MKL, which on AMD processors runs its AVX2 code; oneDNN picks its kernels
# by instruction set and runs AVX-512 there, 2.4x faster on this project's machine, at every row count. It
# wants the weight in its own blocked layout, made once. torch exposes this pair of ops only privately (its
# compiler uses them), so both calls are kept to this file.
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
ONEDNN_ROWS_HINT = 32  # the layout barely depends on the batch size it is made for


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed_weight: torch.Tensor | None = None) -> torch.Tensor:
    if packed_weight is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)


def can_pack_for_onednn(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` in oneDNN's layout, for ``linear(..., packed_weight=)``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT)


def pack_weights_for_onednn(model: nn.Module) -> None:
    """Give every linear layer (and the LM head) a oneDNN copy of its weight; ``linear`` then uses it."""
    for module in model.modules():
        if hasattr(module, "packed_weight") and can_pack_for_onednn(module.weight):
            module.packed_weight = pack_for_onednn(module.weight)


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
        self.packed_weight: torch.Tensor | None = None  # see pack_weights_for_onednn

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
