"""A GGUF file (llama.cpp's format) read as it is, through the `gguf` package: the model's config from its metadata,
its tensors under Hugging Face's names, and which of the file's weight types the engine runs (and how).

The engine keeps no converted copy: the file is parsed once per process (gguf's GGUFReader, which EngineConfig
keeps), the config and tokenizer are rebuilt from its metadata (transformers' GGUF converter builds the tokenizer),
and the tensors are read from the file's memory map as they are loaded.
"""

import os

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.quants import Q4_K, dequantize
from transformers import LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

Type = GGMLQuantizationType
# general.architecture -> (the config class, our model's architectures name)
ARCHITECTURES = {"llama": (LlamaConfig, "LlamaForCausalLM"), "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
                 "qwen3": (Qwen3Config, "Qwen3ForCausalLM")}
# The weight types the engine loads, by the format a linear layer keeps them in (docs/quantization.md): 4-bit (the
# file's nibbles, a float16 scale and minimum per 32, none for an all-Q4_0 layer), int8 per output row (requantized),
# or the model's dtype.
# llama-quantize writes Q5_0/Q5_1 beside Q4_K/Q5_K where a row is not a multiple of 256 (SmolLM2's 576).
FOUR_BIT_TYPES = {Type.Q4_0, Type.Q4_1, Type.Q4_K}
EIGHT_BIT_TYPES = {Type.Q8_0, Type.Q6_K, Type.Q5_0, Type.Q5_1, Type.Q5_K}
FLOAT_TYPES = {Type.F32, Type.F16, Type.BF16}
# Llama 3.1's rope scaling as llama.cpp's converter writes it: a divisor per rotary frequency, as llama.cpp applies it
ROPE_FACTORS = "rope_freqs.weight"
# general.file_type -> what dtype="auto" picks: a float file's own type, else (the quantized files) bfloat16
AUTO_DTYPES = {LlamaFileType.ALL_F32: "float32", LlamaFileType.MOSTLY_F16: "float16"}
# llama.cpp's tensor names -> Hugging Face's (blk.N.<part> -> model.layers.N.<ours>)
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def is_gguf(model: str) -> bool:
    return str(model).endswith(".gguf") and os.path.isfile(model)


def gguf_config(reader: GGUFReader) -> PretrainedConfig:
    """The Hugging Face config the file's metadata describes (Llama, Qwen2 or Qwen3); anything else, and a tensor of
    a type the engine does not run or with no place in the model, is refused here, before anything is built."""
    path = reader.data.filename
    architecture = field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    config_class, model_class = ARCHITECTURES[architecture]

    def key(name: str, default=None):
        return field(reader, f"{architecture}.{name}", default)

    rope_scaling = key("rope.scaling.type", "none")
    if rope_scaling != "none":
        raise ValueError(f"{path}: {architecture}.rope.scaling.type {rope_scaling!r} is not supported in a GGUF file "
                         "(Llama 3.1's scaling, a rope_freqs.weight tensor, is)")
    for tensor in model_tensors(reader):
        check_type(tensor.name, tensor.tensor_type)
        hf_name(tensor.name)
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    file_type = field(reader, "general.file_type", None)
    config = config_class(
        architectures=[model_class], hidden_size=hidden, intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"), num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length", hidden // heads), max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)},
        vocab_size=key("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=field(reader, "tokenizer.ggml.eos_token_id", None),
        dtype=AUTO_DTYPES.get(file_type, "bfloat16"))
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FACTORS), None)
    if rope_freqs is not None:  # set after validation: Hugging Face's rope parameters have no such key
        factors = as_float32(rope_freqs.data, rope_freqs.tensor_type).flatten().tolist()
        if len(factors) != config.head_dim // 2:
            raise ValueError(f"{path}: {ROPE_FACTORS} holds {len(factors)} factors, not head_dim / 2 = "
                             f"{config.head_dim // 2}")
        config.rope_parameters["frequency_factors"] = factors
    return config


def model_tensors(reader: GGUFReader) -> list:
    """The file's tensors that are the model's weights (all but Llama 3.1's rope factors)."""
    return [tensor for tensor in reader.tensors if tensor.name != ROPE_FACTORS]


