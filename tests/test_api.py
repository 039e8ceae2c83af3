"""The one-call API: options, prompt forms, validation that leaves the engine untouched, stats."""

import math

import pytest
from conftest import build_tiny_model

from nanoengine import LLM, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_dir):
    path = tmp_path_factory.mktemp("tiny-qwen3-api")
    build_tiny_model("qwen3", path, smollm2_dir)
    return str(path)


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(folder, max_model_len=128, num_kvcache_blocks=64) as llm:
        yield llm


def test_unknown_option_raises_type_error_naming_it(folder):
    with pytest.raises(TypeError, match="max_num_seq_typo"):
        LLM(folder, max_num_seq_typo=3)


@pytest.mark.parametrize("options, field", [
    ({"dtype": "float8"}, "dtype"), ({"device": "tpu"}, "device"), ({"max_model_len": 10**6}, "max_model_len"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"kvcache_block_size": 0}, "kvcache_block_size"),
    ({"num_kvcache_blocks": 0}, "num_kvcache_blocks"), ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"prefix_caching_hash_algo": "md5"}, "prefix_caching_hash_algo"),
    ({"attention_backend": "flash"}, "attention_backend"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
    ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens"),
])
def test_bad_option_names_the_field(folder, options, field):
    with pytest.raises((ValueError, TypeError), match=field):
        LLM(folder, **options)


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path), max_model_len=64)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"seed": "x"}, "seed"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"n": 0}, "n"), ({"logprobs": -1}, "logprobs"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"), ({"stop": [""]}, "stop"),
    # What a JSON body can smuggle in: non-finite floats, ints beyond int64, a temperature that overflows.
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": 1e-45}, "temperature"), ({"min_p": math.nan}, "min_p"), ({"top_p": math.nan}, "top_p"),
    ({"presence_penalty": math.nan}, "presence_penalty"), ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"), ({"top_k": 2**63}, "top_k"),
    ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"max_tokens": 2**64}, "max_tokens"),
    ({"logit_bias": {1: math.inf}}, "logit_bias"), ({"logit_bias": {1.5: 1}}, "logit_bias"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field) as raised:
        SamplingParams(**kwargs)
    assert raised.value.param == field  # what the server's 400 reports as "param"


def test_the_int64_extremes_and_the_smallest_temperature_are_accepted():
    SamplingParams(seed=2**63 - 1, top_k=2**63 - 1, temperature=0.01)
    SamplingParams(seed=-2**63)


def test_unknown_sampling_param_raises():
    with pytest.raises(TypeError, match="repetition_penalti"):
        SamplingParams(repetition_penalti=1.1)


def test_prompt_forms_give_the_same_tokens(llm):
    ids = llm.get_tokenizer().encode("The quick brown fox")
    outputs = llm.generate(["The quick brown fox", ids, {"prompt": "The quick brown fox"},
                            {"prompt_token_ids": ids, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outputs)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert outputs[0].prompt == "The quick brown fox" and outputs[1].prompt is None
    assert outputs[0].prompt_token_ids == ids
    assert outputs[0].outputs[0].text == llm.get_tokenizer().decode(outputs[0].outputs[0].token_ids)


def test_single_prompt_and_per_prompt_params(llm):
    [single] = llm.generate("hello there", GREEDY, use_tqdm=False)
    assert len(single.outputs[0].token_ids) == 5
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 4)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]


@pytest.mark.parametrize("prompt, field", [
    ("", "prompt"), ([], "prompt_token_ids"), ([1, 49152], "vocabulary"), ([1, -3], "vocabulary"),
    ([7] * 128, "max_model_len"), ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
    ({"text": "x"}, "text"), ({"prompt": "x", "cache_salt": 5}, "cache_salt"), (3.5, "prompt"),
])
def test_bad_prompt_raises_and_queues_nothing(llm, prompt, field):
    before = llm.generate(["steady"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises((ValueError, TypeError), match=field):
        llm.generate(["fine prompt", prompt], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert llm.stats().num_free_blocks == llm.stats().num_kvcache_blocks
    assert llm.generate(["steady"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


def test_mismatched_param_list_raises(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], GREEDY, priority=[0], use_tqdm=False)


def test_max_model_len_ends_generation_with_length(llm):
    out = llm.generate([[5] * 120], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["once upon"], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["noise", "once upon", "more noise here"],
                         [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), params,
                          SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True)], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


def test_stats_and_reset_prefix_cache(llm):
    llm.reset_prefix_cache()
    prompt = list(range(100, 150))
    llm.generate([prompt], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_kvcache_blocks == 64
    assert stats.num_cached_blocks >= 3
    hits = stats.prefix_cache_hits
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 48 and llm.stats().prefix_cache_hits == hits + 48
    assert 0 < llm.stats().prefix_cache_hit_rate <= 1
    llm.reset_prefix_cache()
    assert llm.stats().num_cached_blocks == 0
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
