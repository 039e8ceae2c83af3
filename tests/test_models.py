"""Every model path, token for token against transformers' greedy generate on the same weights."""

import random

import pytest
import torch
from conftest import build_tiny_model, hf_greedy, keep_every_draft
from transformers import LlamaConfig

from nanoengine import LLM, SamplingParams
from nanoengine.models.llama import LlamaForCausalLM
from nanoengine.platforms.cpu.linear import choose_linear_kernels

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts_of_different_lengths(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1000, 40000) for _ in range(40)]
    lengths = [1, 7, 16, 17, 33, 70]
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]
    return prompts + [shared + [5, 6, 7], shared + [8, 9]]  # two that share 2.5 blocks


def check_against_transformers(llm: LLM, hf_model, prompts: list[list[int]]) -> None:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
        assert output.outputs[0].finish_reason == "length"


def test_batch_matches_transformers(tiny_model):
    _, folder, hf_model = tiny_model
    with LLM(folder, max_model_len=256) as llm:
        check_against_transformers(llm, hf_model, prompts_of_different_lengths())
        check_against_transformers(llm, hf_model, prompts_of_different_lengths())  # again, from the prefix cache
        assert llm.stats().prefix_cache_hits > 0


def test_chunked_prefill_matches_transformers(tiny_model):
    _, folder, hf_model = tiny_model
    with LLM(folder, max_model_len=256, max_num_batched_tokens=24) as llm:
        chunks = record_prompt_chunks(llm)
        check_against_transformers(llm, hf_model, prompts_of_different_lengths())
        assert max(sum(n for _, n, _ in step) for step in chunks) <= 24
        assert any(0 < start < prompt_len for step in chunks for start, _, prompt_len in step), "no prompt was split"


def record_prompt_chunks(llm: LLM) -> list[list[tuple[int, int, int]]]:
    """Per step: (first token computed, tokens computed, prompt length) of each scheduled request."""
    steps = []
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append([(r.num_computed_tokens, n, r.num_prompt_tokens)
                      for r, n in zip(out.requests, out.num_new_tokens)])
        return out

    scheduler.schedule = recording_schedule
    return steps


def test_preemption_matches_transformers(tiny_model):
    _, folder, hf_model = tiny_model
    with LLM(folder, max_model_len=128, num_kvcache_blocks=8, enable_prefix_caching=False) as llm:
        check_against_transformers(llm, hf_model, prompts_of_different_lengths()[1:6])
        assert llm.stats().num_preemptions > 0
        assert llm.stats().num_free_blocks == 8


def test_llama_with_attention_bias_matches_transformers(tmp_path, smollm2_dir):
    """attention_bias=True biases q, k, v and o in Llama; random biases make a missing one visible."""
    hf_model = build_tiny_model("llama", tmp_path, smollm2_dir, attention_bias=True)
    with LLM(str(tmp_path), max_model_len=256) as llm:
        check_against_transformers(llm, hf_model, prompts_of_different_lengths()[2:5])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_layers_in_one_call_match_the_python_layers_bit_for_bit(tiny_model, dtype):
    _, folder, hf_model = tiny_model
    assert check_layers_in_one_call(folder, hf_model, dtype) >= {"decode", "prompt"}


def test_the_layers_in_one_call_take_int8_weights(tiny_model):
    """quantization="int8": each linear layer's int8 weight and scale, the same bits as the layers' forward."""
    _, folder, hf_model = tiny_model
    assert check_layers_in_one_call(folder, hf_model, "bfloat16", quantization="int8") >= {"decode", "prompt"}


def test_the_layers_in_one_call_take_int4_weights(tiny_model):
    """quantization="int4": each linear layer's 4-bit weight, group scales and minimums, the same bits as the
    layers' forward."""
    _, folder, hf_model = tiny_model
    assert check_layers_in_one_call(folder, hf_model, "bfloat16", quantization="int4") >= {"decode", "prompt"}


