"""nanoengine against real vLLM, on SmolLM2 in float32: the outputs that scripts/record_vllm_reference.py
recorded from vLLM (tests/fixtures/vllm_reference.json). No vLLM is needed here.

- Greedy cases: tokens (a difference only where vLLM's own top-2 gap proves a near-tie), text, finish_reason,
  stop_reason, logprobs and prompt logprobs. The penalty cases' gaps are of the penalized logits.
- Sampling cases: from vLLM's raw logprobs at the context, work out the tokens its filters allow and the
  distribution over them. vLLM's own draws must fit it (which checks the derivation), then so must ours:
  every token inside the allowed set, and a chi-square fit on the counts of many rows of our logits at the
  context through our sampler. The whole engine also samples every case in one batch, inside the sets.
"""

import collections
import json
import math
from pathlib import Path

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.layers.sampler import SamplingTensors, sample

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_reference.json").read_text())
NEAR_TIE = 1e-3  # a top-2 logit gap this small can flip with float32 summation order
LOGPROB_TOL = 1e-4
MARGIN = 3e-4  # how far every filter decision must be from its threshold: 3x the logprob tolerance
MIN_P_VALUE = 1e-3  # a chi-square p-value below this fails
SAMPLER_DRAWS = 20_000  # rows of one context's logits, through the sampler itself
ENGINE_DRAWS = 32  # per case, through the whole engine


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    # vLLM recorded the fixture with max_logprobs=32 (scripts/record_vllm_reference.py): the same here.
    with LLM(smollm2_dir, dtype="float32", max_model_len=1024, max_logprobs=32) as llm:
        yield llm


@pytest.fixture(scope="module")
def generated(llm) -> dict:
    cases = FIXTURE["generate"]
    outputs = llm.generate([c["prompt"] for c in cases], [SamplingParams(**c["params"]) for c in cases],
                           use_tqdm=False)
    return {c["name"]: out for c, out in zip(cases, outputs)}


def by_name(cases: list[dict]):
    return pytest.mark.parametrize("case", cases, ids=[c["name"] for c in cases])


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                None if len(ours) == len(theirs) else min(len(ours), len(theirs)))


@by_name(FIXTURE["generate"])
def test_greedy_tokens_text_and_finish_fields_match_vllm(case, generated):
    out = generated[case["name"]]
    assert out.prompt_token_ids == case["prompt_token_ids"]
    ours = out.outputs[0]
    at = first_difference(ours.token_ids, case["token_ids"])
    if at is not None:
        gap = case["top2_gaps"][at]
        assert gap < NEAR_TIE, f"token {at} differs ({ours.token_ids[at]} vs {case['token_ids'][at]}) with a " \
                               f"top-2 gap of {gap:.2e} in vLLM: not a near-tie"
        pytest.xfail(f"a proven near-tie at token {at} (gap {gap:.2e}): the rest cannot be compared")
    assert ours.text == case["text"]
    assert (ours.finish_reason, ours.stop_reason) == (case["finish_reason"], case["stop_reason"])


def assert_same_logprobs(ours: dict, theirs: list[list]) -> None:
    """One position: the same token ids with the same logprobs and ranks, except that ids whose logprobs tie
    within the tolerance at the top-N boundary may swap."""
    expected = {tid: (logprob, rank) for tid, logprob, rank, _ in theirs}
    for tid in set(ours) | set(expected):
        if tid not in ours or tid not in expected:
            boundary = min(lp for lp, _ in expected.values())
            value = ours[tid].logprob if tid in ours else expected[tid][0]
            assert abs(value - boundary) < LOGPROB_TOL, f"token {tid} is in only one of the two top lists"
            continue
        assert ours[tid].logprob == pytest.approx(expected[tid][0], abs=LOGPROB_TOL)
        assert ours[tid].rank == expected[tid][1]
    for tid, _, _, decoded in theirs:
        if tid in ours:
            assert ours[tid].decoded_token == decoded


RAW = [c for c in FIXTURE["generate"] if c["logprobs_mode"] == "raw_logprobs"]


@by_name(RAW)
def test_logprobs_match_vllm(case, generated):
    ours = generated[case["name"]].outputs[0]
    agreed = first_difference(ours.token_ids, case["token_ids"])
    agreed = len(case["token_ids"]) if agreed is None else agreed
    for position in range(agreed):
        assert_same_logprobs(ours.logprobs[position], case["logprobs"][position])
    if agreed == len(case["token_ids"]):
        assert ours.cumulative_logprob == pytest.approx(case["cumulative_logprob"], abs=LOGPROB_TOL * agreed)


@by_name([c for c in RAW if c["prompt_logprobs"] is not None])
def test_prompt_logprobs_match_vllm(case, generated):
    ours = generated[case["name"]].prompt_logprobs
    assert len(ours) == len(case["prompt_logprobs"]) and ours[0] is None and case["prompt_logprobs"][0] is None
    for entry, expected in zip(ours[1:], case["prompt_logprobs"][1:]):
        assert_same_logprobs(entry, expected)


# Sampling -----------------------------------------------------------------------------------------------


