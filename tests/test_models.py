"""Every model path, token for token against transformers' greedy generate on the same weights."""

import random

import pytest
import torch
from conftest import build_tiny_model, hf_greedy

from nanoengine import LLM, SamplingParams
from nanoengine.layers.linear import choose_linear_kernels

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
def test_the_layers_in_one_call_give_the_python_layers_logits_bit_for_bit(tiny_model, dtype):
    _, folder, hf_model = tiny_model
    check_layers_in_one_call(folder, hf_model, dtype)


def test_the_layers_in_one_call_add_every_attention_bias(tmp_path, smollm2_dir):
    check_layers_in_one_call(str(tmp_path), build_tiny_model("llama", tmp_path, smollm2_dir, attention_bias=True),
                             "float32")


def check_layers_in_one_call(folder: str, hf_model, dtype: str) -> None:
    """With every linear layer on cpu_linear.cpp's kernel, each step's decoder layers run as one C++ call
    (prefill, chunked prefill and decode steps, and steps that mix them): its logits are those of the layers'
    Python forward to the bit, and in float32 its tokens are transformers'."""
    with LLM(folder, dtype=dtype, max_model_len=256, max_num_batched_tokens=48) as llm:
        runner = llm.llm_engine.model_executor.runner
        if dtype not in runner.cpu_ops.linear_dtypes():
            pytest.skip(f"this CPU cannot run cpu_linear.cpp's kernel in {dtype}, so the layers never run in one call")
        choose_linear_kernels(runner.model, "avx512", runner.cpu_ops)
        runner.use_layers_in_one_call()
        decoder, one_call = runner.model.model, runner.model.model.layers_in_one_call
        assert one_call is not None and all(one_call.runs_at)
        forward, step_kinds = runner.forward, set()

        def forward_both_ways(inputs):
            logits = forward(inputs)
            decoder.layers_in_one_call = None
            try:
                assert torch.equal(forward(inputs), logits)
            finally:
                decoder.layers_in_one_call = one_call
            step_kinds.add(tuple(sorted({len(ids) > 1 for ids in inputs.token_ids})))
            return logits

        runner.forward = forward_both_ways
        if dtype == "float32":
            check_against_transformers(llm, hf_model, prompts_of_different_lengths())
        else:
            llm.generate(prompts_of_different_lengths(), GREEDY, use_tqdm=False)
        assert {(False,), (False, True)} <= step_kinds, "no decode-only step, or no step with prompt rows in it"
