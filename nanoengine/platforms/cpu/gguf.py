"""A GGUF file's weights loaded as the file holds them (utils/gguf_file.py reads the file): each linear layer (and
the LM head) in the format nearest its tensors' type that the CPU multiplies, the other tensors in the model's dtype.

- Q4_0, Q4_1, Q4_K: 4-bit (quantize.py's layout): the file's 4-bit values, scales and minimums, never widened (a
  layer all Q4_0 keeps no minimums: they are -8 scale).
- Q8_0, Q6_K, Q5_0, Q5_1, Q5_K: int8 with a float32 scale per output row, quantized from the file's values
  (docs/quantization.md has the perplexity cost).
- F32, F16, BF16: the model's dtype, as a folder's weights.

A merged layer (q/k/v, gate/up) whose parts differ takes the widest of their formats. A tied LM head whose
embeddings are quantized gets a quantized copy of its own; the embeddings are dequantized into the model's dtype.
"""

import torch
from gguf import GGUFReader
from torch import nn
from transformers import PretrainedConfig

from nanoengine.layers.embedding import ParallelLMHead
from nanoengine.layers.linear import LinearBase
from nanoengine.platforms.cpu.quantize import pack_int4
from nanoengine.quantization import quantize
from nanoengine.utils.gguf_file import (
    EIGHT_BIT_TYPES,
    FOUR_BIT_TYPES,
    Type,
    as_float32,
    four_bit,
    hf_name,
    model_tensors,
)
from nanoengine.utils.loader import check_all_loaded, load_tensor, target_of

GROUP = 32  # the inputs per scale of every 4-bit type a file holds (Q4_K's 6-bit sub-block scales too)
FOUR_BIT_FORMATS = ("int4", "int4 symmetric")  # with a minimum per group, and without (an all-Q4_0 layer's)


def load_gguf(model: nn.Module, reader: GGUFReader, config: PretrainedConfig) -> None:
    tensors = {hf_name(t.name): t for t in model_tensors(reader)}  # names and types checked by gguf_config
    embeddings = tensors["model.embed_tokens.weight"]
    if "lm_head.weight" not in tensors and embeddings.tensor_type in FOUR_BIT_TYPES | EIGHT_BIT_TYPES:
        tensors["lm_head.weight"] = embeddings
    packed = getattr(model, "packed_modules", {})
    formats = layer_formats(model, tensors, packed)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for name, tensor in tensors.items():
        layer, _, kind = target_of(packed, name)[0].rpartition(".")
        for part, value in parts(name, tensor, formats.get(layer) if kind == "weight" else None, config):
            loaded.add(load_tensor(params, packed, part, value))
    check_all_loaded(params, loaded, reader.data.filename)
    modules = dict(model.named_modules())
    for layer in (name for name, fmt in formats.items() if fmt == "int8"):
        q, modules[layer].weight_scale = quantize(modules[layer].weight.detach())
        modules[layer].weight = nn.Parameter(q, requires_grad=False)


def layer_formats(model: nn.Module, tensors: dict, packed: dict) -> dict[str, str]:
    """Per linear layer whose weights the file holds quantized, "int4", "int4 symmetric" (all Q4_0) or "int8"; its
    storage made ready for them (int8 weights are loaded into a float32 one, quantized once whole)."""
    types: dict[str, set] = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight"):
            types.setdefault(target_of(packed, name)[0].rpartition(".")[0], set()).add(tensor.tensor_type)
    formats = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase | ParallelLMHead) and name in types:
            if types[name] == {Type.Q4_0}:
                formats[name] = "int4 symmetric"
            elif types[name] <= FOUR_BIT_TYPES:
                formats[name] = "int4"
            elif types[name] <= FOUR_BIT_TYPES | EIGHT_BIT_TYPES:
                formats[name] = "int8"
            else:
                continue
            give_storage(module, formats[name])
    return formats


def give_storage(module: nn.Module, fmt: str) -> None:
    rows, inputs = module.weight.shape
    loader = module.weight.weight_loader
    groups = ((rows, inputs // GROUP), torch.float16)
    shapes = ({"weight": ((rows, inputs // 2), torch.uint8), "weight_scale": groups} if fmt in FOUR_BIT_FORMATS
              else {"weight": ((rows, inputs), torch.float32)})
    if fmt == "int4":
        shapes["weight_min"] = groups
    for name, (shape, dtype) in shapes.items():
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=module.weight.device), requires_grad=False)
        param.weight_loader = loader
        setattr(module, name, param)


def parts(name: str, tensor, fmt: str | None, config: PretrainedConfig):
    """(name, value) of what the model loads from one tensor of the file: a 4-bit weight's packed values, scales
    and minimums, or the tensor's values in float32."""
    if fmt in FOUR_BIT_FORMATS:
        q, scale, minimum = (unpermuted(name, value, config) for value in four_bit(tensor.data, tensor.tensor_type))
        stem = name.removesuffix(".weight")
        kept = [(name, pack_int4(q, GROUP)), (f"{stem}.weight_scale", scale)]
        if fmt == "int4":
            kept.append((f"{stem}.weight_min", minimum))
        return kept
    return [(name, unpermuted(name, as_float32(tensor.data, tensor.tensor_type), config))]


def unpermuted(name: str, rows: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """llama.cpp's converter reorders a Llama's query and key rows within each head (its rotary rotates adjacent
    pairs, Hugging Face's the two halves); this puts them back, for any tensor with a row per output."""
    if config.model_type != "llama" or not (".q_proj." in name or ".k_proj." in name):
        return rows
    heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
