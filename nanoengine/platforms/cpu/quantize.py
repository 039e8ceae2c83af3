"""int8 weights (``quantization="int8"``): every linear layer's weight quantized once at load, symmetric per output
channel, multiplied as W8A16 (the int8 weight widened to float32 in registers and met by the activations in
float32: docs/quantization.md has the perplexity figures behind the choice), and the LM head's too, which
measured harmless (+0.13% perplexity on SmolLM2 with it, +0.23% without). The embeddings keep the model's dtype
(a model that ties them to the LM head keeps that tensor for the lookup: the int8 LM head is a copy).

A layer keeps ``weight`` as int8 [N, K] and ``weight_scale``, float32 [N]: weight ~= q * scale per row. A
row-parallel shard sees only part of each output's inputs, so its scale is the largest over the ranks: two
ranks quantize exactly as one does.
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


def quantize_linear_layers(model: nn.Module) -> None:
    """Replace every linear layer's weight (qkv, o, gate_up, down, the LM head) by int8 and its
    ``weight_scale``; the 16-bit or float32 weight is freed (but for the embeddings' where they are tied)."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    before = sum(m.weight.nbytes for m in layers)
    for module in layers:
        absmax = None  # each row's own, but for a row-parallel shard's: the largest over the ranks
        if isinstance(module, RowParallelLinear) and tp_size() > 1:
            absmax = module.weight.detach().float().abs().amax(dim=1)
            dist.all_reduce(absmax, op=dist.ReduceOp.MAX)
        q, module.weight_scale = quantize(module.weight.detach(), absmax)
        module.weight = nn.Parameter(q, requires_grad=False)
    after = sum(m.weight.nbytes + m.weight_scale.nbytes for m in layers)
    logger.info("int8 weights: the linear layers' and LM head's %d weights take %.1f MiB, were %.1f MiB",
                len(layers), after / 2**20, before / 2**20)
