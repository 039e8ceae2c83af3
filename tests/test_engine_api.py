"""The engine loop as vLLM users drive it: add_request / step / abort_request, output kinds, policies, stops,
logprobs, seeds, metrics, and bad input that must leave the engine as it was."""

import random

import pytest
import torch
from conftest import hf_greedy

from nanoengine import LLM, RequestOutputKind, SamplingParams

rng = random.Random(0)
PROMPT = [rng.randrange(100, 40000) for _ in range(20)]
OTHER_PROMPTS = [[rng.randrange(100, 40000) for _ in range(n)] for n in (7, 33, 12)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_steps(engine) -> list[list]:
    """Step until nothing is left; return each step's outputs."""
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def outputs_by_id(steps: list[list]) -> dict[str, list]:
    by_id = {}
    for outputs in steps:
        assert len({o.request_id for o in outputs}) == len(outputs)  # one output per request per step
        for output in outputs:
            by_id.setdefault(output.request_id, []).append(output)
    return by_id


def record_schedules(engine) -> list:
    """Wrap the scheduler so that every SchedulerOutput is kept, as (request ids, new tokens) pairs."""
    schedules = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        schedules.append(([r.request_id for r in out.requests], list(out.num_new_tokens)))
        return out

    engine.scheduler.schedule = recording_schedule
    return schedules


def record_preemptions(engine) -> list[dict]:
    """Wrap Scheduler.preempt: note the victim, every running request's order key, and the waiting queue after."""
    scheduler = engine.scheduler
    preemptions = []
    preempt = scheduler.preempt

    def recording_preempt(request):
        keys = {r.request_id: scheduler.order_key(r) for r in scheduler.running}
        preempt(request)
        preemptions.append({"victim": request.request_id, "running_keys": keys,
                            "waiting": [r.request_id for r in scheduler.waiting],
                            "waiting_keys": [scheduler.order_key(r) for r in scheduler.waiting]})

    scheduler.preempt = recording_preempt
    return preemptions


# Output kinds --------------------------------------------------------------------------------------------


def test_step_outputs_follow_each_output_kind(llm, hf_model):
    engine = llm.llm_engine
    expected = hf_greedy(hf_model, PROMPT, 6)
    for kind in RequestOutputKind:
        engine.add_request(kind.name, PROMPT, greedy(6, output_kind=kind))
    by_id = outputs_by_id(run_steps(engine))
    text = llm.get_tokenizer().decode(expected)

    cumulative = by_id["CUMULATIVE"]
    assert [o.outputs[0].token_ids for o in cumulative] == [expected[:n] for n in range(1, 7)]
    assert [o.finished for o in cumulative] == [False] * 5 + [True]
    assert cumulative[-1].outputs[0].text == text
    assert all(text.startswith(o.outputs[0].text) for o in cumulative)

    delta = by_id["DELTA"]
    assert [o.outputs[0].token_ids for o in delta] == [[t] for t in expected]
    assert "".join(o.outputs[0].text for o in delta) == text
    assert [o.finished for o in delta] == [False] * 5 + [True]

    [final] = by_id["FINAL_ONLY"]
    assert final.finished and final.outputs[0].token_ids == expected and final.outputs[0].text == text
    assert final.outputs[0].finish_reason == "length"


def test_a_request_still_prefilling_has_no_output(folder, hf_model):
    with LLM(folder, max_model_len=128, num_kvcache_blocks=64, long_prefill_token_threshold=8) as llm:
        engine = llm.llm_engine
        engine.add_request("long", OTHER_PROMPTS[1], greedy(3))  # 33 tokens: 5 steps of at most 8
        steps = run_steps(engine)
    assert [len(outputs) for outputs in steps] == [0, 0, 0, 0, 1, 1, 1]
    assert steps[-1][0].outputs[0].token_ids == hf_greedy(hf_model, OTHER_PROMPTS[1], 3)


# Abort and request ids -----------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once_and_the_id_never_reappears(llm, hf_model):
    engine = llm.llm_engine
    total = llm.stats().num_kvcache_blocks
    engine.add_request("doomed", OTHER_PROMPTS[1], greedy(40))
    engine.add_request("kept", PROMPT, greedy(8))
    steps = [engine.step(), engine.step()]
    held_by_kept = len(engine.requests["kept"].block_ids)
    assert llm.stats().num_free_blocks < total - held_by_kept  # "doomed" holds blocks too

    engine.abort_request("doomed")
    assert llm.stats().num_free_blocks == total - held_by_kept
    assert "doomed" not in engine.requests
    engine.abort_request(["doomed", "never-added"])  # unknown or gone: ignored
    steps += run_steps(engine)
    by_id = outputs_by_id(steps)
    assert all(not o.finished for o in by_id["doomed"]) and len(by_id["doomed"]) == 2
    assert by_id["kept"][-1].outputs[0].token_ids == hf_greedy(hf_model, PROMPT, 8)
    assert llm.stats().num_free_blocks == total


def test_abort_a_waiting_request(llm):
    engine = llm.llm_engine
    engine.add_request("waiting", PROMPT, greedy(4))
    engine.abort_request("waiting")
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_duplicate_request_id_raises_and_queues_nothing(llm, hf_model):
    engine = llm.llm_engine
    engine.add_request("dup", PROMPT, greedy(3))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", OTHER_PROMPTS[0], greedy(3))
    assert len(engine.scheduler.waiting) == 1
    final = outputs_by_id(run_steps(engine))["dup"][-1]
    assert final.outputs[0].token_ids == hf_greedy(hf_model, PROMPT, 3)
    engine.add_request("dup", OTHER_PROMPTS[0], greedy(3))  # a finished request's id is free again
    run_steps(engine)


# Scheduling policies ------------------------------------------------------------------------------------


def test_lower_priority_value_runs_first_ties_by_arrival(folder):
    with LLM(folder, max_model_len=128, num_kvcache_blocks=64, scheduling_policy="priority", max_num_seqs=1) as llm:
        engine = llm.llm_engine
        for rid, priority in [("p3", 3), ("p1-first", 1), ("p2", 2), ("p0", 0), ("p1-second", 1)]:
            engine.add_request(rid, PROMPT, greedy(2), priority=priority)
        finished = [o.request_id for outputs in run_steps(engine) for o in outputs if o.finished]
        assert finished == ["p0", "p1-first", "p1-second", "p2", "p3"]

        outputs = llm.generate([PROMPT] * 4, greedy(2), priority=[2, 0, 3, 1], use_tqdm=False)
        by_finish = sorted(range(4), key=lambda i: outputs[i].metrics.finished_time)
        assert by_finish == [1, 3, 0, 2]


def test_priority_under_fcfs_is_refused(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.llm_engine.add_request("p", PROMPT, greedy(2), priority=1)
    assert not llm.llm_engine.has_unfinished_requests()


def test_fcfs_preempts_the_last_admitted_request_even_on_an_arrival_tie(folder, hf_model):
    """vLLM's FCFS victim is the last of the running list; the victim then resumes first."""
    with LLM(folder, max_model_len=32, kvcache_block_size=4, num_kvcache_blocks=8, max_num_seqs=3) as llm:
        engine = llm.llm_engine
        preemptions = record_preemptions(engine)
        prompts = {rid: OTHER_PROMPTS[1][i:i + 6] for i, rid in enumerate("ABC")}
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, greedy(10), arrival_time=1.0)
        by_id = outputs_by_id(run_steps(engine))
    assert preemptions and preemptions[0]["victim"] == "C"
    for p in preemptions:
        assert p["victim"] == list(p["running_keys"])[-1]
        assert p["waiting"][0] == p["victim"]
    for rid, prompt in prompts.items():
        assert by_id[rid][-1].outputs[0].token_ids == hf_greedy(hf_model, prompt, 10)


def test_priority_preemption_picks_the_least_important_running_request(folder, hf_model):
    # 4-token blocks, 8 of them: three requests of 6 prompt tokens grow to 16 tokens (4 blocks) each.
    with LLM(folder, max_model_len=32, kvcache_block_size=4, num_kvcache_blocks=8, scheduling_policy="priority",
             max_num_seqs=3) as llm:
        engine = llm.llm_engine
        preemptions = record_preemptions(engine)
        schedules = record_schedules(engine)
        prompts = {rid: OTHER_PROMPTS[1][i:i + 6] for i, rid in enumerate("ABCD")}
        # A, B, C run; D comes later and waits. A is the least important running request (the largest priority
        # value). Preempted, A resumes after the more important D.
        rank = {"A": (3.0, 2), "B": (1.0, 0), "C": (2.0, 1), "D": (4.0, 1)}
        steps = []
        for rid, (arrival, priority) in rank.items():
            if rid == "D":
                steps.append(engine.step())
            engine.add_request(rid, prompts[rid], greedy(10), arrival_time=arrival, priority=priority)
        by_id = outputs_by_id(steps + run_steps(engine))

    assert preemptions and preemptions[0]["victim"] == "A"
    assert preemptions[0]["waiting"] == ["D", "A"]
    for p in preemptions:
        assert p["running_keys"][p["victim"]] == max(p["running_keys"].values())
        assert p["waiting_keys"] == sorted(p["waiting_keys"])
    # A was scheduled before C ran out of blocks: it left that step's batch, and gave its tokens back.
    step_with_victim = next(ids for ids, _ in schedules if "A" not in ids and "C" in ids)
    assert set(step_with_victim) == {"B", "C"}
    for rid, prompt in prompts.items():
        assert by_id[rid][-1].outputs[0].token_ids == hf_greedy(hf_model, prompt, 10)


def test_victim_scheduled_earlier_in_the_step_leaves_no_stale_prefix_cache(folder, hf_model):
    """A victim's blocks for this step were named for the prefix cache before its KV was written; when it is
    preempted in that same step they must not stay cached, or its resumed prefill reads garbage."""
    with LLM(folder, num_kvcache_blocks=7, max_model_len=112, max_num_batched_tokens=48,
             long_prefill_token_threshold=32, scheduling_policy="priority") as llm:
        engine = llm.llm_engine
        long_prompt = (OTHER_PROMPTS[1] * 4)[:100]
        engine.add_request("X", long_prompt, greedy(8), priority=1)
        steps = [engine.step()]  # X prefills 32 tokens
        engine.add_request("Y", PROMPT[:16], greedy(3), priority=0)
        steps += run_steps(engine)
        assert llm.stats().num_preemptions == 1
    by_id = outputs_by_id(steps)
    assert by_id["X"][-1].outputs[0].token_ids == hf_greedy(hf_model, long_prompt, 8)


def test_victim_already_scheduled_gives_its_tokens_back(folder):
    """r1 runs out of blocks after r0 (the least important) was scheduled: r0 leaves the batch, and its token
    goes back to the step's budget, which r2's prefill chunk then fills."""
    with LLM(folder, max_model_len=40, kvcache_block_size=4, num_kvcache_blocks=10, max_num_batched_tokens=12,
             scheduling_policy="priority") as llm:
        engine = llm.llm_engine
        schedules = record_schedules(engine)
        for k, (length, priority, max_tokens) in enumerate([(16, 1, 3), (16, 0, 10), (17, 0, 5)]):
            engine.add_request(f"r{k}", list(range(100 + 50 * k, 100 + 50 * k + length)), greedy(max_tokens),
                               priority=priority)
            engine.step()
        engine.step()
        assert llm.stats().num_preemptions == 1
    assert schedules[-1] == (["r1", "r2"], [1, 11])


def test_unwritten_kv_slots_never_reach_the_output(folder, hf_model):
    """The CPU cache is allocated with empty(), so a slot holds garbage (even NaN) until it is written."""
    prompts = [PROMPT, OTHER_PROMPTS[0], OTHER_PROMPTS[2]]
    with LLM(folder, max_model_len=64, kvcache_block_size=4, num_kvcache_blocks=24) as llm:
        llm.llm_engine.model_executor.runner.kv_cache.fill_(float("nan"))
        outputs = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 8) for p in prompts]


