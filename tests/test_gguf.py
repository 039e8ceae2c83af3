"""GGUF files (utils/gguf_file.py, platforms/cpu/gguf.py): a file the `gguf` package writes from a tiny random model
gives, token for token, what the same weights dequantized into a float32 folder give; the 4-bit layout holds the
file's values exactly; the shipped SmolLM2 file answers; every refusal names what it refuses."""

import json
import os
import pickle

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY_CONFIGS, build_tiny_model
from gguf import GGMLQuantizationType as Type
from gguf.quants import dequantize, quantize
from openai import OpenAI
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer

from benchmarks.serve import running_server
from nanoengine import LLM, SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.layers.rotary import inverse_frequencies
from nanoengine.models.llama import head_dim_of
from nanoengine.platforms.cpu.quantize import dequantize_int4, pack_int4
from nanoengine.quantization import quantize as quantize_int8
from nanoengine.utils.default_model import find_gguf
from nanoengine.utils.gguf_file import as_float32, four_bit, gguf_config, gguf_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
PROMPTS = [[1000 + 37 * i for i in range(n)] for n in (3, 17, 40)] + [[5, 6, 7, 8]]
ENGINE = dict(max_model_len=128, num_kvcache_blocks=32)
GGUF_PARTS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down", "q_norm": "attn_q_norm",
              "k_norm": "attn_k_norm", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# Each type a file holds, somewhere in the tiny models (the norms and biases are F32), and how the engine runs it:
# layer 0 all 4-bit; layer 1 q/k/v mixing F16 and 4-bit (so the model's dtype), o Q5_1 and gate/up mixing Q5_0 and
# 4-bit (int8); the embeddings Q8_0 (int8 where tied).
TYPES = {"model.embed_tokens.weight": Type.Q8_0, "lm_head.weight": Type.Q4_1,
         "model.layers.0.self_attn.q_proj.weight": Type.Q4_0, "model.layers.0.self_attn.k_proj.weight": Type.Q4_1,
         "model.layers.0.self_attn.v_proj.weight": Type.Q4_0, "model.layers.0.self_attn.o_proj.weight": Type.Q4_1,
         "model.layers.0.mlp.gate_proj.weight": Type.Q4_0, "model.layers.0.mlp.up_proj.weight": Type.Q4_0,
         "model.layers.0.mlp.down_proj.weight": Type.Q4_1,
         "model.layers.1.self_attn.q_proj.weight": Type.F16, "model.layers.1.self_attn.k_proj.weight": Type.Q4_0,
         "model.layers.1.self_attn.v_proj.weight": Type.Q4_1, "model.layers.1.self_attn.o_proj.weight": Type.Q5_1,
         "model.layers.1.mlp.gate_proj.weight": Type.Q5_0, "model.layers.1.mlp.up_proj.weight": Type.Q4_1,
         "model.layers.1.mlp.down_proj.weight": Type.F32}
