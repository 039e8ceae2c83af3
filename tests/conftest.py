"""Shared fixtures: tiny random models built from transformers' own configs, and the real SmolLM2."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from nanoengine import LLM
from nanoengine.utils.default_model import default_model_path

# `make test-fast` (`pytest -m "not slow"`) leaves these out: they start processes (servers, engine cores,
# tensor-parallel workers, CLIs), load the real model's weights, interpret Triton kernels on the CPU, or search
# many random schedules.
SLOW_MODULES = {"test_server", "test_server_hostile", "test_data_parallel", "test_multinode", "test_tensor_parallel",
                "test_real_model", "test_vllm_parity", "test_vllm_examples", "test_default_model", "test_docs",
                "test_triton_attention", "test_triton_end_to_end", "test_cpu_memory", "test_prefix_report",
                "test_invariants"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB_SIZE = 49152  # SmolLM2's, so the tiny models can share its tokenizer and take text prompts

TINY = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, head_dim=16, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; on a small shared machine two thread pools fight over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    return default_model_path()


def build_tiny_model(arch: str, folder, tokenizer_dir: str, seed: int = 0, **config_overrides):
    """Save a random model of ``arch`` (with SmolLM2's tokenizer) to ``folder``; return the HF model.

    Biases get random values too (transformers starts them at zero, which would hide a missing one).
    """
    torch.manual_seed(seed)
    config = TINY_CONFIGS[arch]()
    config.update(config_overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.5)
    model.generation_config.eos_token_id = None  # random weights: never stop early in transformers either
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{tokenizer_dir}/{name}", folder)
    return model


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_model(request, tmp_path_factory, smollm2_dir):
    """(arch, folder, transformers model) for each tiny architecture."""
    arch = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{arch}")
    return arch, str(folder), build_tiny_model(arch, folder, smollm2_dir)


@pytest.fixture(scope="session")
def sharp_tiny_model(tmp_path_factory, smollm2_dir):
    """(folder, transformers model): a tiny Llama whose large random weights make each greedy token depend on
    the context (the default init repeats one token), so a wrong KV entry shows up in the output."""
    folder = tmp_path_factory.mktemp("tiny-sharp-llama")
    return str(folder), build_tiny_model("llama", folder, smollm2_dir, initializer_range=0.5)


# The sharp tiny Llama as an engine, for the API tests (a module that defines its own ``llm`` uses that one).
@pytest.fixture(scope="module")
def folder(sharp_tiny_model):
    return sharp_tiny_model[0]


@pytest.fixture(scope="module")
def hf_model(sharp_tiny_model):
    return sharp_tiny_model[1]


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(folder, max_model_len=128, num_kvcache_blocks=64) as llm:
        yield llm


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """transformers' own greedy continuation of one prompt, remembered on the model (which is never modified),
    so that the memory lives and dies with it."""
    remembered = model.__dict__.setdefault("greedy_continuations", {})
    key = (tuple(prompt_ids), max_new_tokens, eos_token_id)
    if key not in remembered:
        remembered[key] = run_hf_greedy(model, prompt_ids, max_new_tokens, eos_token_id)
    return remembered[key]


def run_hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def keep_every_draft(engine) -> None:
    """Turn off the step-cost cut of drafts (spec_decode.worth_drafting): on a busy machine its timings could
    cut the drafts a test counts on; what the cut decides is tested in tests/test_spec_decode.py."""
    engine.drafter.step_cost.fit = lambda: None
