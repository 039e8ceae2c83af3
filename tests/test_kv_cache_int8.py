"""The int8 KV cache (``kv_cache_dtype="int8"``) in the engine: the option, the cache's size, the quantizer, and
outputs next to those of a cache in the model's dtype (the kernels on the same bytes are in test_cpu_attention.py
and test_triton_attention.py)."""

import logging

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.attention import torch_backend
from nanoengine.config import EngineConfig
from nanoengine.platforms.cpu import build
from nanoengine.quantization import quantize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Teacher-forced: the logprob of each prompt token, so the runs compare position by position.
PROMPT_LOGPROBS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
PROMPTS = [list(range(1000, 1000 + n)) for n in (90, 37, 5)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def token_logprobs(llm: LLM, prompts=PROMPTS) -> torch.Tensor:
    outputs = llm.generate(prompts, PROMPT_LOGPROBS, use_tqdm=False)
    return torch.tensor([entry[token].logprob for prompt, output in zip(prompts, outputs)
                         for token, entry in zip(prompt[1:], output.prompt_logprobs[1:])])


def test_the_quantizer_rounds_half_to_even_and_keeps_zero_vectors_finite():
    # absmax 127: the scale is exactly 1, so each value is its own quotient.
    x = torch.tensor([[127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.49, -127.0], [0.0] * 8])
    q, scales = quantize(x)
    assert q.tolist() == [[127, 2, -4, 0, 0, 2, 126, -127], [0] * 8]
    assert scales.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 24])  # 24: the kernel's vector loop, then its scalar tail
