"""Speculative decoding: n-gram drafts change how many tokens a step emits, never which tokens.

Greedy and seeded requests give the plain engine's tokens, token for token (a seeded request's noise depends
on its seed and the token's index only); unseeded sampling is checked in distribution by a chi-square test
that a wrong acceptance rule fails.
"""

import argparse
import math
import re

import pytest
import torch
from conftest import build_tiny_model, keep_every_draft

from nanoengine import LLM, EngineArgs, RequestOutputKind, SamplingParams
from nanoengine.config import SpeculativeConfig
from nanoengine.engine import model_runner as model_runner_module
from nanoengine.engine import spec_decode
from nanoengine.engine.spec_decode import DraftLength, StepCost, accepted_run, propose_ngram, worth_drafting
from nanoengine.layers.sampler import SamplingTensors, sample
from nanoengine.outputs import EngineStats
from nanoengine.serve.cli import build_parser, engine_options
from nanoengine.serve.metrics import Metrics

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ENGINE = dict(max_model_len=256, num_kvcache_blocks=96, dtype="float32")
PATTERN = list(range(1000, 1012))
# Prompts that repeat themselves (drafts from the prompt) and random ones (drafts only from the output).
PROMPTS = [PATTERN * 3, PATTERN[:7] * 4 + [5], [4000 + (i * 7919) % 3001 for i in range(40)], [17, 23, 17, 23, 17]]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def generate(folder: str, prompts, params, cost: tuple[float, float] | None = None, **options):
    """(outputs, stats, every verified run's (request id, tokens emitted)) of one engine; ``cost`` fixes
    its step cost (a, b), else drafts are kept whatever they cost."""
    with LLM(folder, **(ENGINE | options)) as llm:
        if cost is None:
            keep_every_draft(llm.llm_engine)
        else:
            llm.llm_engine.drafter.step_cost.fit = lambda: cost
        runs = record_runs(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, llm.stats(), runs


def record_runs(llm: LLM) -> list[tuple[str, list[int]]]:
    executor, runs = llm.llm_engine.model_executor, []
    execute = executor.execute_model

    def recording_execute(*args):
        result = execute(*args)
        runs.extend((r.request_id, run) for r, run, n in zip(result.requests, result.token_ids, result.num_drafts)
                    if n)
        return result

    executor.execute_model = recording_execute
    return runs


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def oracle_drafts(monkeypatch, prompts, outputs) -> None:
    """The sharp tiny Llama never repeats itself, so n-grams find nothing to draft: replace the proposer by one
    that drafts the plain run's own continuation with every third draft wrong, so that drafts are accepted and
    rejected whatever the model. (The n-gram proposer itself drafts for SmolLM2 below.)"""
    known = [(list(p), o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]

    def propose(tokens, low, high, k):
        for prompt, continuation in known:
            if tokens[:len(prompt)] == prompt:
                done = len(tokens) - len(prompt)
                return [t + 1 if (done + i) % 3 == 2 else t for i, t in enumerate(continuation[done:done + k])]
        return []

    monkeypatch.setattr("nanoengine.engine.spec_decode.propose_ngram", propose)


def assert_drafts_hit_and_missed(stats: EngineStats) -> None:
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats


# Configuration -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2.5},
     "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown key(s) ['draft_model']"),
    ("ngram", "speculative_config must be a dict"),
])
def test_bad_speculative_configs_raise_naming_the_key(folder, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(folder, speculative_config=options)


def test_lookup_bounds_default_as_in_vllm():
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(3, 5, 5)
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}) == \
        SpeculativeConfig(3, 2, 2)


