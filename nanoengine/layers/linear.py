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

# Up to this many rows (decode batches), the CPU's BLAS computes x @ W^T faster as (W @ x^T)^T: the weight
# then streams through as the left operand instead of being repacked as the right one. Its speed also
# depends on the row count: one row takes a slow matrix-vector path (2x slower than two rows), and 9 to 31
# rows run up to 1.9x slower than the next multiple of 8. So the rows are padded with zeros to those sizes.
CPU_FEW_ROWS = 32


def cpu_padded_rows(rows: int) -> int:
    if rows == 1:
        return 2
    return rows if rows <= 8 else -(-rows // 8) * 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.shape[0]
    if x.device.type == "cpu" and x.dim() == 2 and rows <= CPU_FEW_ROWS:
        if cpu_padded_rows(rows) > rows:
            x = F.pad(x, (0, 0, 0, cpu_padded_rows(rows) - rows))
        out = torch.mm(weight, x.t()).t()[:rows].contiguous()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
        return all_reduce(linear(x, self.weight, bias))
