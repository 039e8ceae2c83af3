"""vLLM's API where it goes beyond one request: generation_config defaults, finish fields, n > 1, chat options,
EngineArgs, wall-clock arrival times, and LLM.generate sharing the engine with requests added directly."""

import argparse
import json
import shutil
import time

import pytest
from conftest import VOCAB_SIZE, hf_greedy
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nanoengine import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.engine import arg_utils

PROMPT = list(range(300, 340))  # 40 tokens: two full 16-token blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_steps(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


# generation_config -----------------------------------------------------------------------------------------


def test_generation_config_gives_the_defaults_when_no_sampling_params_are_passed(folder, hf_model, tmp_path):
    model_dir = shutil.copytree(folder, tmp_path / "model")
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 1,
                                                                  "max_new_tokens": 8}))
    with LLM(str(model_dir), max_model_len=128, num_kvcache_blocks=16) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 8)
        [output] = llm.generate([PROMPT], use_tqdm=False)
    # top_k=1 leaves only the most likely token: 8 greedy tokens, as vLLM gives.
    assert output.outputs[0].token_ids == hf_greedy(hf_model, PROMPT, 8)


def test_generation_config_vllm_or_another_folder(folder, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "min_p": 0.1, "do_sample": True}))
    with LLM(folder, max_model_len=128, num_kvcache_blocks=16, generation_config=str(other)) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(top_p=0.5, min_p=0.1)
    assert EngineConfig(folder, generation_config="vllm").default_sampling_params() == {}
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(folder, generation_config=str(tmp_path / "missing"))


# Finish fields and text --------------------------------------------------------------------------------------