def test_long_prefill_token_threshold_bounds_every_request(folder, hf_model):
    prompts = [OTHER_PROMPTS[1], PROMPT, OTHER_PROMPTS[0]]
    with LLM(folder, max_model_len=128, num_kvcache_blocks=64, long_prefill_token_threshold=5) as llm:
        schedules = record_schedules(llm.llm_engine)
        outputs = llm.generate(prompts, greedy(4), use_tqdm=False)
    per_request = [n for _, tokens in schedules for n in tokens]
    assert max(per_request) == 5 and per_request.count(5) >= 33 // 5
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 4) for p in prompts]


# Stops --------------------------------------------------------------------------------------------------


def streamed_texts(llm, prompt, max_tokens: int) -> list[str]:
    """The text after each generated token, as CUMULATIVE outputs report it without stops."""
    engine = llm.llm_engine
    engine.add_request("probe", prompt, greedy(max_tokens))
    return [o.outputs[0].text for outputs in run_steps(engine) for o in outputs]


def boundary_stop(texts: list[str]) -> tuple[str, int, int]:
    """A 2-character stop string across a token boundary: (stop, tokens up to it, where it starts)."""
    final = texts[-1]
    for k in range(len(texts) - 1):
        at = len(texts[k]) - 1
        stop = final[at:at + 2]
        if at >= 1 and len(texts[k + 1]) > at + 1 and final.find(stop) == at:
            return stop, k + 2, at
    raise AssertionError("no token boundary to put a stop string on")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(llm, include):
    texts = streamed_texts(llm, PROMPT, 12)
    stop, num_tokens, at = boundary_stop(texts)
    engine = llm.llm_engine
    for kind in RequestOutputKind:
        engine.add_request(kind.name, PROMPT, greedy(12, stop=[stop], include_stop_str_in_output=include,
                                                    output_kind=kind))
    by_id = outputs_by_id(run_steps(engine))
    expected_text = texts[-1][:at + 2] if include else texts[-1][:at]
    for outputs in by_id.values():
        final = outputs[-1].outputs[0]
        assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert len(by_id["FINAL_ONLY"][0].outputs[0].token_ids) == num_tokens
    assert by_id["CUMULATIVE"][-1].outputs[0].text == by_id["FINAL_ONLY"][0].outputs[0].text == expected_text
    assert len(by_id["CUMULATIVE"][-1].outputs[0].token_ids) == num_tokens
    # Streamed text is never taken back: what may start a stop string is held until it is known not to.
    assert all(expected_text.startswith(o.outputs[0].text) for o in by_id["CUMULATIVE"])
    assert "".join(o.outputs[0].text for o in by_id["DELTA"]) == expected_text


