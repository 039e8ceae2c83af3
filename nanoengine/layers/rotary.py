"""Rotary position embedding (the rotate-half layout Hugging Face checkpoints use)."""

import math
from typing import NamedTuple

import torch
from torch import nn


def inverse_frequencies(head_dim: int, rope: dict) -> torch.Tensor:
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":  # a GGUF file's Llama 3.1 scaling (utils/gguf_file.py): each frequency's divisor
        return inv_freq / torch.tensor(rope.get("frequency_factors", 1.0), dtype=torch.float)
    if rope_type == "llama3":
        return llama3_scaled(inv_freq, rope)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, llama3)")


def llama3_scaled(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1: stretch low frequencies by ``factor``, keep high ones, blend in between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(in_between, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: dict):
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float)
        angles = torch.outer(positions, inverse_frequencies(head_dim, rope))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rotation":
        """The cos and sin of every token's angles ([num_tokens, 1, head_dim]), looked up once per step and
        shared by every layer."""
        return Rotation(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


class Rotation(NamedTuple):
    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim]."""
        return x * self.cos + rotate_half(x) * self.sin
