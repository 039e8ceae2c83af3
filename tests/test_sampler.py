"""The sampler's filters and penalties, as vLLM defines them, on hand-made logits; repetition penalty against
transformers' own on a tiny model."""

import math

import pytest
import torch
from conftest import build_tiny_model, hf_greedy

from nanoengine import LLM, SamplingParams
from nanoengine.layers import sampler
from nanoengine.layers.sampler import (
    TOP_P_PART,
    SamplingTensors,
    apply_penalties,
    sample,
    top_k_top_p,
    top_k_top_p_from_top_part,
    truncate,
)


def tensors(rows: int = 1, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> SamplingTensors:
    return SamplingTensors(
        temperatures=torch.full((rows,), float(temperature)), top_ks=torch.full((rows,), top_k),
        top_ps=torch.full((rows,), float(top_p)), min_ps=torch.full((rows,), float(min_p)),
        generators=[None] * rows, all_greedy=temperature == 0, any_top_k_or_p=top_k > 0 or top_p < 1,
        any_min_p=min_p > 0)


def kept(probs: list[float], **filters) -> set[int]:
    """The token ids that survive the filters, for one row with these probabilities."""
    logits = torch.tensor([probs]).log()
    return set(torch.isfinite(truncate(logits, tensors(**filters))[0]).nonzero().flatten().tolist())


def test_samples_follow_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    rows = 100_000
    tokens = sample(probs.log().expand(rows, -1), tensors(rows), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[1] == 0
    # Pearson's chi-square over the four possible tokens: its 0.1% critical value at 3 degrees of freedom is 16.3.
    expected = rows * probs.double()
    live = expected > 0
    assert ((counts[live] - expected[live]) ** 2 / expected[live]).sum() < 16.3


@pytest.mark.parametrize("draw", [0.0, 1 - 2**-24])  # the lowest and highest uniform torch.rand returns
def test_a_token_with_probability_zero_is_never_picked_at_the_ends_of_the_draw(draw, monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda size, **_: torch.full((size,) if isinstance(size, int) else size, draw))
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]])
    assert sample(logits, tensors(), torch.Generator()).item() == (1 if draw == 0 else 3)


def test_a_seeded_row_draws_from_its_own_generator():
    logits = torch.zeros(3, 1000)
    draws = []
    for batch_seed in (0, 1):
        params = tensors(3)
        params.generators = [None, torch.Generator().manual_seed(7), None]
        draws.append(sample(logits, params, torch.Generator().manual_seed(batch_seed)))
    first, second = draws
    assert first[1] == second[1] and (first[0] != second[0] or first[2] != second[2])


def top_k_cases(seed: int, every_row_has_k: bool = False, rows: int = 12, vocab: int = 4096):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    top_ks = torch.randint(2, 990, (rows,), generator=gen)
    top_ks[0] = 999  # the largest k, so row 5's ties below its k-th fall inside the top part
    top_ps = torch.rand(rows, generator=gen).clamp(min=0.05)
    top_ps[::3] = 1.0  # top-k alone
    if not every_row_has_k:
        top_ks[1], top_ks[2], top_ps[2] = 0, 0, 1.0  # top-p alone; neither
        logits[1], top_ps[1] = logits[1] / 4, 0.3  # flatter: the part holds about half the mass, the rest counts
    # Row 5, top-k alone: its k-th largest tied with the one above and the two below it (the two stay too).
    top_ps[5] = 1.0
    ranked = logits[5].argsort(descending=True)
    logits[5, ranked[top_ks[5] - 2:top_ks[5] + 2]] = logits[5, ranked[top_ks[5] - 1]].item()
    return logits, top_ks, top_ps


