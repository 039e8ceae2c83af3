"""SmolLM2-135M-Instruct, the real default model: our greedy tokens against transformers'."""

import math

import pytest
import torch
from conftest import hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoengine import LLM, SamplingParams

MAX_TOKENS = 24
NEAR_TIE = 1e-3  # a top-2 logit gap this small in float32 can flip with summation order
BF16_NEAR_TIE_ULPS = 4  # in bfloat16: a few units in the last place of the best logit
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


def next_token_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at ``x`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def assert_same_or_near_tie(hf_model, prompt: list[int], ours: list[int], theirs: list[int]) -> None:
    """Equal tokens, or a first difference that is provably a floating-point near-tie in the model's dtype: at
    that position transformers' logits for both tokens are within a near-tie of the best."""
    if ours == theirs:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert at is not None, f"one output is a prefix of the other: {ours} vs {theirs}"
    logits = next_token_logits(hf_model, prompt + theirs[:at])
    best = float(logits.max())
    gaps = [best - float(logits[token]) for token in (ours[at], theirs[at])]
    near_tie = BF16_NEAR_TIE_ULPS * bf16_ulp(best) if hf_model.dtype == torch.bfloat16 else NEAR_TIE
    assert max(gaps) <= near_tie, (f"tokens differ at {at}: their logits are {gaps[0]:.2e} and {gaps[1]:.2e} below "
                                   f"the best (near-tie: <= {near_tie:.2e})")


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


def test_bfloat16_matches_transformers_in_bfloat16(smollm2_dir):
    """bfloat16 weights, activations and KV cache against transformers in bfloat16; a difference must be a
    near-tie of a few bfloat16 steps (measured: 5 of 6 conversations equal over 48 tokens, one split where the
    top two logits are 0.25 apart, 2 units in the last place)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    max_tokens = 48
    with LLM(smollm2_dir, dtype="bfloat16", max_model_len=1024) as llm:
        outputs = llm.chat(conversations(), SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    equal = 0
    for conversation, output in zip(conversations(), outputs):
        prompt = chat_token_ids(tokenizer, conversation)
        theirs = hf_greedy(hf_bf16, prompt, max_tokens, tokenizer.eos_token_id)
        assert_same_or_near_tie(hf_bf16, prompt, output.outputs[0].token_ids, theirs)
        equal += output.outputs[0].token_ids == theirs
    assert equal >= len(outputs) // 2, "most conversations should match outright"