def test_stop_token_ids(llm, hf_model):
    expected = hf_greedy(hf_model, PROMPT, 8)
    k = next(i for i in range(2, 8) if expected[i] not in expected[:i])
    stop_id = expected[k]
    tokenizer = llm.get_tokenizer()
    for include in (False, True):
        params = greedy(8, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        [final] = llm.generate([PROMPT], params, use_tqdm=False)
        engine = llm.llm_engine
        engine.add_request("streamed", PROMPT, greedy(8, stop_token_ids=[stop_id], include_stop_str_in_output=include))
        streamed = run_steps(engine)[-1][0]
        for output in (final.outputs[0], streamed.outputs[0]):
            assert output.token_ids == expected[:k + 1]
            assert (output.finish_reason, output.stop_reason) == ("stop", stop_id)
            # As in vLLM, the stop token's text is left out unless include_stop_str_in_output.
            assert output.text == tokenizer.decode(expected[:k + 1] if include else expected[:k])


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(llm, hf_model):
    expected = hf_greedy(hf_model, PROMPT, 8)
    [banned] = llm.generate([PROMPT], greedy(8, stop_token_ids=[expected[0]], min_tokens=3), use_tqdm=False)
    tokens = banned.outputs[0].token_ids
    assert tokens[0] != expected[0] and expected[0] not in tokens[:3]
    assert banned.outputs[0].finish_reason == "length" or (tokens[-1] == expected[0] and len(tokens) > 3)

    first_char = streamed_texts(llm, PROMPT, 1)[0][:1]
    [held] = llm.generate([PROMPT], greedy(8, stop=first_char, min_tokens=4), use_tqdm=False)
    assert len(held.outputs[0].token_ids) > 4 and held.outputs[0].token_ids == expected[:len(held.outputs[0].token_ids)]
    [unheld] = llm.generate([PROMPT], greedy(8, stop=first_char), use_tqdm=False)
    assert unheld.outputs[0].token_ids == expected[:1] and unheld.outputs[0].text == ""


# Logprobs -----------------------------------------------------------------------------------------------


def check_logprobs_match_transformers(llm, hf_model, prompt, output, num_top: int) -> None:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output.token_ids])).logits[0, len(prompt) - 1:-1]
    reference = logits.float().log_softmax(dim=-1)
    tokenizer = llm.get_tokenizer()
    assert len(output.logprobs) == len(output.token_ids)
    for row, token_id, entry in zip(reference, output.token_ids, output.logprobs):
        sampled = entry[token_id]
        assert sampled.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert sampled.rank == int((row > row[token_id]).sum()) + 1
        assert sampled.decoded_token == tokenizer.decode([token_id])
        top_values, top_ids = row.topk(num_top)
        top = {tid: lp for tid, lp in entry.items() if lp.rank <= num_top}
        assert sorted(top) == sorted(top_ids.tolist())
        for value, tid in zip(top_values.tolist(), top_ids.tolist()):
            assert top[tid].logprob == pytest.approx(value, abs=1e-4)
        assert set(entry) == set(top) | {token_id}
    assert output.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(output.logprobs,
                                                                                       output.token_ids)))