INT8_LAYERS = ("model.layers.1.self_attn.o_proj.", "model.layers.1.mlp.gate_proj.", "model.layers.1.mlp.up_proj.")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def gguf_name(hf_name: str) -> str:
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}
    if hf_name in names:
        return names[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    module, kind = rest[-2], rest[-1]
    return f"blk.{layer}.{GGUF_PARTS[module]}.{kind}"


def permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a Llama's query or key rows (each head's two halves interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(path, arch: str, config, weights: dict[str, np.ndarray], types: dict) -> None:
    """A GGUF file as llama.cpp's converter writes one: metadata, SmolLM2's tokenizer, Llama 3.1's rope scaling as
    its factors, the weights in ``types`` (F32 where not named)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim_of(config))
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    tokenizer = gguf.GGUFReader(find_gguf()).fields
    writer.add_tokenizer_model(tokenizer["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(tokenizer["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokenizer["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(tokenizer["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(tokenizer["tokenizer.ggml.merges"].contents())
    writer.add_eos_token_id(tokenizer["tokenizer.ggml.eos_token_id"].contents())
    writer.add_chat_template(tokenizer["tokenizer.chat_template"].contents())
    if config.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim_of(config), config.rope_parameters))
    for name, weight in weights.items():
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            weight = permuted(weight, config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads)
        tensor_type = types.get(name, Type.F32)
        if tensor_type == Type.F32:
            writer.add_tensor(gguf_name(name), weight.astype(np.float32))
        elif tensor_type == Type.F16:
            writer.add_tensor(gguf_name(name), weight.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), quantize(weight, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """What llama.cpp's converter writes for Llama 3.1's rope scaling: each frequency's divisor, 1 for a wavelength
    shorter than the old context / high_freq_factor, ``factor`` for one longer than it / low_freq_factor, and
    blended between."""
    factor, low, high, context = (rope[key] for key in ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings"))
    wavelengths = 2 * np.pi * rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (context / wavelengths - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelengths < context / high, 1.0, np.where(wavelengths > context / low, factor, blended)).astype(
        np.float32)


def what_the_engine_runs(name: str, weight: np.ndarray, tensor_type) -> torch.Tensor:
    """The float32 weight the engine multiplies by for a tensor the file holds as ``tensor_type``."""
    if tensor_type == Type.F32:
        values = torch.from_numpy(weight)
    elif tensor_type == Type.F16:
        values = torch.from_numpy(weight.astype(np.float16)).float()
    else:
        values = torch.from_numpy(dequantize(quantize(weight, tensor_type), tensor_type))
    if name.startswith(INT8_LAYERS):
        q, scale = quantize_int8(values)
        return q.float() * scale.unsqueeze(1)
    return values


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def gguf_and_folder(request, tmp_path_factory, smollm2_dir):
    """(a GGUF file of a tiny random model, a float32 folder with the weights the engine runs from it)."""
    arch = request.param
    folder = tmp_path_factory.mktemp(f"gguf-{arch}")
    model = build_tiny_model(arch, folder, smollm2_dir, initializer_range=0.5)  # the Llama's rope: Llama 3.1's
    weights = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    path = folder.with_name(f"tiny-{arch}.gguf")
    write_gguf(path, arch, model.config, weights, TYPES)
    dequantized = {name: what_the_engine_runs(name, weight, TYPES.get(name, Type.F32))
                   for name, weight in weights.items()}
    if model.config.tie_word_embeddings:  # the engine's LM head: an int8 copy of the Q8_0 embeddings
        q, scale = quantize_int8(dequantized["model.embed_tokens.weight"])
        dequantized["lm_head.weight"] = q.float() * scale.unsqueeze(1)
    save_file(dequantized, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    return str(path), str(folder)


def run(model: str, **options):
    with LLM(model, **ENGINE, **options) as llm:
        completions = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        model = llm.llm_engine.model_executor.runner.model
        formats = {name: str(p.dtype).removeprefix("torch.") for name, p in model.named_parameters()
                   if name.endswith("proj.weight") or name == "lm_head.weight"}
        minimums = {name: hasattr(m, "weight_min") for name, m in model.named_modules() if name.endswith("proj")}
    return ([c.token_ids for c in completions],
            [[entry[token].logprob for token, entry in zip(c.token_ids, c.logprobs)] for c in completions], formats,
            minimums)


def test_a_gguf_file_gives_what_its_weights_dequantized_into_a_float32_folder_give(gguf_and_folder):
    path, folder = gguf_and_folder
    tokens, logprobs, formats, minimums = run(path, dtype="float32")
    assert formats["model.layers.0.self_attn.qkv_proj.weight"] == "uint8"  # 4-bit, two to a byte
    assert formats["model.layers.0.mlp.down_proj.weight"] == "uint8"
    assert formats["model.layers.0.mlp.gate_up_proj.weight"] == "uint8"  # all Q4_0: no minimums, they are -8 scale
    assert not minimums["model.layers.0.mlp.gate_up_proj"]
    assert minimums["model.layers.0.self_attn.qkv_proj"]  # Q4_0 beside Q4_1: Q4_0's minimums kept as -8 scale
    assert formats["model.layers.1.self_attn.qkv_proj.weight"] == "float32"  # F16 beside 4-bit: the model's dtype
    assert formats["model.layers.1.self_attn.o_proj.weight"] == "int8"  # Q5_1
    assert formats["model.layers.1.mlp.gate_up_proj.weight"] == "int8"  # Q5_0 beside 4-bit
    assert formats["lm_head.weight"] in ("int8", "uint8")  # the tied Q8_0 embeddings' copy, or output.weight's Q4_1
    expected_tokens, expected_logprobs, *_ = run(folder, dtype="float32")
    assert tokens == expected_tokens
    # The 4-bit kernel sums each group of 32 inputs as x q before its scale and minimum (cpu_linear.cpp's Int4),
    # whose float32 roundings move this sharp model's logprobs by up to 6.3e-5 (2.4e-4 when it summed x (1 + q/16)).
    for row, expected in zip(logprobs, expected_logprobs):
        assert row == pytest.approx(expected, abs=2e-4)


@pytest.mark.parametrize("gguf_and_folder", ["llama"], indirect=True)
def test_nanoengine_serve_runs_a_gguf_file_as_llm_does(gguf_and_folder):
    """The file served as it is: listed by its name, and the openai client's completion and chat get the offline
    engine's text (the chat through the file's own template)."""
    path = gguf_and_folder[0]
    messages = [{"role": "user", "content": "Name a colour."}]
    with LLM(path, **ENGINE) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        expected = [llm.generate(["The cat sat on"], greedy, use_tqdm=False)[0].outputs[0].text,
                    llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text]
    with running_server(path, "--max-model-len", str(ENGINE["max_model_len"])) as (_, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [os.path.basename(path)]
        options = dict(model=os.path.basename(path), temperature=0, max_tokens=8, extra_body={"ignore_eos": True})
        completion = client.completions.create(prompt="The cat sat on", **options).choices[0].text
        chat = client.chat.completions.create(messages=messages, **options).choices[0].message.content
    assert [completion, chat] == expected and all(expected)


def test_a_gguf_file_reads_its_config_and_tokenizer(gguf_and_folder):
    path, folder = gguf_and_folder
    with LLM(path, **ENGINE) as from_file, LLM(folder, **ENGINE) as from_folder:
        ours, theirs = from_file.config.hf_config, from_folder.config.hf_config
        for key in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "vocab_size"):
            assert getattr(ours, key) == getattr(theirs, key), key
        assert head_dim_of(ours) == head_dim_of(theirs)
        assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-7)  # GGUF holds it in float32
        assert from_file.config.torch_dtype == torch.bfloat16  # "auto" for a quantized file
        chat = [{"role": "user", "content": "Hello there, what is 2 + 2?"}]
        ours, theirs = (llm.get_tokenizer() for llm in (from_file, from_folder))
        text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.encode(text) == theirs.encode(text)


def test_a_gguf_file_is_parsed_once_per_process(gguf_and_folder, monkeypatch):
    parses = []
    parse = gguf.GGUFReader.__init__

    def counted(reader, path, *args, **kwargs):
        parses.append(path)
        parse(reader, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    with LLM(gguf_and_folder[0], **ENGINE) as llm:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert parses == [gguf_and_folder[0]]  # the config, the tokenizer and the weights from one reader
        # A server's engine core gets the config pickled: without the reader (the file's bytes), which it reads anew.
        received = pickle.loads(pickle.dumps(llm.config))
    assert len(pickle.dumps(llm.config)) < 100_000 and received.gguf_reader is None
    assert received.gguf() is received.gguf() and len(parses) == 2


def test_the_tokenizer_from_the_parsed_file_is_transformers_own():
    path = str(find_gguf())
    ours = gguf_tokenizer(EngineConfig(path).gguf())
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = ["What is the capital of France?", "  Été, naïve café 🙂\n\tdef f(x): return x**2  # 123456",
             "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
    assert [ours.encode(text) for text in texts] == [theirs.encode(text) for text in texts]
    assert ours.chat_template == theirs.chat_template and ours.chat_template
    chat = [{"role": "user", "content": "Hello there"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, add_generation_prompt=True)
    for token in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(ours, token) == getattr(theirs, token) is not None, token
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder and len(ours) == len(theirs)


# The 4-bit layout holds the file's values ---------------------------------------------------------------------------

@pytest.mark.parametrize("tensor_type", [Type.Q4_0, Type.Q4_1])
def test_q4_0_and_q4_1_are_kept_exactly(tensor_type):
    weight = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32) * 3
    data = quantize(weight, tensor_type)
    q, scale, minimum = four_bit(data, tensor_type)
    ours = dequantize_int4(pack_int4(q, 32), scale, minimum)
    assert torch.equal(ours, torch.from_numpy(dequantize(data, tensor_type)))


def test_q4_k_keeps_its_values_and_rounds_its_sub_block_scales_to_float16():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(16, 2, 144), dtype=np.uint8)  # any bytes are a Q4_K block's
    blocks[..., 0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)  # but d and dmin
    data = blocks.reshape(16, -1)
    q, scale, minimum = four_bit(data, Type.Q4_K)
    ours = dequantize_int4(pack_int4(q, 32), scale, minimum).double()
    exact = torch.from_numpy(dequantize(data, Type.Q4_K)).double()
    # each of d * scale and dmin * min is rounded once to float16: half a unit in 11 bits
    bound = (15 * scale.double().abs() + minimum.double().abs()).repeat_interleave(32, dim=1) * 2.0**-11
    assert ((ours - exact).abs() <= bound).all() and not torch.equal(ours, exact)


# The shipped file -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_shipped_smollm2_file_answers_from_its_4_bit_weights(smollm2_dir):
    with LLM(str(find_gguf()), max_model_len=256, num_kvcache_blocks=32) as llm:
        answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
        weight_bytes = llm.stats().weight_bytes
    assert "Paris" in answer
    with safe_open(f"{smollm2_dir}/model.safetensors", framework="pt") as f:
        bfloat16_bytes = 2 * sum(np.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert weight_bytes <= 0.6 * bfloat16_bytes


# Refusals -------------------------------------------------------------------------------------------------------------

def minimal_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, Type]], strings: dict | None = None) -> str:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 64, "feed_forward_length": 128,
                       "attention.head_count": 4}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_token_list(["a", "b"])
    for name, (values, tensor_type) in tensors.items():
        if tensor_type == Type.F32:
            writer.add_tensor(name, values)
        else:  # bytes as they are, or values to quantize
            data = values if values.dtype == np.uint8 else quantize(values, tensor_type)
            writer.add_tensor(name, data, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_an_architecture_other_than_llama_qwen2_qwen3_is_refused_by_name(tmp_path):
    path = minimal_gguf(tmp_path / "gpt2.gguf", "gpt2", {})
    with pytest.raises(ValueError, match=r"general.architecture 'gpt2' is not supported \(supported: llama, qwen2"):
        LLM(path)


@pytest.mark.parametrize("tensor_type", [Type.MXFP4, Type.TQ1_0])  # types the gguf package writes
def test_a_weight_type_the_engine_does_not_run_is_refused_naming_the_tensor(tmp_path, tensor_type):
    weight = np.ones((64, 256), dtype=np.float32)
    path = minimal_gguf(tmp_path / "refused.gguf", "qwen3", {"blk.0.attn_q.weight": (weight, tensor_type)})
    with pytest.raises(ValueError, match=f"GGUF tensor 'blk.0.attn_q.weight' is {tensor_type.name}, a type the "
                                         "engine does not run"):
        LLM(path)


def test_q5_k_is_taken_and_read_from_the_file_as_its_values(tmp_path):
    """The gguf package cannot write Q5_K: random blocks (any bytes are one's but d and dmin), written as they are,
    read back as the loader reads them, against transformers' own Q5_K dequantizer."""
    from transformers.integrations.gguf.dequant import dequantize as transformers_dequantize

    blocks = np.random.default_rng(2).integers(0, 256, size=(8, 2, 176), dtype=np.uint8)
    blocks[..., 0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    path = minimal_gguf(tmp_path / "q5_k.gguf", "qwen3", {"blk.0.attn_q.weight": (blocks.reshape(8, -1), Type.Q5_K)})
    reader = EngineConfig(path).gguf()  # not refused
    tensor = reader.tensors[0]
    expected = transformers_dequantize(torch.from_numpy(blocks.reshape(-1)), Type.Q5_K).reshape(8, 512)
    assert torch.allclose(as_float32(tensor.data, tensor.tensor_type), expected, rtol=1e-6, atol=1e-7)


def test_a_tensor_with_no_place_in_the_model_is_refused_by_name(tmp_path):
    weight = np.ones((64, 64), dtype=np.float32)
    path = minimal_gguf(tmp_path / "experts.gguf", "qwen2", {"blk.0.ffn_gate_exps.weight": (weight, Type.F32)})
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.ffn_gate_exps.weight' has no place"):
        LLM(path)


def test_llama_3_1_rope_factors_scale_the_frequencies_and_other_rope_scaling_is_refused(tmp_path):
    rope = TINY_CONFIGS["llama"]().rope_parameters | {"rope_theta": 10000.0}  # the file's: it sets no freq_base
    factors = llama3_rope_factors(16, rope)
    assert factors.min() == 1 and factors.max() == rope["factor"] and len(set(factors.tolist())) > 2  # all 3 kinds
    config = gguf_config(gguf.GGUFReader(minimal_gguf(tmp_path / "llama3.gguf", "llama", {
        "rope_freqs.weight": (factors, Type.F32)})))
    assert inverse_frequencies(16, config.rope_parameters).tolist() == pytest.approx(
        inverse_frequencies(16, rope).tolist(), rel=1e-6)
    path = minimal_gguf(tmp_path / "odd.gguf", "llama", {"rope_freqs.weight": (np.ones(5, np.float32), Type.F32)})
    with pytest.raises(ValueError, match="rope_freqs.weight holds 5 factors, not head_dim / 2 = 8"):
        LLM(path)
    path = minimal_gguf(tmp_path / "linear.gguf", "llama", {}, {"llama.rope.scaling.type": "linear"})
    with pytest.raises(ValueError, match="llama.rope.scaling.type 'linear' is not supported"):
        LLM(path)


def test_a_gguf_file_runs_on_one_cpu_rank(gguf_and_folder):
    with pytest.raises(ValueError, match="a GGUF file runs on the CPU on one rank"):
        LLM(gguf_and_folder[0], tensor_parallel_size=2)


def test_a_folder_without_config_names_both_ways_in(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config.json in .* \(nor is it a .gguf file\)"):
        LLM(str(tmp_path))
