"""Every model path, token for token against transformers' greedy generate on the same weights."""

import random

from conftest import build_tiny_model, hf_greedy

from nanoengine import LLM, SamplingParams

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
