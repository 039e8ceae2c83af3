"""logit_bias against plain torch: the sampler's addition, then whole runs on the greedy, random, seeded and
speculative (verification) paths against transformers' logits plus the bias; and its checks."""

import pytest
import torch
from conftest import keep_every_draft

from nanoengine import LLM, SamplingParams
from nanoengine.layers.sampler import apply_logit_bias

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PATTERN = list(range(1000, 1012))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_bias_is_added_to_each_row_as_a_plain_loop_adds_it():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=generator)
    biases = [{3: 2.5, 7: -100.0}, None, {0: 100.0, 49: 0.5, 3: -1.0}, {}]
    expected = logits.clone()
    for row, bias in enumerate(biases):
        for token_id, value in (bias or {}).items():
            expected[row, token_id] += value
    biased = apply_logit_bias(logits, biases)
    assert torch.equal(biased, expected)
    assert not torch.equal(logits, expected)  # the raw logits (for logprobs) are left alone
    assert apply_logit_bias(logits, [None, {}, None, None]) is logits


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(folder, max_model_len=128, num_kvcache_blocks=64, dtype="float32") as llm:
        yield llm


def hf_greedy_with_bias(hf_model, prompt: list[int], bias: dict[int, float], max_new_tokens: int) -> list[int]:
    """The oracle: transformers' logits plus the bias, argmax, one token at a time."""
    ids, added = list(prompt), torch.zeros(hf_model.config.vocab_size)
    for token_id, value in bias.items():
        added[token_id] = value
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int((hf_model(torch.tensor([ids])).logits[0, -1].float() + added).argmax()))
    return ids[len(prompt):]


def next_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0, -1].float()


def bias_against_greedy(hf_model, prompt: list[int]) -> dict[int, float]:
    """A bias that changes the greedy output: its first token banned, the third most likely raised."""
    order = next_logits(hf_model, prompt).argsort(descending=True).tolist()
    return {order[0]: -100.0, order[2]: 1.5, 4321: 30.0}


def test_greedy_output_is_the_argmax_of_the_biased_logits(llm, hf_model):
    prompt = [300, 301, 302, 303, 304]
    bias = bias_against_greedy(hf_model, prompt)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias, logprobs=1)
    [plain, biased] = llm.generate([prompt] * 2, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                                  params], use_tqdm=False)
    assert biased.outputs[0].token_ids == hf_greedy_with_bias(hf_model, prompt, bias, 8)
    assert biased.outputs[0].token_ids != plain.outputs[0].token_ids
    # Logprobs stay the model's own, from before the bias (as vLLM reports them).
    first = biased.outputs[0].logprobs[0][biased.outputs[0].token_ids[0]].logprob
    assert first == pytest.approx(next_logits(hf_model, prompt).log_softmax(-1)[biased.outputs[0].token_ids[0]].item(),
                                  abs=1e-4)


@pytest.mark.parametrize("seed", [None, 0])
def test_sampled_tokens_follow_the_biased_distribution(llm, hf_model, seed):
    """+100 on two tokens leaves them alone in the race (everything else is 80 or more below): each must come
    out as often as softmax over their two raw logits says, whether each sample draws from the engine's
    generator or from its own seed."""
    prompt = [500, 501, 502]
    logits = next_logits(hf_model, prompt)
    a, b = logits.argsort()[20000:20002].tolist()  # two close, unlikely tokens
    expected = torch.softmax(logits[[a, b]], dim=0)[0].item()
    num_samples = 400
    params = SamplingParams(n=num_samples, temperature=1.0, max_tokens=1, ignore_eos=True, seed=seed,
                            logit_bias={a: 100, b: 100})
    tokens = [c.token_ids[0] for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert set(tokens) <= {a, b}
    share = tokens.count(a) / num_samples
    spread = 4 * (expected * (1 - expected) / num_samples) ** 0.5  # four standard deviations
    assert abs(share - expected) < spread, (share, expected)


def test_speculative_verification_applies_the_bias(folder, hf_model):
    """The bias keeps the output among the pattern's tokens (one banned), so the prompt's n-grams draft the
    pattern's continuations, which the biased logits accept or reject."""
    prompt = PATTERN * 3
    bias = {token_id: 100.0 for token_id in PATTERN} | {PATTERN[3]: -100.0}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=bias)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logit_bias=bias)
    with LLM(folder, max_model_len=128, num_kvcache_blocks=64, dtype="float32") as plain:
        plain_seeded = plain.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(folder, max_model_len=128, num_kvcache_blocks=64, dtype="float32", speculative_config=SPEC) as llm:
        keep_every_draft(llm.llm_engine)
        outputs = llm.generate([prompt] * 2, [greedy, seeded], use_tqdm=False)
        assert llm.stats().spec_num_draft_tokens > 0
    assert outputs[0].outputs[0].token_ids == hf_greedy_with_bias(hf_model, prompt, bias, 24)
    assert PATTERN[3] not in outputs[0].outputs[0].token_ids + outputs[1].outputs[0].token_ids
    assert outputs[1].outputs[0].token_ids == plain_seeded


@pytest.mark.parametrize("bias, kind, says", [
    ({49152: 1.0}, ValueError, "outside the vocabulary"),
    ({-1: 1.0}, ValueError, "outside the vocabulary"),
    ({5: float("nan")}, ValueError, "finite"),
    ({5: float("inf")}, ValueError, "finite"),
    ({"5": 1.0}, TypeError, "int"),
    ({5: "1"}, TypeError, "number"),
    ([5], TypeError, "dict"),
])
def test_bad_biases_raise_naming_logit_bias_before_anything_is_queued(llm, bias, kind, says):
    with pytest.raises(kind, match=says) as raised:
        llm.generate(["Hi"], SamplingParams(max_tokens=2, logit_bias=bias), use_tqdm=False)
    assert raised.value.param == "logit_bias"
    assert not llm.llm_engine.has_unfinished_requests()


def test_biases_are_clamped_to_plus_or_minus_100():
    assert SamplingParams(logit_bias={1: 1e9, 2: -1e9, 3: 5}).logit_bias == {1: 100.0, 2: -100.0, 3: 5.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
