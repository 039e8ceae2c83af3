"""The small ops' C++ kernels (csrc/cpu_ops.cpp) swapped into the plain layers, vLLM's ``forward_cpu`` idea: a
layer keeps its torch ``forward`` (the ``forward_native``), and on the CPU with the extension built each
instance's forward becomes one of these, which call the kernel in the same place with the same inputs.

RMSNorm with a residual adds ``x`` into the residual stream in place (one pass, as the torch path's add
rounds) and normalizes the sum; rotary rotates q and k in place.
"""

from types import MethodType, ModuleType
from typing import NamedTuple

import torch
from torch import nn

from nanoengine.layers.activation import SiluAndMul
from nanoengine.layers.norm import RMSNorm
from nanoengine.layers.rotary import RotaryEmbedding


def use_small_op_kernels(model: nn.Module, kernels: ModuleType) -> None:
    """Give every RMSNorm, SiluAndMul and RotaryEmbedding of ``model`` its C++ forward."""
    forwards = {RMSNorm: rms_norm_forward, SiluAndMul: silu_and_mul_forward, RotaryEmbedding: rotary_forward}
    for module in model.modules():
        if type(module) in forwards:
            module.kernels = kernels
            module.forward = MethodType(forwards[type(module)], module)


def rms_norm_forward(self: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    out = torch.empty(x.shape, dtype=x.dtype)
    if residual is None:
        self.kernels.rms_norm(x, self.weight, self.eps, out)
        return out
    self.kernels.add_rms_norm(x, residual, self.weight, self.eps, out)
    return out, residual


def silu_and_mul_forward(self: SiluAndMul, gate_up: torch.Tensor) -> torch.Tensor:
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    self.kernels.silu_and_mul(gate_up, out)
    return out


def rotary_forward(self: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> "KernelRotation":
    return KernelRotation(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype),
                          self.kernels)


class KernelRotation(NamedTuple):
    """layers/rotary.py's Rotation, applied by the C++ kernel."""

    cos: torch.Tensor
    sin: torch.Tensor
    kernels: ModuleType

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim], rotated in place."""
        self.kernels.rotary(x, self.cos, self.sin)
        return x


def argmax(logits: torch.Tensor, kernels: ModuleType | None) -> torch.Tensor:
    """Each row's first largest logit, as torch.argmax, by the C++ kernel where it is built (torch's argmax
    is many times slower than its max on the CPU: docs/cpu.md)."""
    if kernels is None:
        return logits.argmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    kernels.argmax(logits.contiguous(), tokens)
    return tokens