def test_logprobs_match_transformers(llm, hf_model):
    expected = hf_greedy(hf_model, PROMPT, 5)
    params = [greedy(5, logprobs=3),
              SamplingParams(temperature=0.7, seed=1, max_tokens=5, ignore_eos=True, logprobs=2),  # raw: no temp.
              greedy(5, logprobs=0, stop_token_ids=[expected[0]], min_tokens=2)]  # raw: before min_tokens' ban
    outputs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    for output, p in zip(outputs, params):
        check_logprobs_match_transformers(llm, hf_model, PROMPT, output.outputs[0], p.logprobs)
    banned_first = outputs[2].outputs[0]
    assert banned_first.token_ids[0] != expected[0] and banned_first.logprobs[0][banned_first.token_ids[0]].rank == 2


def test_delta_outputs_carry_only_new_logprobs(llm):
    engine = llm.llm_engine
    engine.add_request("delta", PROMPT, greedy(4, logprobs=1, output_kind=RequestOutputKind.DELTA))
    deltas = outputs_by_id(run_steps(engine))["delta"]
    assert [len(o.outputs[0].logprobs) for o in deltas] == [1, 1, 1, 1]
    assert [next(iter(o.outputs[0].logprobs[0].values())).rank for o in deltas] == [1, 1, 1, 1]


