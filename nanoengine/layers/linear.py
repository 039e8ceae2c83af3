"""Linear layers that know how to hold their tensor-parallel shard.

Column-parallel layers split the output features over ranks (each rank
computes a slice); row-parallel layers split the input features and sum the
partial results with an all-reduce. Each parameter carries a ``weight_loader``
that cuts its own shard out of a full checkpoint tensor.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.distributed import all_reduce, divide, tp_rank, tp_size


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
        self.adds_bias = tp_rank() == 0  # asked once: the group outlives the model

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is added once, after the sum
            param.data.copy_(loaded)
            return
        shard = param.shape[1]
        param.data.copy_(loaded.narrow(1, tp_rank() * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight, self.bias if self.adds_bias else None))