def test_serve_and_engine_args_take_the_config_as_json():
    args = build_parser().parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_options(args) == {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--speculative-config", "{not json"])
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "m", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert EngineArgs.from_cli_args(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 2}


# The proposer, the rejection rule and the draft length, alone --------------------------------------------


def test_proposer_drafts_what_followed_the_longest_suffix_ngram_first_seen():
    assert propose_ngram([1, 2, 3, 4, 9, 2, 3, 4, 7, 8, 2, 3, 4], 2, 3, k=2) == [9, 2]  # the 3-gram's first
    assert propose_ngram([5, 6, 1, 2, 7, 1, 2], 2, 3, k=4) == [7, 1, 2]  # cut by the end of the tokens
    assert propose_ngram([1, 2, 3, 4, 5, 3], 2, 3, k=2) == []  # no 2-gram repeats


def test_proposer_drafts_from_the_occurrence_whose_context_agrees_longest():
    """[2, 3, 4] occurs three times before the suffix, which follows 7, 8: the occurrence at 6 follows 8 (one
    token agrees), the one at 12 follows 7, 8 (two agree); the longest agreement wins, the first of equals."""
    tokens = [1, 2, 3, 4, 9, 8, 2, 3, 4, 5, 7, 8, 2, 3, 4, 6, 7, 8, 2, 3, 4]
    assert propose_ngram(tokens, 2, 3, k=2) == [6, 7]  # vLLM's first occurrence would draft [9, 8]
    assert propose_ngram(tokens[:15], 2, 3, k=2) == [5, 7]  # there only the one at 6 agrees (8 before it)
    assert propose_ngram([1, 2, 3, 4, 5, 3], 1, 3, k=2) == [4, 5]
    assert propose_ngram([7], 1, 3, k=2) == []


def test_accepted_run_keeps_drafts_while_they_equal_the_draws():
    assert accepted_run([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, then the bonus token
    assert accepted_run([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the draw replaces the first rejected draft
    assert accepted_run([5, 6], [4, 6, 1]) == [4]
    assert accepted_run([], [3]) == [3]


def test_draft_length_grows_on_success_shrinks_on_failure_and_probes_with_backoff():
    length = DraftLength(4)
    length.update(4, 1)
    assert length.allowed() == 1
    length.update(1, 1)
    assert length.allowed() == 2
    length.update(2, 0)  # down to none: the next step skips, the one after probes with one draft
    assert [length.allowed() for _ in range(2)] == [0, 1]
    length.update(1, 0)  # a failed probe doubles the wait
    assert [length.allowed() for _ in range(3)] == [0, 0, 1]
    for _ in range(10):
        length.update(1, 0)
        waited = 0
        while length.allowed() == 0:
            waited += 1
    assert waited == spec_decode.MAX_WAIT


def test_a_new_request_starts_from_the_engines_recent_acceptance(folder, monkeypatch):
    """A fixed prior of 0.5 once kept a 16-request batch from ever drafting: its step cost asked for 0.54, and
    a request that never drafts never updates its rate. A new request now starts from the rate the engine saw."""
    assert worth_drafting([0.5], [4], 16, (0.0089, 0.00064)) == [0]
    assert worth_drafting([0.85], [4], 16, (0.0089, 0.00064))[0] > 0
    assert DraftLength(4, prior=0.85).acceptance == pytest.approx(0.85)
    oracle_drafts(monkeypatch, PROMPTS, generate(folder, PROMPTS, GREEDY)[0])  # two drafts in three accepted
    with LLM(folder, **ENGINE, speculative_config=SPEC) as llm:
        engine = llm.llm_engine
        assert engine.drafter.acceptance.value == 0.5
        keep_every_draft(engine)
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert 0.6 < engine.drafter.acceptance.value < 0.75
        engine.add_request("new", PATTERN, GREEDY)
        assert engine.requests["new"].draft_length.acceptance == engine.drafter.acceptance.value


def test_step_cost_is_fitted_once_steps_of_different_sizes_ran():
    cost = StepCost()
    for rows in (4, 8, 12, 16, 4, 8, 12):
        cost.add(rows, 0.02 + 0.001 * rows)
    assert cost.fit() is None  # fewer than MIN_COST_SAMPLES steps
    cost.add(16, 0.036)
    assert cost.fit() == pytest.approx((0.02, 0.001))
    same = StepCost()
    for _ in range(10):
        same.add(8, 0.03)
    assert same.fit() is None  # one size only: no slope to fit


def test_drafts_are_kept_while_they_raise_the_expected_rate():
    """Memory-bound (a step costs about the same whatever its rows) keeps every draft; compute-bound (each
    row costs its share) keeps none; in between the likeliest drafts go first."""
    assert worth_drafting([0.8] * 4, [4] * 4, 4, (0.03, 0.0001)) == [4] * 4
    assert worth_drafting([0.8] * 16, [4] * 16, 16, (0.001, 0.002)) == [0] * 16
    # 4 rows at a = 10 ms, b = 1 ms: 4 tokens in 14 ms; a 0.9-likely draft adds 0.9 in 1 ms, a 0.2-likely
    # one 0.2 in 1 ms, which is below the rate the step has reached by then.
    kept = worth_drafting([0.9, 0.2], [4, 4], 4, (0.010, 0.001))
    assert kept[0] == 4 and kept[1] == 0
    assert worth_drafting([0.5], [3], 1, None) == [3]  # no fit yet: every draft


def test_a_compute_bound_step_cost_drafts_nothing_and_a_memory_bound_one_drafts(folder, monkeypatch):
    plain = generate(folder, PROMPTS, GREEDY)[0]
    oracle_drafts(monkeypatch, PROMPTS, plain)
    outputs, stats, _ = generate(folder, PROMPTS, GREEDY, cost=(0.0, 1.0), speculative_config=SPEC)
    assert tokens_of(outputs) == tokens_of(plain) and stats.spec_num_draft_tokens == 0
    outputs, stats, _ = generate(folder, PROMPTS, GREEDY, cost=(1.0, 1e-6), speculative_config=SPEC)
    assert tokens_of(outputs) == tokens_of(plain) and stats.spec_num_accepted_tokens > 0


def sampling_tensors(rows: int, temperature: float, top_k: int = -1, top_p: float = 1.0) -> SamplingTensors:
    return SamplingTensors(torch.full((rows,), temperature), torch.full((rows,), top_k), torch.full((rows,), top_p),
                           torch.zeros(rows), [None] * rows, temperature == 0, top_k > 0 or top_p < 1, False)


def test_rejection_sampler_on_hand_made_logits():
    """One draft (token 1) and a bonus row: the draft is accepted with its target probability (after top-k),
    a rejection emits the target distribution without the draft, renormalised; a greedy row keeps a draft
    only when it is the argmax."""
    trials = 40_000
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = (probs.log() * 0.8).expand(2 * trials, 5).reshape(trials, 2, 5)  # temperature 0.8 undoes the 0.8
    draws = sample(logits.reshape(-1, 5), sampling_tensors(2 * trials, 0.8, top_k=3),
                   torch.Generator().manual_seed(0)).view(trials, 2).tolist()
    runs = [accepted_run([1], pair) for pair in draws]
    target = torch.tensor([0.4, 0.3, 0.2, 0, 0]) / 0.9
    accepted = sum(run[0] == 1 for run in runs)
    assert abs(accepted - trials * target[1]) < 5 * math.sqrt(trials * target[1] * (1 - target[1]))
    assert all(len(run) == 2 for run in runs if run[0] == 1) and all(len(run) == 1 for run in runs if run[0] != 1)
    rejected = torch.bincount(torch.tensor([run[0] for run in runs if run[0] != 1]), minlength=5).float()
    residual = torch.tensor([0.4, 0, 0.2, 0, 0]) / 0.6
    expected = residual * rejected.sum()
    assert rejected[[1, 3, 4]].sum() == 0
    assert (abs(rejected - expected) <= 5 * expected.sqrt() + 1e-9).all(), (rejected, expected)
    greedy = sample(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]), sampling_tensors(2, 0.0), None).tolist()
    assert accepted_run([1], greedy) == [1, 0] and accepted_run([2], greedy) == [1]


# Greedy exactness ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_path", ["roomy", "chunked_prefill", "preemption"])
def test_greedy_speculation_gives_the_plain_tokens(folder, monkeypatch, engine_path):
    """On the sharp tiny Llama; chunked prefill: 16-token steps with prompts cut into 5-token chunks (drafts are
    cut by the budget too); preemption: a KV cache of 12 blocks for four requests of up to 88 tokens."""
    options = {"roomy": {}, "chunked_prefill": dict(max_num_batched_tokens=16, long_prefill_token_threshold=5),
               "preemption": dict(num_kvcache_blocks=12)}[engine_path]
    plain, plain_stats, _ = generate(folder, PROMPTS, GREEDY, **options)
    oracle_drafts(monkeypatch, PROMPTS, plain)
    spec, stats, _ = generate(folder, PROMPTS, GREEDY, speculative_config=SPEC, **options)
    assert tokens_of(spec) == tokens_of(plain)
    assert_drafts_hit_and_missed(stats)
    if engine_path == "preemption":
        assert stats.num_preemptions > 0 and plain_stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_kvcache_blocks


def test_greedy_speculation_on_every_tiny_architecture(tiny_model):
    """With the n-gram proposer: the default random init repeats tokens, which n-grams draft."""
    _, model_dir, _ = tiny_model
    plain, _, _ = generate(model_dir, PROMPTS, GREEDY)
    spec, stats, _ = generate(model_dir, PROMPTS, GREEDY, speculative_config=SPEC)
    assert tokens_of(spec) == tokens_of(plain)
    assert stats.spec_num_drafts > 0


def test_two_ranks_give_the_plain_tokens(tmp_path, smollm2_dir, monkeypatch):
    """Drafts travel with the step; rejected drafts shorten the block tables the workers keep."""
    build_tiny_model("llama", tmp_path, smollm2_dir, initializer_range=0.5)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    plain, _, _ = generate(str(tmp_path), PROMPTS, params)
    oracle_drafts(monkeypatch, PROMPTS, plain)
    spec, stats, _ = generate(str(tmp_path), PROMPTS, params, speculative_config=SPEC, tensor_parallel_size=2,
                              num_kvcache_blocks=12)
    assert tokens_of(spec) == tokens_of(plain)
    assert stats.spec_num_accepted_tokens > 0 and stats.num_preemptions > 0
    for a, b in zip(spec, plain):
        assert [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == pytest.approx(
            [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)], abs=1e-4)


# Where a request ends, inside an accepted run ----------------------------------------------------------------


def ending_cases(folder: str, monkeypatch) -> list[SamplingParams]:
    """Stops that land in the middle of the plain output (so, with drafts, inside an accepted run)."""
    plain, _, _ = generate(folder, PROMPTS[:2], GREEDY)
    oracle_drafts(monkeypatch, PROMPTS[:2], plain)
    first, second = (o.outputs[0] for o in plain)
    return [SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[second.token_ids[21]]),
            SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[first.text[40:44]]),
            SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[first.text[40:44]],
                           include_stop_str_in_output=True)]


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(folder, monkeypatch):
    for params in ending_cases(folder, monkeypatch):
        plain, _, _ = generate(folder, PROMPTS[:2], params)
        spec, _, runs = generate(folder, PROMPTS[:2], params, speculative_config=SPEC)
        for a, b in zip(spec, plain):
            a, b = a.outputs[0], b.outputs[0]
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                             b.stop_reason)
        assert runs and max(len(run) for _, run in runs) > 1


