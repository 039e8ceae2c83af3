"""Property-based tests of the scheduler and the block manager together, driven through the engine API.

Hypothesis writes workloads: requests arriving between steps with prompts that share random prefixes (and may
repeat them, for n-gram drafts), random priorities and cache salts, random aborts, on engines whose tiny KV
caches force preemption and whose small token budgets force chunked prefills; one of them drafts, one keeps its
cache in int8 (compared with a run alone on an int8 cache). After every
step the block bookkeeping and the step's schedule are checked; at the end every block must be free and every
finished request must have produced exactly what it produces when it runs alone. The same workloads run again
with a block hash only two bits wide, so that hashes collide all the time: hits must stay exact.
"""

import math
from collections import Counter, defaultdict
from itertools import count

import pytest
import torch
from conftest import keep_every_draft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoengine import LLM, SamplingParams
from nanoengine.engine.block_manager import HASH_ALGOS, hash_block

ENGINES = {  # all with 4-token blocks and max_model_len 48, so prompt + max_tokens (at most 38) always fits
    "fcfs-tight-cache": dict(scheduling_policy="fcfs", num_kvcache_blocks=12, max_num_batched_tokens=10,
                             max_num_seqs=3),
    "priority-chunked": dict(scheduling_policy="priority", num_kvcache_blocks=12, max_num_batched_tokens=16,
                             max_num_seqs=4, long_prefill_token_threshold=5),
    "fcfs-no-prefix-cache": dict(scheduling_policy="fcfs", num_kvcache_blocks=12, max_num_batched_tokens=12,
                                 max_num_seqs=4, enable_prefix_caching=False),
    "fcfs-int8-kv-cache": dict(scheduling_policy="fcfs", num_kvcache_blocks=12, max_num_batched_tokens=10,
                               max_num_seqs=3, kv_cache_dtype="int8"),
    "fcfs-speculative": dict(scheduling_policy="fcfs", num_kvcache_blocks=12, max_num_batched_tokens=10,
                             max_num_seqs=3, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                 "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
}
COMMON = dict(kvcache_block_size=4, max_model_len=48)
SALTS = (None, "tenant-a", "tenant-b")
request_ids = count()

tokens = st.integers(min_value=100, max_value=40000)
arrivals = st.fixed_dictionaries({
    "prefix": st.integers(min_value=0, max_value=2),
    "suffix": st.lists(tokens, min_size=1, max_size=12),
    "echo": st.booleans(),  # the suffix repeats the prefix's start instead
    "priority": st.integers(min_value=0, max_value=3),
    "salt": st.sampled_from(SALTS),
    "max_tokens": st.integers(min_value=1, max_value=8),
    "seed": st.none() | st.integers(min_value=0, max_value=3),  # None: greedy
})
rounds = st.fixed_dictionaries({
    "arrivals": st.lists(arrivals, max_size=4),
    "abort": st.integers(min_value=0, max_value=11),  # below ABORT_BELOW: abort a live request, chosen by it
    "steps": st.integers(min_value=1, max_value=2),
})
ABORT_BELOW = 3
workloads = st.fixed_dictionaries({
    "prefixes": st.lists(st.lists(tokens, min_size=4, max_size=18), min_size=3, max_size=3),
    "rounds": st.lists(rounds, min_size=2, max_size=8),
})


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def two_bit_hash():
    """A test-only hash algorithm: xxh3 cut to two bits, so most blocks share a hash with others."""
    digest, width = HASH_ALGOS["xxhash"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(HASH_ALGOS, "two-bits", (lambda data: digest(data) & 0b11, width))
        yield "two-bits"


@pytest.fixture(scope="module")
def engines(sharp_tiny_model, run_alone):
    llms = {name: LLM(sharp_tiny_model[0], **COMMON, **options) for name, options in ENGINES.items()}
    for llm in llms.values():
        record_schedules(llm.llm_engine)
        if llm.config.speculative is not None:
            draft_from_alone(llm.llm_engine, run_alone)
            keep_every_draft(llm.llm_engine)
    yield {name: llm.llm_engine for name, llm in llms.items()}
    for llm in llms.values():
        stats = llm.stats()
        llm.close()
        if llm.config.speculative is not None:  # the workloads did accept and reject drafts
            assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, stats


@pytest.fixture(scope="module")
def run_alone(sharp_tiny_model):
    """A request's output when it has a roomy engine to itself: no preemption, no chunking, no prefix cache."""
    with LLM(sharp_tiny_model[0], **COMMON, num_kvcache_blocks=64, enable_prefix_caching=False) as llm:
        yield outputs_of(llm)


@pytest.fixture(scope="module")
def run_alone_int8(sharp_tiny_model):
    """The same with an int8 KV cache, for the engine that has one (the cache's rounding changes a seeded draw)."""
    with LLM(sharp_tiny_model[0], **COMMON, num_kvcache_blocks=64, enable_prefix_caching=False,
             kv_cache_dtype="int8") as llm:
        yield outputs_of(llm)


def outputs_of(llm: LLM):
    known = {}

    def alone(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params.max_tokens, params.seed)
        if key not in known:
            known[key] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        return known[key]

    return alone


def record_schedules(engine) -> None:
    """Keep the latest step's SchedulerOutput on the engine, with what each scheduled request held then:
    (request, num_computed_tokens, num_new_tokens, block ids, its tokens and drafts), and the running queue."""
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = engine.last_schedule = schedule()
        engine.last_running = list(engine.scheduler.running)
        engine.last_schedule_state = [(r, r.num_computed_tokens, n, list(r.block_ids), r.all_token_ids + d)
                                      for r, n, d in zip(out.requests, out.num_new_tokens, out.drafts)]
        return out

    engine.scheduler.schedule = recording_schedule


def draft_from_alone(engine, alone) -> None:
    """The sharp model never repeats itself, so n-gram drafts are almost always rejected: on every other step
    a request drafts its own continuation instead (its output alone), every third draft wrong."""
    propose = engine.drafter.propose

    def proposing(requests):
        propose(requests)
        for r in requests:
            done = r.num_output_tokens
            if not r.is_finished and done % 2 == 0:
                room = min(r.max_tokens - done, COMMON["max_model_len"] - r.num_tokens) - 1
                drafts = alone(r.prompt_token_ids, r.params)[done:done + min(3, room)]
                r.spec_token_ids = [t + 1 if (done + i) % 3 == 2 else t for i, t in enumerate(drafts)]

    engine.drafter.propose = proposing


def params_for(arrival: dict) -> SamplingParams:
    if arrival["seed"] is None:
        return SamplingParams(temperature=0, max_tokens=arrival["max_tokens"], ignore_eos=True)
    return SamplingParams(temperature=0.8, top_k=200, seed=arrival["seed"], max_tokens=arrival["max_tokens"],
                          ignore_eos=True)


class Workload:
    """Drives one engine through a workload and checks it after every step."""

    def __init__(self, engine):
        self.engine = engine
        self.config = engine.config
        self.requests = {}  # every request added, by id
        self.prompts = {}
        self.aborted: set[str] = set()
        self.finished: dict[str, list[int]] = {}  # id -> output tokens
        self.salt_of_named_block: dict[int, str | None] = {}  # block serial (one naming) -> its salt
        # (block id, offset) -> (salt, the tokens up to and including the one whose KV was written there)
        self.kv_written: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}

    def add(self, arrival: dict, prefixes: list[list[int]]) -> None:
        rid = f"req-{next(request_ids)}"
        prefix, suffix = prefixes[arrival["prefix"]], arrival["suffix"]
        prompt = prefix + (prefix[:len(suffix)] if arrival["echo"] else suffix)
        priority = arrival["priority"] if self.config.scheduling_policy == "priority" else 0
        self.engine.add_request(rid, {"prompt_token_ids": prompt, "cache_salt": arrival["salt"]},
                                params_for(arrival), priority=priority)
        self.requests[rid] = self.engine.requests[rid]
        self.prompts[rid] = prompt

    def abort(self, pick: int) -> None:
        live = sorted(self.engine.requests)
        if live:
            rid = live[pick % len(live)]
            self.engine.abort_request(rid)
            self.aborted.add(rid)
            self.check_blocks()

    def step(self) -> None:
        live_before = set(self.engine.requests)
        outputs = self.engine.step()
        self.check_schedule(live_before)
        self.record_kv_writes()
        self.check_outputs(outputs)
        self.check_blocks()
        self.check_prefix_cache_holds_its_kv()

    def check_schedule(self, live_before: set[str]) -> None:
        out = self.engine.last_schedule
        ids = [r.request_id for r in out.requests]
        assert len(ids) == len(set(ids)) and set(ids) <= live_before
        assert out.total_tokens <= self.config.max_num_batched_tokens
        assert len(ids) <= self.config.max_num_seqs
        assert len(self.engine.scheduler.running) <= self.config.max_num_seqs
        assert all(n >= 1 for n in out.num_new_tokens)
        if self.config.long_prefill_token_threshold:
            assert max(out.num_new_tokens, default=0) <= self.config.long_prefill_token_threshold
        for (_, num_computed, num_new, _, written), drafts in zip(self.engine.last_schedule_state, out.drafts):
            if drafts:  # only a decode drafts (never a prefill chunk), at most num_speculative_tokens
                assert num_computed == len(written) - len(drafts) - 1
                assert num_new == 1 + len(drafts) <= 1 + self.config.speculative.num_speculative_tokens
        if any(out.drafts):  # the budget cuts drafts before requests
            assert all(r in out.requests for r in self.engine.last_running)

    def record_kv_writes(self) -> None:
        size = self.engine.block_manager.block_size
        for request, num_computed, num_new, block_ids, written in self.engine.last_schedule_state:
            for position in range(num_computed, num_computed + num_new):
                self.kv_written[block_ids[position // size], position % size] = (
                    request.cache_salt, tuple(written[:position + 1]))

    def check_prefix_cache_holds_its_kv(self) -> None:
        """Every block the prefix cache names holds the KV of exactly the prefix its hash names."""
        size = self.engine.block_manager.block_size
        for block_hash, block in self.engine.block_manager.cached_blocks.items():
            writes = [self.kv_written.get((block.block_id, offset)) for offset in range(size)]
            assert all(writes), f"block {block.block_id} is cached but was not fully written"
            salt, prefix = writes[-1]
            assert writes == [(salt, prefix[:len(prefix) - size + 1 + offset]) for offset in range(size)]
            assert prefix[-size:] == block.token_ids
            chained = None
            for start in range(0, len(prefix), size):
                chained = hash_block(chained, list(prefix[start:start + size]), salt,
                                     self.engine.block_manager.hash_algo)
            assert chained == block_hash

    def check_outputs(self, outputs) -> None:
        for output in outputs:
            rid = output.request_id
            assert rid not in self.aborted and rid not in self.finished
            assert output.outputs[0].token_ids == self.requests[rid].output_token_ids
            if output.finished:
                self.finished[rid] = output.outputs[0].token_ids

    def check_blocks(self) -> None:
        bm, scheduler = self.engine.block_manager, self.engine.scheduler
        assert all(not r.block_ids for r in scheduler.waiting)
        holders = Counter(b for r in scheduler.running for b in r.block_ids)
        for block in bm.blocks:
            assert block.ref_count == holders[block.block_id]
            assert (block.ref_count == 0) == (block.block_id in bm.free_blocks)
        for rid, request in self.requests.items():
            if rid not in self.engine.requests:  # finished or aborted
                assert request.is_finished and not request.block_ids
        salts = defaultdict(set)
        for request in scheduler.running:
            assert len(request.block_ids) == math.ceil(request.num_computed_tokens / bm.block_size)
            for position in range(request.num_computed_tokens):  # its own salt and tokens wrote every slot it reads
                written = self.kv_written.get((request.block_ids[position // bm.block_size], position % bm.block_size))
                assert written == (request.cache_salt, tuple(request.all_token_ids[:position + 1]))
            for i, block_id in enumerate(request.block_ids):
                salts[block_id].add(request.cache_salt)
                self.check_named_block(request, i, bm.blocks[block_id])
        assert all(len(s) == 1 for s in salts.values())  # no block is shared across salts
        assert all(block.block_hash == h for h, block in bm.cached_blocks.items())

    def check_named_block(self, request, index: int, block) -> None:
        """A block in the prefix cache holds its holder's tokens, and only ever serves one salt."""
        if block.block_hash is None:
            return
        size = self.engine.block_manager.block_size
        assert block.token_ids == tuple(request.all_token_ids[index * size:(index + 1) * size])
        salt = self.salt_of_named_block.setdefault(block.serial, request.cache_salt)
        assert salt == request.cache_salt

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()
        assert not self.engine.requests
        assert self.engine.block_manager.num_free_blocks == len(self.engine.block_manager.blocks)
        assert all(block.ref_count == 0 for block in self.engine.block_manager.blocks)


@pytest.mark.parametrize("engine_name", sorted(ENGINES))
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads)
def test_engine_invariants_under_random_workloads(engines, run_alone, run_alone_int8, engine_name, workload):
    engine = engines[engine_name]
    run_workload(engine, run_alone_int8 if engine.config.kv_cache_dtype == "int8" else run_alone, workload)


@pytest.mark.parametrize("engine_name", ["fcfs-tight-cache", "priority-chunked"])
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads)
def test_hits_stay_exact_when_block_hashes_collide(engines, run_alone, two_bit_hash, engine_name, workload):
    engine = engines[engine_name]
    engine.block_manager.hash_algo = two_bit_hash
    try:
        run_workload(engine, run_alone, workload)
    finally:
        engine.block_manager.hash_algo = engine.config.prefix_caching_hash_algo


def run_workload(engine, run_alone, workload: dict) -> None:
    engine.reset_prefix_cache()
    # A slot is read only after it is written: NaN anywhere else would show up in the outputs (an int8 cache's
    # NaN is in its scales).
    runner = engine.model_executor.runner
    (runner.kv_scales if runner.kv_cache.dtype == torch.int8 else runner.kv_cache).fill_(float("nan"))
    run = Workload(engine)
    try:
        for round_ in workload["rounds"]:
            for arrival in round_["arrivals"]:
                run.add(arrival, workload["prefixes"])
            if round_["abort"] < ABORT_BELOW:
                run.abort(round_["abort"])
            for _ in range(round_["steps"]):
                run.step()
        run.drain()
    finally:
        engine.abort_request(list(engine.requests))  # a failed example must not leak into the next one
    assert set(run.finished) | run.aborted == set(run.requests)
    for rid, output_tokens in run.finished.items():
        request = run.requests[rid]
        assert output_tokens == run_alone(run.prompts[rid], request.params), rid