@pytest.mark.parametrize("every_row_has_k", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_sorting_only_the_top_k_keeps_what_the_full_sort_keeps(seed, every_row_has_k, monkeypatch):
    logits, top_ks, top_ps = top_k_cases(seed, every_row_has_k)
    with monkeypatch.context() as patch:
        patch.setattr(sampler, "top_k_top_p_from_top_part", lambda *args: None)
        full = top_k_top_p(logits, top_ks, top_ps)
    monkeypatch.setattr(torch.Tensor, "sort", lambda *args, **kwargs: pytest.fail("sorted the whole vocabulary"))
    top_part = top_k_top_p(logits, top_ks, top_ps)
    assert torch.equal(torch.isfinite(top_part), torch.isfinite(full))
    assert torch.equal(top_part[torch.isfinite(full)], logits[torch.isfinite(full)])
    assert torch.isfinite(full[5]).sum() == top_ks[5] + 2  # the ties stayed
    if not every_row_has_k:
        assert torch.isfinite(full[2]).all() and 1 < torch.isfinite(full[1]).sum() < TOP_P_PART


# All 4,096 tied: top-k keeps every tie; top-p drops the 40 tokens whose mass from the bottom is <= 1%.
@pytest.mark.parametrize("row, top_k, top_p, num_kept", [(3, 500, 1.0, 4096), (4, 0, 0.99, 4056)])
def test_what_the_top_part_cannot_decide_takes_the_full_sort(row, top_k, top_p, num_kept):
    """More ties at the k-th largest than the part holds; a top-p the part's mass falls short of."""
    logits, top_ks, top_ps = top_k_cases(0)
    logits[row], top_ks[row], top_ps[row] = 1.0, top_k, top_p  # every logit tied: the part holds a quarter
    assert top_k_top_p_from_top_part(logits, torch.where(top_ks > 0, top_ks, logits.shape[1]), top_ps) is None
    assert torch.isfinite(top_k_top_p(logits, top_ks, top_ps)[row]).sum() == num_kept


def test_top_p_is_computed_over_what_top_k_keeps_renormalized():
    probs = [0.3, 0.2, 0.1, 0.05] + [0.35 / 10] * 10
    # Over top-k's 3 survivors the masses are 0.5, 0.33, 0.17: the third starts past 0.8 and is dropped.
    # (Over the whole vocabulary only 0.5 would lie before it, and it would stay.)
    assert kept(probs, top_k=3, top_p=0.8) == {0, 1}
    assert kept(probs, top_k=3) == {0, 1, 2}


def test_min_p_comes_first_and_top_p_renormalizes_over_its_survivors():
    probs = [0.4, 0.3, 0.1, 0.1, 0.1]
    assert kept(probs, min_p=0.3) == {0, 1}  # the floor is 0.3 * 0.4 = 0.12
    # The survivors renormalize to 0.57 and 0.43: top_p=0.5 is reached by the first alone.
    assert kept(probs, min_p=0.3, top_p=0.5) == {0}
    assert kept(probs, top_p=0.5) == {0, 1}


def test_top_k_keeps_every_token_tied_with_the_kth():
    assert kept([0.4, 0.2, 0.2, 0.1, 0.1], top_k=2) == {0, 1, 2}


def test_the_most_likely_token_always_survives_top_p():
    assert kept([0.9, 0.05, 0.05], top_p=0.01) == {0}


def test_min_p_compares_probabilities_after_the_temperature():
    logits = torch.tensor([[0.0, -1.5]]).expand(4000, 2)  # token 1 has e^-1.5 = 0.22 of token 0's probability
    generator = torch.Generator().manual_seed(0)
    cold = sample(logits, tensors(4000, temperature=1.0, min_p=0.3), generator)
    hot = sample(logits, tensors(4000, temperature=2.0, min_p=0.3), generator)  # now e^-0.75 = 0.47
    assert cold.sum() == 0
    expected = 4000 * math.exp(-0.75) / (1 + math.exp(-0.75))
    assert abs(hot.sum().item() - expected) < 5 * math.sqrt(expected)


def test_penalties_follow_vllms_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, -2.0, 1.0, 3.0]] * 2)
    prompt_ids, output_ids = [[0, 3], [0, 3]], [[4, 4, 1], [4, 4, 1]]
    presence, frequency, repetition = torch.tensor([0.5, 0.0]), torch.tensor([0.25, 0.0]), torch.tensor([2.0, 1.0])
    penalized = apply_penalties(logits, prompt_ids, output_ids, presence, frequency, repetition)
    # Seen: 0 and 3 (prompt), 4 twice and 1 once (output). Repetition halves a positive logit and doubles a
    # negative one; frequency takes 0.25 per output occurrence, presence 0.5 once.
    assert penalized[0].tolist() == [1.0, -2.0 - 0.25 - 0.5, 0.5, -4.0, 0.5 - 0.5 - 0.5, 3.0]
    assert penalized[1].tolist() == logits[1].tolist()  # neutral values change nothing


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": "1"}, "repetition_penalty"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
])
def test_bad_penalties_and_prompt_logprobs_name_the_field(kwargs, field):
    with pytest.raises((TypeError, ValueError), match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def repeating_tiny_model(tmp_path_factory, smollm2_dir):
    """(folder, transformers model): a tiny Llama with the default init, which repeats its tokens."""
    folder = tmp_path_factory.mktemp("tiny-repeating-llama")
    return str(folder), build_tiny_model("llama", folder, smollm2_dir)


def test_repetition_penalty_matches_transformers(repeating_tiny_model, one_torch_thread):
    folder, hf_model = repeating_tiny_model
    prompt = [5965, 20334, 1114, 314, 5965, 20334, 1114]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                     max_new_tokens=12, do_sample=False, repetition_penalty=1.8,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    with LLM(folder, max_model_len=64, num_kvcache_blocks=16) as llm:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
        [penalized, plain] = llm.generate([prompt, prompt], [params, SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    assert penalized.outputs[0].token_ids == expected
    assert plain.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
    assert expected != hf_greedy(hf_model, prompt, 12)  # the penalty changed something