# Seeds --------------------------------------------------------------------------------------------------


def test_seeded_requests_reproduce_in_any_batch(llm, folder):
    seeded = SamplingParams(temperature=1.0, top_k=100, seed=1234, max_tokens=10, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    [alone] = llm.generate([PROMPT], seeded, use_tqdm=False)
    alone = alone.outputs[0].token_ids
    crowd = llm.generate([OTHER_PROMPTS[0], PROMPT, OTHER_PROMPTS[1], PROMPT], [noise, seeded, greedy(3), seeded],
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == crowd[3].outputs[0].token_ids == alone
    # Chunked prefills and preemption (recompute) replay the same context; the seeded draws continue.
    with LLM(folder, max_model_len=64, kvcache_block_size=4, num_kvcache_blocks=16, max_num_batched_tokens=12) as tight:
        squeezed = tight.generate([PROMPT, OTHER_PROMPTS[0], PROMPT, OTHER_PROMPTS[2]],
                                  [seeded, noise, noise, seeded], use_tqdm=False)
        assert tight.stats().num_preemptions > 0
    assert squeezed[0].outputs[0].token_ids == alone
    assert alone != llm.generate([PROMPT], noise, use_tqdm=False)[0].outputs[0].token_ids  # the seed matters


# Metrics ------------------------------------------------------------------------------------------------


def test_metrics_and_cached_tokens(llm):
    llm.reset_prefix_cache()
    [first] = llm.generate([PROMPT], greedy(5), use_tqdm=False)
    m = first.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_generation_tokens == 5
    assert m.time_to_first_token == m.first_token_time - m.arrival_time > 0
    assert m.time_per_output_token == pytest.approx((m.last_token_time - m.first_token_time) / 4)
    assert m.time_per_output_token > 0
    assert first.num_cached_tokens == 0
    [second] = llm.generate([PROMPT], greedy(5), use_tqdm=False)
    assert second.num_cached_tokens == 16  # one full block; the last prompt token is always computed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_stats_track_kv_usage_and_queues(llm):
    engine = llm.llm_engine
    history_before = len(llm.stats().step_history)
    engine.add_request("a", PROMPT, greedy(3))
    engine.add_request("b", OTHER_PROMPTS[1], greedy(3))
    engine.step()
    mid = llm.stats()
    assert (mid.num_running, mid.num_waiting) == (2, 0)
    assert mid.kv_cache_usage == pytest.approx((2 + 3) / 64)  # 20 and 34 tokens in 16-token blocks
    assert mid.step_history[-1] == (2, 0, mid.kv_cache_usage)
    run_steps(engine)
    end = llm.stats()
    assert len(end.step_history) == history_before + 3
    assert end.step_history[-1] == (0, 0, 0.0) and end.kv_cache_usage == 0


# Bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, error, field", [
    ({"params": "greedy"}, TypeError, "sampling_params"),
    ({"priority": "high"}, TypeError, "priority"),
    ({"priority": 2}, ValueError, "priority"),  # this engine is FCFS
    ({"params": SamplingParams(logprobs=10**6)}, ValueError, "logprobs"),
    ({"params": SamplingParams(stop_token_ids=[10**6])}, ValueError, "stop_token_ids"),
    ({"prompt": []}, ValueError, "prompt_token_ids"),
    ({"prompt": [1, 10**6]}, ValueError, "vocabulary"),
    ({"prompt": {"prompt_token_ids": "text"}}, TypeError, "prompt_token_ids"),
    ({"prompt": {"prompt": [1, 2]}}, TypeError, "prompt"),
    ({"prompt": [5] * 200}, ValueError, "max_model_len"),
    ({"request_id": 7}, TypeError, "request_id"),
    ({"request_id": "steady"}, ValueError, "steady"),
    ({"params": SamplingParams(logprobs=21)}, ValueError, "max_logprobs"),
    ({"prompt": {"prompt": "caf\ud800", "cache_salt": "a"}}, ValueError, "prompt is not valid Unicode"),
    ({"prompt": {"prompt_token_ids": PROMPT, "cache_salt": "\ud800"}}, ValueError, "cache_salt is not valid Unicode"),
])
def test_bad_request_raises_and_running_requests_are_untouched(llm, hf_model, bad, error, field):
    engine = llm.llm_engine
    engine.add_request("steady", PROMPT, greedy(6))
    steps = [engine.step(), engine.step()]
    request = {"request_id": "bad", "prompt": OTHER_PROMPTS[0], "params": greedy(2), **bad}
    with pytest.raises(error, match=field):
        engine.add_request(request["request_id"], request["prompt"], request["params"],
                           priority=request.get("priority", 0))
    if "request_id" not in bad:  # generate() names its own requests
        with pytest.raises(error, match=field):
            llm.generate([OTHER_PROMPTS[2], request["prompt"]], [greedy(2), request["params"]],
                         priority=[0, request.get("priority", 0)], use_tqdm=False)
    assert list(engine.requests) == ["steady"] and len(engine.scheduler.running) == 1
    assert not engine.scheduler.waiting
    steps += run_steps(engine)
    assert outputs_by_id(steps)["steady"][-1].outputs[0].token_ids == hf_greedy(hf_model, PROMPT, 6)