def test_max_model_len_inside_a_run(folder, monkeypatch):
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)  # runs until max_model_len
    plain, _, _ = generate(folder, PROMPTS, params, max_model_len=64)
    oracle_drafts(monkeypatch, PROMPTS, plain)
    spec, stats, _ = generate(folder, PROMPTS, params, max_model_len=64, speculative_config=SPEC)
    assert tokens_of(spec) == tokens_of(plain)
    assert all(len(p.prompt_token_ids) + len(p.outputs[0].token_ids) == 64 for p in spec)
    assert stats.spec_num_accepted_tokens > 0


def test_min_tokens_holds_eos_back_inside_runs(smollm2_dir):
    """SmolLM2 asked to repeat a text (n-gram drafts hit); min_tokens holds EOS back past the text's end."""
    params = SamplingParams(temperature=0, max_tokens=80, min_tokens=70)
    plain, _, _ = generate(smollm2_dir, [repeat_prompt(smollm2_dir)], params, max_model_len=512)
    spec, stats, _ = generate(smollm2_dir, [repeat_prompt(smollm2_dir)], params, max_model_len=512,
                              speculative_config=SPEC)
    assert tokens_of(spec) == tokens_of(plain)
    assert stats.spec_num_accepted_tokens > 0 and len(plain[0].outputs[0].token_ids) >= 70