def test_the_kernel_quantizes_to_the_oracles_bytes(dtype, head_dim):
    kernels = build.load_cpu_kernels()
    assert kernels is not None, "the C++ kernels did not build: see the warning logged above"
    gen = torch.Generator().manual_seed(head_dim)
    # Many ties: values on a grid of halves against a scale of 1 (absmax 127), then random vectors, a zero one.
    ties = torch.randint(-254, 255, (64, 2, head_dim), generator=gen) / 2
    ties[..., 0] = 127
    x = torch.cat([ties, torch.randn(4000, 2, head_dim, generator=gen), torch.zeros(1, 2, head_dim)]).to(dtype)
    slots = torch.randperm(len(x), generator=gen)
    slots[::7] = -1  # padding rows store nothing
    caches = [torch.full((len(x) // 16 + 1, 16, 2, head_dim), 99, dtype=torch.int8) for _ in range(4)]
    scales = [torch.full(c.shape[:3], float("nan")) for c in caches]
    torch_backend.store_kv(x, -x, caches[0], caches[1], slots, scales[0], scales[1])
    kernels.store_kv(x, -x, caches[2], caches[3], slots, scales[2], scales[3])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    torch.testing.assert_close(scales[2], scales[0], atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(scales[3], scales[1], atol=0, rtol=0, equal_nan=True)


def test_fp8_and_unknown_cache_dtypes_are_refused_naming_the_option(folder):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e4m3' is not offered: .*accuracy target.*"
                                         r"docs/kv-cache-quantization\.md.*pass "
                                         r"kv_cache_dtype='int8'"):
        EngineConfig(model=folder, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8'\), got 'int4'"):
        EngineConfig(model=folder, kv_cache_dtype="int4")


def test_the_same_memory_holds_more_blocks_of_int8(folder, caplog):
    """The tiny Llama: 2 layers, 2 KV heads of 16 dimensions; in bfloat16 a token's head takes 32 bytes, in int8
    16 and a 4-byte scale."""
    space_gib, blocks = 0.01, {}
    for cache_dtype in ("auto", "int8"):
        with caplog.at_level(logging.INFO, logger="nanoengine.engine.model_runner"), \
                LLM(folder, dtype="bfloat16", kv_cache_dtype=cache_dtype, cpu_kvcache_space_gib=space_gib,
                    max_model_len=512) as llm:
            blocks[cache_dtype] = llm.llm_engine.model_executor.runner.num_kvcache_blocks
    bytes_per_block = {"auto": 2 * 2 * 16 * 2 * 32, "int8": 2 * 2 * 16 * 2 * (16 + 4)}
    assert blocks == {name: int(space_gib * 2**30) // size for name, size in bytes_per_block.items()}
    assert "int8 with float32 scales: 1.60x the blocks of torch.bfloat16" in caplog.text


@pytest.mark.parametrize("tiny_model", ["llama", "qwen3"], indirect=True)
def test_an_int8_cache_stays_near_float32_through_the_prompt_and_decode_kernels(tiny_model):
    """Every prompt token's logprob, teacher-forced, next to a float32 cache's; prompts in whole (the prompt
    kernel) and one token a step (the decode kernel) read the same int8 bytes and agree closely."""
    _, folder, _ = tiny_model
    options = dict(dtype="float32", max_model_len=256, num_kvcache_blocks=64, enable_prefix_caching=False)
    with LLM(folder, **options) as llm:
        plain = token_logprobs(llm)
    with LLM(folder, kv_cache_dtype="int8", **options) as llm:
        whole = token_logprobs(llm)
    with LLM(folder, kv_cache_dtype="int8", long_prefill_token_threshold=1, **options) as llm:
        one_by_one = token_logprobs(llm)
    assert 0 < (whole - plain).abs().max() < 0.01
    torch.testing.assert_close(one_by_one, whole, atol=1e-4, rtol=0)


def test_a_cached_prefix_and_a_preempted_request_give_the_tokens_of_a_fresh_run(folder):
    prompts = [list(range(2000, 2040)) + [7 * i + 1, 7 * i + 2] for i in range(4)]
    options = dict(kv_cache_dtype="int8", dtype="float32", max_model_len=128)
    with LLM(folder, num_kvcache_blocks=64, enable_prefix_caching=False, **options) as llm:
        fresh = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(folder, num_kvcache_blocks=64, **options) as llm:
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.num_cached_tokens == 32 for o in outputs)  # two full blocks of the shared 40 tokens
        cached = [o.outputs[0] for o in outputs]
    with LLM(folder, num_kvcache_blocks=8, max_num_batched_tokens=32, **options) as llm:
        preempted = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.stats().num_preemptions > 0
    for run in (cached, preempted):
        assert [c.token_ids for c in run] == [c.token_ids for c in fresh]
        torch.testing.assert_close(logprobs_of(run), logprobs_of(fresh), atol=1e-4, rtol=0)


def logprobs_of(completions) -> torch.Tensor:
    return torch.tensor([entry[token].logprob for c in completions for token, entry in zip(c.token_ids, c.logprobs)])


def test_smollm2_greedy_with_an_int8_cache_agrees_with_bfloat16(smollm2_dir):
    """A disagreement is allowed only where bfloat16's top two tokens were near-ties (bfloat16 logits tie
    exactly now and then: a unit in their last place is 1/8 at 16); the message shows the gap."""
    prompts = [[{"role": "user", "content": text}] for text in (
        "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
        "Explain in one sentence what a CPU cache is.")]
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    runs = {}
    for cache_dtype in ("auto", "int8"):
        with LLM(smollm2_dir, dtype="bfloat16", kv_cache_dtype=cache_dtype, max_model_len=512,
                 num_kvcache_blocks=64) as llm:
            runs[cache_dtype] = [o.outputs[0] for o in llm.chat(prompts, params, use_tqdm=False)]
    for plain, quantized in zip(runs["auto"], runs["int8"]):
        first_difference = next((i for i, (a, b) in enumerate(zip(plain.token_ids, quantized.token_ids)) if a != b),
                                None)
        if first_difference is None:
            continue
        top_two = sorted((lp.logprob for lp in plain.logprobs[first_difference].values()), reverse=True)[:2]
        gap = top_two[0] - top_two[1]
        assert gap < 0.25, f"token {first_difference} differs where bfloat16's top two were {gap:.3f} apart: " \
                          f"{plain.text!r} against {quantized.text!r}"