def overflowing_top_k(request) -> None:
    request.params.top_k = 2**70  # fails building the sampling tensors


def a_token_that_is_no_int(request) -> None:
    request.all_token_ids[3] = "3"  # fails building the input ids, before the forward pass


@pytest.mark.parametrize("corrupt", [overflowing_top_k, a_token_that_is_no_int])
def test_a_request_that_fails_inside_a_step_ends_alone_with_an_error(llm, hf_model, corrupt):
    """The last line of defence, for a request that slipped past validation: the step isolates it."""
    engine = llm.llm_engine
    engine.add_request("before", PROMPT, greedy(6))
    engine.step()
    bad = engine.make_request("bad", OTHER_PROMPTS[0], greedy(4))
    engine.enqueue(bad)
    corrupt(bad)
    engine.add_request("after", OTHER_PROMPTS[1], greedy(5))
    by_id = outputs_by_id(run_steps(engine))
    assert [o.outputs[0].finish_reason for o in by_id["bad"]] == ["error"]
    assert by_id["bad"][0].outputs[0].token_ids == []
    assert by_id["before"][-1].outputs[0].token_ids == hf_greedy(hf_model, PROMPT, 6)
    assert by_id["after"][-1].outputs[0].token_ids == hf_greedy(hf_model, OTHER_PROMPTS[1], 5)
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks) and not engine.requests
