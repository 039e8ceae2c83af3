"""SmolLM2-135M-Instruct, the real default model: our greedy tokens against transformers'."""

import pytest
import torch
from conftest import hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoengine import LLM, SamplingParams

MAX_TOKENS = 24
NEAR_TIE = 1e-3  # a top-2 logit gap this small in float32 can flip with summation order
SYSTEM = ("You are a patient assistant for a small museum of natural history. You answer visitors' questions "
          "about fossils, minerals, birds and insects in plain words, in two or three sentences, and you always "
          "suggest one exhibit in the museum that is related to the question. The museum has a hall of dinosaurs, "
          "a room of gemstones, a garden of butterflies and a tower with a telescope.")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "Write a haiku about rain.",
             "What did a Triceratops eat?", "How are diamonds formed?", "Do butterflies sleep?"]


def conversations() -> list[list[dict]]:
    plain = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
    with_system = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS[3:]]
    return plain + with_system


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    with LLM(smollm2_dir, max_model_len=1024) as llm:
        yield llm


def chat_token_ids(tokenizer, conversation) -> list[int]:
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def top2_gap(hf_model, token_ids: list[int]) -> tuple[float, list[int]]:
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, -1]
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def assert_same_or_near_tie(hf_model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """Equal tokens, or a first difference that is provably a floating-point near-tie."""
    if ours == theirs:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert at is not None, f"one output is a prefix of the other: {ours} vs {theirs}"
    gap, top2 = top2_gap(hf_model, prompt + theirs[:at])
    assert gap < NEAR_TIE and {ours[at], theirs[at]} == set(top2), (
        f"tokens differ at {at} with a top-2 logit gap of {gap:.2e}: not a near-tie")


def test_chat_matches_transformers_and_reuses_the_shared_system_prompt(llm, hf_model, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    first = llm.chat(conversations(), params, use_tqdm=False)
    for conversation, output in zip(conversations(), first):
        prompt = chat_token_ids(tokenizer, conversation)
        assert output.prompt_token_ids == prompt
        theirs = hf_greedy(hf_model, prompt, MAX_TOKENS, tokenizer.eos_token_id)
        assert_same_or_near_tie(hf_model, prompt, output.outputs[0].token_ids, theirs)
    # The three system-prompt conversations share their first blocks within the first run already.
    assert max(o.num_cached_tokens for o in first[3:]) >= 64
    hits_before = llm.stats().prefix_cache_hits
    second = llm.chat(conversations(), params, use_tqdm=False)
    assert llm.stats().prefix_cache_hits > hits_before
    assert all(o.num_cached_tokens > 0 for o in second)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]


def test_capital_of_france(llm):
    output = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert output.outputs[0].text == "The capital of France is Paris."
    assert output.outputs[0].finish_reason == "stop"
