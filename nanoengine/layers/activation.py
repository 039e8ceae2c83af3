import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up, for the merged [gate | up] projection."""

    cpu_ops = None  # the C++ kernels (layers/cpu_ops.cpp), set by the model runner on the CPU

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
            self.cpu_ops.silu_and_mul(gate_up, out)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