def test_the_layers_in_one_call_add_every_attention_bias(tmp_path, smollm2_dir):
    check_layers_in_one_call(str(tmp_path), build_tiny_model("llama", tmp_path, smollm2_dir, attention_bias=True),
                             "float32")


@pytest.mark.parametrize("tiny_model", ["llama", "qwen3"], indirect=True)
def test_the_layers_in_one_call_read_and_write_an_int8_cache(tiny_model):
    _, folder, hf_model = tiny_model
    assert check_layers_in_one_call(folder, hf_model, "float32", kv_cache_dtype="int8") >= {"decode", "prompt"}


@pytest.mark.parametrize("tiny_model", ["qwen3"], indirect=True)
def test_the_layers_in_one_call_verify_drafts(tiny_model):
    """The tiny Qwen3's greedy tokens soon repeat, so the n-gram proposer drafts."""
    _, folder, hf_model = tiny_model
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    prompts = [list(range(1000, 1012)) * 3, [17, 23] * 4]
    assert "drafts" in check_layers_in_one_call(folder, hf_model, "float32", prompts, speculative_config=speculative)


def check_layers_in_one_call(folder: str, hf_model, dtype: str, prompts: list[list[int]] | None = None,
                             **options) -> set[str]:
    """With every linear layer on cpu_linear.cpp's kernel, each step's decoder layers run as one C++ call: every
    row's output and every KV cache entry the step writes are those of the layers' Python forward to the bit, and
    in float32 the tokens are transformers'. Returns the kinds of rows the steps had (decode, prompt, drafts)."""
    with LLM(folder, dtype=dtype, device="cpu", max_model_len=256, max_num_batched_tokens=48, num_kvcache_blocks=64,
             **options) as llm:  # the CPU's path, on a GPU machine too
        keep_every_draft(llm.llm_engine)
        runner = llm.llm_engine.model_executor.runner
        cpu_ops = runner.platform.kernels
        assert cpu_ops is not None, "the C++ kernels did not build: see the warning logged above"
        choose_linear_kernels(runner.model, "tiled", cpu_ops)
        runner.fast_path = one_call = runner.capture_fast_path()
        assert one_call is not None and all(one_call.runs_at)
        run, kinds = one_call.run, set()

        def forward_both_ways(input_ids, positions, meta):
            caches = (runner.kv_cache, runner.kv_scales)  # the scales: empty unless the cache is int8
            before = [cache.clone() for cache in caches]
            hidden = run(input_ids, positions, meta)
            after = [cache.clone() for cache in caches]
            for cache, old in zip(caches, before):
                cache.copy_(old)
            assert torch.equal(runner.model(input_ids, positions, meta), hidden)
            assert all(torch.equal(cache, new) for cache, new in zip(caches, after))
            starts, drafts = meta.query_start_loc_cpu, meta.num_drafts
            kinds.update("decode" if b - a == 1 + d else "prompt" for a, b, d in zip(starts, starts[1:], drafts))
            kinds.update(["drafts"] * any(drafts))
            return hidden

        one_call.run = forward_both_ways
        prompts = prompts or prompts_of_different_lengths()
        if dtype == "float32" and "kv_cache_dtype" not in options:
            check_against_transformers(llm, hf_model, prompts)
        else:
            llm.generate(prompts, GREEDY, use_tqdm=False)
        return kinds


@pytest.mark.parametrize("feature", [{"sliding_window": 4096}, {"use_sliding_window": True, "sliding_window": 64},
                                     {"num_local_experts": 8}, {"num_experts": 8}])
def test_a_config_with_a_feature_the_decoder_lacks_fails_at_load(feature):
    """Mistral's sliding window (no use_sliding_window flag) and MoE layers would be silently ignored."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, **feature)
    with pytest.raises(ValueError, match="not supported"):
        LlamaForCausalLM(config)
    assert LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)) is not None