def test_stop_reason_is_none_on_eos_and_the_id_for_a_stop_token(smollm2_dir):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(smollm2_dir, max_model_len=256, num_kvcache_blocks=16) as llm:
        [by_eos] = llm.chat(question, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
        stop_id = by_eos.outputs[0].token_ids[2]
        [by_id] = llm.chat(question, SamplingParams(temperature=0, stop_token_ids=[stop_id]), use_tqdm=False)
    assert by_eos.outputs[0].text == "The capital of France is Paris."
    assert (by_eos.outputs[0].finish_reason, by_eos.outputs[0].stop_reason) == ("stop", None)
    assert (by_id.outputs[0].finish_reason, by_id.outputs[0].stop_reason) == ("stop", stop_id)


@pytest.fixture(scope="module")
def metaspace_model(folder, tmp_path_factory):
    """The tiny model with a SentencePiece-style (Metaspace) word-level tokenizer: every token starts a word."""
    model_dir = shutil.copytree(folder, tmp_path_factory.mktemp("metaspace") / "model")
    vocab = {"<unk>": 0, **{f"\u2581w{i}": i for i in range(1, VOCAB_SIZE)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    (model_dir / "tokenizer_config.json").unlink()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(model_dir)
    return str(model_dir)


def test_final_only_and_streamed_text_agree_with_a_metaspace_tokenizer(metaspace_model):
    """Each output starts a new word after the prompt, so its text starts with a space, however it is returned."""
    with LLM(metaspace_model, max_model_len=128, num_kvcache_blocks=16) as llm:
        for kind in RequestOutputKind:
            llm.llm_engine.add_request(kind.name, PROMPT, greedy(5, output_kind=kind))
        outputs = run_steps(llm.llm_engine)
    texts = {kind: "".join(o.outputs[0].text for o in outputs if o.request_id == kind.name)
             if kind == RequestOutputKind.DELTA else
             [o for o in outputs if o.request_id == kind.name][-1].outputs[0].text for kind in RequestOutputKind}
    assert texts[RequestOutputKind.FINAL_ONLY].startswith(" w")
    assert len(set(texts.values())) == 1, texts


# Arrival times, and the engine shared with LLM.generate -----------------------------------------------------


def test_an_arrival_time_from_time_time_is_compared_with_the_engines_own(folder, hf_model):
    """vLLM users stamp requests with time.time(): such a request arrived first, so it is not the victim."""
    with LLM(folder, max_model_len=32, kvcache_block_size=4, num_kvcache_blocks=8, scheduling_policy="priority",
             max_num_seqs=3) as llm:
        engine = llm.llm_engine
        victims = []
        preempt = engine.scheduler.preempt
        engine.scheduler.preempt = lambda request: victims.append(request.request_id) or preempt(request)
        engine.add_request("stamped", PROMPT[:6], greedy(10), arrival_time=time.time())
        for rid, start in (("B", 6), ("C", 12)):
            engine.add_request(rid, PROMPT[start:start + 6], greedy(10))
        outputs = {o.request_id: o for o in run_steps(engine) if o.finished}
    assert victims and victims[0] == "C"
    assert "stamped" not in victims
    assert outputs["stamped"].metrics.time_to_first_token >= 0
    assert outputs["stamped"].outputs[0].token_ids == hf_greedy(hf_model, PROMPT[:6], 10)


def test_generate_returns_its_own_outputs_and_keeps_the_others_for_the_engine(llm, hf_model):
    engine = llm.llm_engine
    engine.add_request("added directly", PROMPT, greedy(12, output_kind=RequestOutputKind.DELTA))
    [own] = llm.generate([PROMPT[:20]], greedy(3), use_tqdm=False)
    assert own.outputs[0].token_ids == hf_greedy(hf_model, PROMPT[:20], 3)
    assert engine.has_unfinished_requests()
    deltas = [o for o in run_steps(engine) if o.request_id == "added directly"]
    assert deltas[-1].finished
    assert sum((o.outputs[0].token_ids for o in deltas), []) == hf_greedy(hf_model, PROMPT, 12)


def test_max_num_batched_tokens_must_cover_max_num_seqs(folder):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        EngineConfig(folder, max_num_seqs=16, max_num_batched_tokens=8)
    assert EngineConfig(folder, max_num_batched_tokens=8).max_num_seqs == 8  # the default shrinks, as vLLM


def test_the_step_budget_defaults_to_vllms_for_its_device(folder):
    assert EngineConfig(folder, device="cpu").max_num_batched_tokens == 4096
    assert EngineConfig(folder, device="cpu", max_num_batched_tokens=8192).max_num_batched_tokens == 8192


# n > 1 -----------------------------------------------------------------------------------------------------


def test_n_greedy_samples_are_equal_and_share_the_prompt_through_the_prefix_cache(llm, hf_model):
    llm.reset_prefix_cache()
    hits_before = llm.stats().prefix_cache_hits
    [output] = llm.generate([PROMPT], greedy(6, n=3), use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(c.token_ids == hf_greedy(hf_model, PROMPT, 6) for c in output.outputs)
    assert llm.stats().prefix_cache_hits - hits_before == 2 * 32  # children 1 and 2 reuse both full blocks


def test_seeded_n_samples_are_those_of_separate_requests_seeded_seed_plus_index(llm):
    params = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    [together] = llm.generate([PROMPT], SamplingParams(n=3, seed=7, **params), use_tqdm=False)
    separate = llm.generate([PROMPT] * 3, [SamplingParams(seed=7 + i, **params) for i in range(3)], use_tqdm=False)
    assert [c.token_ids for c in together.outputs] == [o.outputs[0].token_ids for o in separate]
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1


def test_n_samples_stream_deltas_by_index_under_the_parent_id(llm, hf_model):
    engine = llm.llm_engine
    engine.add_request("p", PROMPT, greedy(5, n=2, output_kind=RequestOutputKind.DELTA))
    outputs = run_steps(engine)
    assert {o.request_id for o in outputs} == {"p"}
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
    for index in (0, 1):
        tokens = sum((c.token_ids for o in outputs for c in o.outputs if c.index == index), [])
        assert tokens == hf_greedy(hf_model, PROMPT, 5)


def test_aborting_the_parent_aborts_every_sample(llm):
    engine = llm.llm_engine
    engine.add_request("p", PROMPT, greedy(5, n=3))
    engine.step()
    engine.abort_request("p")
    assert not engine.has_unfinished_requests()
    assert llm.stats().num_free_blocks == llm.stats().num_kvcache_blocks
    engine.add_request("p", PROMPT, greedy(1))  # the id is free again
    assert run_steps(engine)[-1].finished


def test_aborting_every_sample_by_its_own_id_frees_the_parent_too(llm):
    engine = llm.llm_engine
    engine.add_request("p", PROMPT, greedy(5, n=3))
    engine.step()
    engine.abort_request(["0_p", "1_p"])
    assert list(engine.parents) == ["p"]
    engine.abort_request("2_p")
    assert not engine.parents and not engine.has_unfinished_requests()
    engine.add_request("p", PROMPT, greedy(1))  # the id is free again
    assert run_steps(engine)[-1].finished


# chat options ------------------------------------------------------------------------------------------------


def test_chat_template_kwargs_tools_and_continue_final_message(llm):
    template = ("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                "{% if tools %}tools={{ tools | map(attribute='name') | join(',') }}{% endif %}"
                "{% if add_generation_prompt %}[assistant:{% endif %}{{ suffix }}")
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    [output] = llm.chat(conversation, greedy(1), use_tqdm=False, chat_template=template,
                        tools=[{"name": "search"}], chat_template_kwargs={"suffix": "!"})
    assert output.prompt == "[user:hi][assistant:hel]tools=search[assistant:!"
    [output] = llm.chat(conversation, greedy(1), use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)
    assert output.prompt.endswith("assistant\nhel")  # the model's own template, left open
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conversation, continue_final_message=True)
    assert not llm.llm_engine.has_unfinished_requests()


# EngineArgs -------------------------------------------------------------------------------------------------


def test_engine_args_from_the_command_line_build_an_engine(folder):
    assert arg_utils.EngineArgs is EngineArgs
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", folder, "--max-model-len", "64", "--num-kvcache-blocks", "8",
                              "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args == EngineArgs(model=folder, max_model_len=64, num_kvcache_blocks=8,
                                     enable_prefix_caching=False, gpu_memory_utilization=0.5)
    engine = LLMEngine.from_engine_args(engine_args)
    try:
        assert (engine.config.max_model_len, engine.config.enable_prefix_caching) == (64, False)
        engine.add_request("0", PROMPT[:5], greedy(2))
        assert run_steps(engine)[-1].finished
    finally:
        engine.close()