def vllm_distribution(case: dict) -> dict[int, float]:
    """The probability of each token that vLLM's filters allow, from its raw top logprobs at the context.

    Temperature, then min-p (relative to the top token, so no normalizer is needed), then top-k (ties stay),
    then top-p over top-k's survivors, renormalized. Every decision is asserted to be clear of its threshold,
    so the result does not hang on float noise."""
    params = case["params"]
    ids = [tid for tid, _ in case["top_logprobs"]]
    logits = torch.tensor([lp for _, lp in case["top_logprobs"]], dtype=torch.float64) / params.get("temperature", 1)
    keep = torch.ones(len(ids), dtype=torch.bool)
    if params.get("min_p"):
        above_floor = logits - logits[0] - math.log(params["min_p"])
        assert above_floor.abs().min() > MARGIN
        keep &= above_floor > 0
    top_k = params["top_k"]
    assert 0 < top_k < len(ids), "the recorded top logprobs must reach past top_k"
    kth = logits[top_k - 1]
    assert (logits[top_k:] < kth - MARGIN).all(), "a tie at the top-k boundary"
    keep[top_k:] = False
    probs = torch.where(keep, logits, -math.inf).softmax(dim=0)
    if params.get("top_p", 1) < 1:
        mass_up_to = probs.flip(0).cumsum(0).flip(0)  # from the least likely token up to this one
        past = mass_up_to - (1 - params["top_p"])
        assert past[keep].abs().min() > MARGIN
        keep &= past > 0
        keep[0] = True
        probs = torch.where(keep, logits, -math.inf).softmax(dim=0)
    return {tid: p.item() for tid, p, kept in zip(ids, probs, keep) if kept}


def chi_square_p_value(counts: dict[int, int], expected: dict[int, float]) -> float:
    """Goodness of fit of the draws to the distribution; bins expecting fewer than 5 draws are pooled."""
    total = sum(counts.values())
    bins, pooled = [], [0, 0.0]
    for tid, p in expected.items():
        if p * total >= 5:
            bins.append((counts.get(tid, 0), p * total))
        else:
            pooled[0] += counts.get(tid, 0)
            pooled[1] += p * total
    if pooled[1]:
        bins.append(tuple(pooled))
    statistic = sum((seen - want) ** 2 / want for seen, want in bins)
    return torch.special.gammaincc(torch.tensor((len(bins) - 1) / 2), torch.tensor(statistic / 2)).item()


@pytest.fixture(scope="module")
def our_top_logprobs(llm) -> dict[str, dict[int, float]]:
    """Our raw logprobs at each sampling context, as many as the fixture holds."""
    cases = FIXTURE["sampling"]
    outputs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in cases],
                           SamplingParams(temperature=0, max_tokens=1, logprobs=len(cases[0]["top_logprobs"])),
                           use_tqdm=False)
    return {c["name"]: {tid: lp.logprob for tid, lp in out.outputs[0].logprobs[0].items()}
            for c, out in zip(cases, outputs)}


def sampler_draws(top_logprobs: dict[int, float], params: dict, num_draws: int) -> dict[int, int]:
    """Our sampler, run on ``num_draws`` copies of a row of our logits. Only the top logits are kept: with
    top_k below their number, what the filters do and the distribution they leave depend on nothing else."""
    ids = list(top_logprobs)
    logits = torch.tensor([list(top_logprobs.values())]).expand(num_draws, -1)

    def per_row(value, dtype=torch.float32) -> torch.Tensor:
        return torch.full((num_draws,), value, dtype=dtype)

    tensors = SamplingTensors(
        temperatures=per_row(params.get("temperature", 1.0)), top_ks=per_row(params["top_k"], torch.int64),
        top_ps=per_row(params.get("top_p", 1.0)), min_ps=per_row(params.get("min_p", 0.0)),
        generators=[None] * num_draws, all_greedy=False, any_top_k_or_p=True, any_min_p="min_p" in params)
    tokens = sample(logits, tensors, torch.Generator().manual_seed(0))
    return dict(collections.Counter(ids[i] for i in tokens.tolist()))


@by_name(FIXTURE["sampling"])
def test_sampler_stays_inside_vllms_allowed_set_and_fits_its_distribution(case, our_top_logprobs):
    expected = vllm_distribution(case)
    theirs = {int(tid): n for tid, n in case["draws"].items()}
    assert set(theirs) <= set(expected) and chi_square_p_value(theirs, expected) > MIN_P_VALUE
    # Our raw logprobs at the context are vLLM's, so the same allowed set and distribution apply to us.
    ours = our_top_logprobs[case["name"]]
    for tid, logprob in case["top_logprobs"]:
        assert ours[tid] == pytest.approx(logprob, abs=LOGPROB_TOL)
    counts = sampler_draws(ours, case["params"], SAMPLER_DRAWS)
    outside = {tid: n for tid, n in counts.items() if tid not in expected}
    assert not outside, f"sampled tokens vLLM never allows: {outside} (allowed: {sorted(expected)})"
    p_value = chi_square_p_value(counts, expected)
    assert p_value > MIN_P_VALUE, f"draws do not fit vLLM's distribution: p = {p_value:.2e}"


def test_engine_samples_of_every_case_in_one_batch_stay_inside_vllms_allowed_sets(llm):
    cases = FIXTURE["sampling"]
    prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for c in cases]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # the contexts' blocks are now cached
    outputs = llm.generate(prompts * ENGINE_DRAWS, [SamplingParams(max_tokens=1, **c["params"]) for c in cases]
                           * ENGINE_DRAWS, use_tqdm=False)
    for i, out in enumerate(outputs):
        case = cases[i % len(cases)]
        assert out.outputs[0].token_ids[0] in vllm_distribution(case), case["name"]