def gguf_tokenizer(reader: GGUFReader) -> PreTrainedTokenizerFast:
    """The tokenizer AutoTokenizer.from_pretrained(folder, gguf_file=...) builds, from the metadata already read:
    transformers' GGUF converter builds it, fed as its get_gguf_tokenizer feeds it."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    tokenizer, options = (tokenizer_fields(reader, GGUF_TOKENIZER_MAPPING[group])
                          for group in ("tokenizer", "tokenizer_config"))
    if tokenizer.get("tokenizer_type") == "llama":
        options.setdefault("add_bos_token", True)  # llama.cpp's default for a sentencepiece vocabulary
    for name in ("bos", "eos", "unk", "pad"):
        token_id = tokenizer.get(f"{name}_token_id")
        options[f"{name}_token"] = None if token_id is None else tokenizer["tokens"][token_id]
    backend, extra = convert_gguf_tokenizer(field(reader, "general.architecture"), tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=reader.data.filename, **options, **extra)


def tokenizer_fields(reader: GGUFReader, renames: dict[str, str]) -> dict:
    """The file's tokenizer.<key> fields it holds, under transformers' names (``renames``: key -> name)."""
    return {name: field(reader, f"tokenizer.{key}") for key, name in renames.items()
            if f"tokenizer.{key}" in reader.fields}


def field(reader: GGUFReader, name: str, default=...):
    if name in reader.fields:
        return reader.fields[name].contents()
    if default is ...:
        raise ValueError(f"{reader.data.filename}: the metadata lacks {name!r}")
    return default


def hf_name(gguf_name: str) -> str:
    """Hugging Face's name for a tensor of the file (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight);
    a tensor the Llama family has no place for is refused by name."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def check_type(gguf_name: str, tensor_type: Type) -> None:
    if tensor_type not in FOUR_BIT_TYPES | EIGHT_BIT_TYPES | FLOAT_TYPES:
        supported = ", ".join(t.name for t in sorted(FOUR_BIT_TYPES | EIGHT_BIT_TYPES | FLOAT_TYPES))
        raise ValueError(f"GGUF tensor {gguf_name!r} is {tensor_type.name}, a type the engine does not run "
                         f"(it runs {supported})")


def as_float32(data: np.ndarray, tensor_type: Type) -> torch.Tensor:
    """A tensor's values, dequantized, in float32 [rows, columns] (Hugging Face's [out, in] for a weight)."""
    return torch.from_numpy(np.array(dequantize(data, tensor_type), dtype=np.float32))


def four_bit(data: np.ndarray, tensor_type: Type) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0, Q4_1 or Q4_K weight [rows, columns] as its 4-bit values (each in 0..15, uint8 [rows, columns]) and a
    float16 scale and minimum per 32 columns: value = scale * q + minimum.

    Q4_0 and Q4_1 hold exactly that (Q4_0's minimum is -8 * scale). Q4_K holds a 6-bit scale and minimum per 32
    times a float16 one per 256: their float32 products are rounded to float16 here."""
    raw = torch.from_numpy(np.array(data))
    rows = raw.shape[0]
    if tensor_type == Type.Q4_K:
        blocks = raw.view(rows, -1, 144)
        d, dmin = (blocks[..., at:at + 2].contiguous().view(torch.float16).float() for at in (0, 2))
        scales, mins = (torch.from_numpy(part.astype(np.uint8)).view(rows, -1, 8).float()
                        for part in Q4_K.get_scale_min(blocks[..., 4:16].numpy().reshape(-1, 12)))
        nibbles = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 x 32 bytes: the low and high halves of 64 values
        q = torch.cat((nibbles & 15, nibbles >> 4), dim=3).reshape(rows, -1)
        return q, (d * scales).half().view(rows, -1), (-dmin * mins).half().view(rows, -1)
    header = 2 if tensor_type == Type.Q4_0 else 4
    blocks = raw.view(rows, -1, header + 16)
    scale, minimum = (blocks[..., at:at + 2].contiguous().view(torch.float16).view(rows, -1) for at in (0, 2))
    minimum = -8 * scale if tensor_type == Type.Q4_0 else minimum
    nibbles = blocks[..., header:].unsqueeze(2)  # 16 bytes: values 0..15 in the low halves, 16..31 in the high
    return torch.cat((nibbles & 15, nibbles >> 4), dim=2).reshape(rows, -1), scale, minimum