def test_penalties_see_each_rows_drafts_as_output(folder, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=1.5,
                            frequency_penalty=0.5, presence_penalty=0.5)
    plain, _, _ = generate(folder, PROMPTS, params)
    oracle_drafts(monkeypatch, PROMPTS, plain)
    spec, stats, _ = generate(folder, PROMPTS, params, speculative_config=SPEC)
    assert tokens_of(spec) == tokens_of(plain)
    assert_drafts_hit_and_missed(stats)
    assert tokens_of(plain) != tokens_of(generate(folder, PROMPTS, GREEDY)[0])  # the penalties change the tokens


REPEAT_TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at six, carrying a can of oil and a "
               "small brass key. From the top he could see the harbour, the fishing boats and the long grey pier.")


def repeat_prompt(smollm2_dir: str) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{REPEAT_TEXT}"}],
                                         tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def test_smollm2_repeats_its_prompt_with_the_plain_tokens_and_raw_logprobs(smollm2_dir):
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=3)
    prompts = [repeat_prompt(smollm2_dir), "The capital of France is"]
    plain, _, _ = generate(smollm2_dir, prompts, params, max_model_len=512)
    spec, stats, _ = generate(smollm2_dir, prompts, params, max_model_len=512, speculative_config=SPEC)
    assert tokens_of(spec) == tokens_of(plain)
    assert stats.spec_mean_acceptance_length > 2
    for a, b in zip(spec, plain):
        a, b = a.outputs[0], b.outputs[0]
        assert len(a.logprobs) == len(a.token_ids)
        for entry_a, entry_b in zip(a.logprobs, b.logprobs):
            assert list(entry_a) == list(entry_b)
            assert [lp.logprob for lp in entry_a.values()] == pytest.approx([lp.logprob for lp in entry_b.values()],
                                                                            abs=1e-3)


