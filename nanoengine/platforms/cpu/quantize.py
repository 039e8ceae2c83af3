"""int8 weights (``quantization="int8"``): every linear layer's weight quantized once at load, symmetric per output
channel, multiplied as W8A16 (the int8 weight widened to float32 in registers and met by the activations in
float32: docs/quantization.md has the perplexity figures behind the choice), and the LM head's too, which
measured harmless (+0.13% perplexity on SmolLM2 with it, +0.23% without). The embeddings keep the model's dtype
(a model that ties them to the LM head keeps that tensor for the lookup: the int8 LM head is a copy).

A layer keeps ``weight`` as int8 [N, K] and ``weight_scale``, float32 [N]: weight ~= q * scale per row. A
row-parallel shard sees only part of each output's inputs, so its scale is the largest over the ranks: two
ranks quantize exactly as one does.

4-bit weights (``quantization="int4"``, and a GGUF file's Q4_0, Q4_1 and Q4_K): a layer keeps ``weight`` as uint8
[N, K/2], ``weight_scale`` and ``weight_min``, float16 [N, K/group]: weight ~= q * scale + min, q in 0..15, a
group's first half of q in the low nibbles of its K/2 bytes and its second half in the high ones (llama.cpp's Q4_1
layout, so a Q4_0 or Q4_1 file's bytes are kept as they are). A Q4_0 file's layer has no ``weight_min``: its
minimum is -8 scale, and not storing it saves a tenth of the bytes. The LM head stays int8, as llama.cpp keeps its
output layer at 6 or 8 bits: in 4 bits it cost SmolLM2 +5.4% perplexity, in int8 nothing measurable.
"""

import logging

import torch
import torch.distributed as dist
from torch import nn

from nanoengine.distributed import tp_size
from nanoengine.layers.embedding import ParallelLMHead
from nanoengine.layers.linear import LinearBase, RowParallelLinear
from nanoengine.quantization import quantize

logger = logging.getLogger(__name__)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight that int8 ``q`` with ``scale`` stands for: the oracle's math."""
    return q.float() * scale.unsqueeze(1)


INT4_GROUP = 32  # inputs per scale and minimum of quantization="int4" (docs/quantization.md: measured)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] as packed 4-bit values, a float16 scale and a float16 minimum per ``group`` inputs, as
    llama.cpp's Q4_1: scale = (max - min) / 15, q = round((w - min) / scale) in 0..15 (a flat group: scale 0, q 0)."""
    rows, inputs = weight.shape
    if inputs % group:
        raise ValueError(f"int4 weights: {inputs} inputs are not whole groups of {group}")
    groups = weight.detach().float().view(rows, inputs // group, group)
    minimum = groups.amin(dim=-1).half()
    scale = ((groups.amax(dim=-1) - minimum.float()) / 15).half()
    steps = (groups - minimum.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)
    q = torch.where(scale.unsqueeze(-1) > 0, steps, 0).round().clamp(0, 15).to(torch.uint8)
    return pack_int4(q.view(rows, inputs), group), scale, minimum


def pack_int4(q: torch.Tensor, group: int) -> torch.Tensor:
    """4-bit values (uint8 [N, K], each in 0..15) two to a byte: each group's first half in the low nibbles."""
    halves = q.view(q.shape[0], -1, 2, group // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).view(q.shape[0], -1)


def unpack_int4(packed: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """The 4-bit values (uint8 [N, K], each in 0..15) that ``pack_int4`` packed two to a byte."""
    halves = packed.view(packed.shape[0], -1, 1, group // 2)
    return torch.cat([halves & 15, halves >> 4], dim=2).view(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                    into: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K] that a 4-bit one stands for (q * scale + min, rounded once; without ``minimum``,
    min = -8 scale), in ``into`` or a new tensor: the oracle's math."""
    rows, groups = scale.shape
    nibbles = packed.view(rows, groups, -1)
    wide = (torch.empty(rows, packed.shape[1] * 2) if into is None else into).view(rows, groups, 2, -1)
    wide[:, :, 0] = nibbles & 15
    wide[:, :, 1] = nibbles >> 4
    minimum = -8 * scale.float() if minimum is None else minimum.float()
    wide.mul_(scale.float().view(rows, groups, 1, 1)).add_(minimum.view(rows, groups, 1, 1))
    return wide.view(rows, -1)


def in_features_of(weight: torch.Tensor) -> int:
    """A weight's inputs (K): a packed 4-bit weight holds two per byte."""
    return weight.shape[1] * 2 if weight.dtype == torch.uint8 else weight.shape[1]


def quantize_linear_layers(model: nn.Module, quantization: str = "int8") -> None:
    """Replace every linear layer's weight (qkv, o, gate_up, down, the LM head) by int8 and its ``weight_scale``,
    or by 4-bit and its ``weight_scale`` and ``weight_min`` (but the LM head's, int8); the 16-bit or float32 weight
    is freed (but for the embeddings' where they are tied). Layers a GGUF file gave quantized weights keep them."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase | ParallelLMHead) and m.weight.is_floating_point()]
    before = sum(m.weight.nbytes for m in layers)
    for module in layers:
        if quantization == "int4" and not isinstance(module, ParallelLMHead):
            q, module.weight_scale, module.weight_min = quantize_int4(module.weight)
        else:
            absmax = None  # each row's own, but for a row-parallel shard's: the largest over the ranks
            if isinstance(module, RowParallelLinear) and tp_size() > 1:
                absmax = module.weight.detach().float().abs().amax(dim=1)
                dist.all_reduce(absmax, op=dist.ReduceOp.MAX)
            q, module.weight_scale = quantize(module.weight.detach(), absmax)
        module.weight = nn.Parameter(q, requires_grad=False)
    after = sum(t.nbytes for m in layers for t in weight_tensors(m))
    logger.info("%s weights: the linear layers' and LM head's %d weights take %.1f MiB, were %.1f MiB",
                quantization, len(layers), after / 2**20, before / 2**20)


def weight_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A layer's weight and, where it is quantized, its scales (and minimums)."""
    return [t for t in (module.weight, getattr(module, "weight_scale", None), getattr(module, "weight_min", None))
            if t is not None]