# Sampling -----------------------------------------------------------------------------------------------


def test_seeded_requests_give_the_plain_tokens_alone_in_a_batch_and_with_n(folder, monkeypatch):
    sampled = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True)
               for i in range(len(PROMPTS))]
    plain, _, _ = generate(folder, PROMPTS, sampled)
    oracle_drafts(monkeypatch, PROMPTS, plain)
    spec, stats, _ = generate(folder, PROMPTS, sampled, speculative_config=SPEC)
    assert tokens_of(spec) == tokens_of(plain)
    assert stats.spec_num_accepted_tokens > 0
    alone, _, _ = generate(folder, PROMPTS[:1], sampled[0], speculative_config=SPEC)
    assert tokens_of(alone) == tokens_of(spec)[:1]
    n = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    with_n = [sorted(c.token_ids for c in generate(folder, PROMPTS[:1], n, **spec_options)[0][0].outputs)
              for spec_options in ({}, {"speculative_config": SPEC})]
    assert with_n[0] == with_n[1]


def chi_square_p_value(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of equal distributions; categories with fewer than 10 draws are pooled."""
    counts = {}
    for label, values in ((0, a), (1, b)):
        for v in values:
            counts.setdefault(v, [0, 0])[label] += 1
    rows, pooled = [], [0, 0]
    for pair in counts.values():
        if sum(pair) >= 10:
            rows.append(pair)
        else:
            pooled = [pooled[0] + pair[0], pooled[1] + pair[1]]
    rows += [pooled] if sum(pooled) else []
    n_a, n_b = len(a), len(b)
    statistic = sum((x * math.sqrt(n_b / n_a) - y * math.sqrt(n_a / n_b)) ** 2 / (x + y) for x, y in rows)
    return torch.special.gammaincc(torch.tensor((len(rows) - 1) / 2), torch.tensor(statistic / 2)).item()


SAMPLES = 1200
CHI_SQUARE_PARAMS = dict(temperature=0.8, top_k=20, top_p=0.9, max_tokens=4, ignore_eos=True)


def spec_and_plain_samples(folder: str, monkeypatch) -> tuple[list[list[int]], list[list[int]], EngineStats]:
    """Four tokens after one prompt, SAMPLES times each way, unseeded. The drafts are the greedy continuation
    (likely tokens, so drafts are accepted and rejected often)."""
    prompt = PROMPTS[2]
    greedy = tokens_of(generate(folder, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0])[0]
    monkeypatch.setattr("nanoengine.engine.spec_decode.propose_ngram",
                        lambda tokens, low, high, k: greedy[len(tokens) - len(prompt):][:k])
    params = SamplingParams(**CHI_SQUARE_PARAMS)
    spec, stats, _ = generate(folder, [prompt] * SAMPLES, params, speculative_config=SPEC, seed=1)
    plain, _, _ = generate(folder, [prompt] * SAMPLES, params, seed=2)
    return tokens_of(spec), tokens_of(plain), stats


def positions_p_values(spec: list[list[int]], plain: list[list[int]]) -> list[float]:
    """Per output position (each drafted but the first), and for the whole 4-token sequence."""
    p_values = [chi_square_p_value([s[i] for s in spec], [s[i] for s in plain]) for i in range(4)]
    return p_values + [chi_square_p_value([tuple(s) for s in spec], [tuple(s) for s in plain])]


def test_sampling_with_drafts_draws_from_the_plain_distribution(folder, monkeypatch):
    spec, plain, stats = spec_and_plain_samples(folder, monkeypatch)
    assert_drafts_hit_and_missed(stats)
    assert min(positions_p_values(spec, plain)) > 1e-3


@pytest.mark.parametrize("wrong_rule", [
    lambda drafts, sampled: drafts + sampled[len(drafts):],  # every draft accepted
    lambda drafts, sampled: accepted_run(drafts, sampled[1:] + sampled[-1:]),  # each draft checked one row late
])
def test_a_wrong_acceptance_rule_fails_the_chi_square_test(folder, monkeypatch, wrong_rule):
    monkeypatch.setattr(model_runner_module, "accepted_run", wrong_rule)
    spec, plain, _ = spec_and_plain_samples(folder, monkeypatch)
    assert min(positions_p_values(spec, plain)) < 1e-6


# Streaming, metrics, adaptation -----------------------------------------------------------------------------


def test_delta_streaming_joins_into_the_final_output(folder, monkeypatch):
    oracle_drafts(monkeypatch, PROMPTS, generate(folder, PROMPTS, GREEDY)[0])
    with LLM(folder, speculative_config=SPEC, **ENGINE) as llm:
        engine = llm.llm_engine
        engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                           output_kind=RequestOutputKind.DELTA))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += [o.outputs[0].token_ids for o in engine.step()]
        expected = tokens_of(llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False))[0][:40]
    assert [t for d in deltas for t in d] == expected
    assert max(len(d) for d in deltas) > 1


def test_stats_trace_and_prometheus_count_drafts(folder, monkeypatch, caplog):
    oracle_drafts(monkeypatch, PROMPTS, generate(folder, PROMPTS, GREEDY)[0])
    with caplog.at_level("INFO", logger="nanoengine.trace"):
        _, stats, runs = generate(folder, PROMPTS, GREEDY, speculative_config=SPEC, trace=True)
    assert stats.spec_num_drafts == len(runs)
    assert stats.spec_num_accepted_tokens == sum(len(run) - 1 for _, run in runs)
    assert stats.spec_mean_acceptance_length == pytest.approx(1 + stats.spec_num_accepted_tokens / len(runs))
    assert "drafts" in caplog.text and "  accepted " in caplog.text
    metrics = Metrics("tiny")
    metrics.record_stats(0, stats)
    text = metrics.text().decode()
    for name, value in (("num_drafts", stats.spec_num_drafts), ("num_draft_tokens", stats.spec_num_draft_tokens),
                        ("num_accepted_tokens", stats.spec_num_accepted_tokens)):
        assert f'nanoengine:spec_decode_{name}_total{{engine="0",model_name="tiny"}} {float(value)}' in text


def test_drafts_stop_where_they_keep_failing(folder, monkeypatch):
    """Drafts that are always wrong: drafting backs off to a few tokens per hundred generated, where a fixed
    length would draft four on every step."""
    monkeypatch.setattr("nanoengine.engine.spec_decode.propose_ngram", lambda tokens, low, high, k: [0] * k)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    _, stats, _ = generate(folder, PROMPTS, params, speculative_config=SPEC)
    assert stats.spec_num_accepted_tokens == 0
    assert 0 < stats.spec_num_draft_tokens < 0.1 * len(PROMPTS) * 120, stats


def test_a_request_that_fails_in_a_drafted_step_ends_alone(folder, monkeypatch):
    plain = generate(folder, PROMPTS[:2], GREEDY)[0]
    oracle_drafts(monkeypatch, PROMPTS[:2], plain)
    with LLM(folder, speculative_config=SPEC, **ENGINE) as llm:
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS[:2]):  # params of their own: one is broken below
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        outputs = engine.step() + engine.step()
        assert all(r.spec_token_ids for r in engine.requests.values())  # the next step verifies drafts
        engine.requests["1"].params.top_k = 2**70  # fails building the sampling tensors
        while engine.has_unfinished_requests():
            outputs += engine.step()
        stats = llm.stats()
    final = {o.request_id: o.outputs[0] for o in outputs if o.finished}
    assert final["1"].finish_reason == "error"
    assert final["0"].token_ids == plain[0].outputs[0].token_ids
    assert stats.num_free_blocks == stats.num_kvcache_blocks and stats.spec_num_accepted_tokens > 0
