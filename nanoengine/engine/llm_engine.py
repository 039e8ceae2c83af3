"""The engine loop: requests go in with add_request, each step() runs one batch and says what changed.

A step is the seed's three stages: the scheduler picks the requests and their tokens, the executor runs the
model and samples, and the output processor turns the samples into outputs. Around them: the input side
(processor.py) builds requests, and the drafter (spec_decode.py) proposes the next step's drafts.
"""

import logging
import time
import warnings
from collections import deque

from nanoengine.config import EngineConfig
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.executor import Executor
from nanoengine.engine.model_runner import StepResult
from nanoengine.engine.output_processor import OutputProcessor
from nanoengine.engine.processor import Processor
from nanoengine.engine.request import ParentRequest, Request
from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.engine.spec_decode import Drafter
from nanoengine.engine.structured_output import GrammarBitmask
from nanoengine.engine.trace import StepTrace
from nanoengine.outputs import EngineStats, RequestOutput
from nanoengine.sampling_params import SamplingParams

logger = logging.getLogger("nanoengine")
STEP_HISTORY = 10_000  # steps whose (running, waiting, kv usage) the stats keep


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.processor = Processor(config)
        self.tokenizer = self.processor.tokenizer
        self.model_executor = Executor(config)
        self.block_manager = BlockManager(self.model_executor.runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, config.prefix_caching_hash_algo)
        self.scheduler = Scheduler(config, self.block_manager)
        self.fit_max_model_len_to_kv_cache()
        self.output_processor = OutputProcessor(config, self.tokenizer, self.scheduler)
        self.drafter = Drafter(config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, ParentRequest] = {}  # n > 1: the request the user sees, by its id
        self.held_outputs: list[RequestOutput] = []  # outputs an LLM.generate call stepped past: the next step's
        self.step_history: deque[tuple[int, int, float]] = deque(maxlen=STEP_HISTORY)
        self.last_step_tokens = (0, 0)  # (prefill tokens, decode tokens) of the last step
        self.trace = StepTrace(self.scheduler) if config.trace else None

    @classmethod
    def from_engine_args(cls, engine_args) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    def fit_max_model_len_to_kv_cache(self) -> None:
        """A request longer than the whole KV cache could never be scheduled, and would wait forever."""
        capacity = len(self.block_manager.blocks) * self.config.kvcache_block_size
        if self.config.max_model_len > capacity:
            warnings.warn(f"max_model_len={self.config.max_model_len} exceeds the KV cache ({capacity} tokens); "
                          f"lowering it to {capacity}", stacklevel=3)
            self.config.max_model_len = capacity

    # Requests in ----------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None) -> Request | ParentRequest:
        """Validate everything about a request and build it (processor.py), without queuing it."""
        request = self.processor.make_request(request_id, prompt, params, priority, arrival_time)
        children = request.children if isinstance(request, ParentRequest) else []
        for rid in [request.request_id] + [child.request_id for child in children]:
            if rid in self.requests or rid in self.parents:
                raise ValueError(f"request_id {rid!r} is already in use")
        return request

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        self.enqueue(self.make_request(request_id, prompt, params, priority, arrival_time))

    def enqueue(self, request: Request | ParentRequest) -> None:
        if isinstance(request, ParentRequest):
            self.parents[request.request_id] = request
            for child in request.children:
                self.enqueue(child)
            return
        self.requests[request.request_id] = request
        self.drafter.add_request(request)
        self.output_processor.add_request(request)
        self.scheduler.add(request)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests at once and free their blocks; unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if rid in self.parents:
                self.abort_request([child.request_id for child in self.parents.pop(rid).children])
            request = self.requests.get(rid)
            if request is not None:
                self.scheduler.finish(request, "abort")
                self.forget(request)

    def forget(self, request: Request) -> None:
        del self.requests[request.request_id]
        self.output_processor.forget(request.request_id)
        self.model_executor.finish_request(request.request_id)
        parent = request.parent
        if parent is not None and all(child.is_finished for child in parent.children):
            self.parents.pop(parent.request_id, None)  # its last child is done, or aborted by its own id

    def has_unfinished_requests(self) -> bool:
        return bool(self.held_outputs) or self.scheduler.has_unfinished_requests()

    def hold_outputs(self, outputs: list[RequestOutput]) -> None:
        """Keep outputs of requests that someone else added; step() returns them first."""
        self.held_outputs.extend(outputs)

    # One step ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        held, self.held_outputs = self.held_outputs, []
        # 1. Schedule: which requests run, with how many tokens each.
        scheduled = self.scheduler.schedule()
        if not scheduled.requests:
            return held
        if self.trace is not None:
            self.trace.log(scheduled)
        # 2. Run the model and sample.
        result, failed = self.execute(scheduled)
        self.count_step_tokens(scheduled)
        self.advance(scheduled)
        # 3. Process the outputs: tokens appended, stops checked, outputs made; finished requests forgotten.
        outputs = held + self.output_processor.process(scheduled, result, failed)
        self.drafter.record_verifications(result)
        for request in failed + scheduled.requests:  # the failed are no longer among the scheduled
            if request.is_finished:
                self.forget(request)
        if self.trace is not None:
            self.trace.log_verified(result)
        self.drafter.propose(result.requests)
        usage = 1 - self.block_manager.num_free_blocks / len(self.block_manager.blocks)
        self.step_history.append((len(self.scheduler.running), len(self.scheduler.waiting), usage))
        return outputs

    def execute(self, scheduled: SchedulerOutput) -> tuple[StepResult, list[Request]]:
        """The step's samples, and the requests that failed in it (each alone, see execute_one_by_one)."""
        try:
            start = time.perf_counter()
            result = self.model_executor.execute_model(scheduled, self.grammar_bitmask(scheduled))
            self.drafter.record_step_cost(scheduled, time.perf_counter() - start)
            return result, []
        except Exception as error:
            return self.execute_one_by_one(scheduled, error)

    def execute_one_by_one(self, scheduled: SchedulerOutput, error: Exception) -> tuple[StepResult, list[Request]]:
        """After a failed step, run each request alone: the ones that fail again end with an error, alone.

        No request has advanced yet, and a rerun writes the same KV slots again, so each rerun is a plain step of
        its one request. A tensor-parallel step that fails has stopped its workers: there is nothing to rerun on."""
        if not self.model_executor.can_rerun_steps:
            raise error
        merged, failed = StepResult([], [], [], []), []  # logprobs: its rows, or None, per request
        for request, num_new, drafts in list(zip(scheduled.requests, scheduled.num_new_tokens, scheduled.drafts)):
            alone = SchedulerOutput([request], [num_new], drafts=[drafts])
            try:
                result = self.model_executor.execute_model(alone, self.grammar_bitmask(alone))
            except Exception as own_error:
                logger.exception("request %s failed in a step and ends with an error", request.request_id)
                scheduled.remove(request)
                self.scheduler.finish(request, "error", f"{type(own_error).__name__}: {own_error}")
                failed.append(request)
                continue
            merged.requests += result.requests
            merged.token_ids += result.token_ids
            merged.num_drafts += result.num_drafts
            merged.prompt_logprobs += result.prompt_logprobs
            merged.logprobs += result.logprobs or [None] * len(result.requests)
        if not any(merged.logprobs):
            merged.logprobs = None
        return merged, failed

    def grammar_bitmask(self, scheduled: SchedulerOutput) -> GrammarBitmask | None:
        if self.processor.structured_outputs is None:
            return None
        sampling = [(r, d) for r, d, samples in zip(scheduled.requests, scheduled.drafts, scheduled.samples())
                    if samples]
        return self.processor.structured_outputs.bitmask_for([r.matcher for r, _ in sampling], [d for _, d in sampling])

    def count_step_tokens(self, scheduled: SchedulerOutput) -> None:
        decode = sum(n for r, n, d in zip(scheduled.requests, scheduled.num_new_tokens, scheduled.drafts)
                     if n - len(d) == 1 and r.num_computed_tokens >= r.num_prompt_tokens)
        self.last_step_tokens = (scheduled.total_tokens - decode, decode)

    def advance(self, scheduled: SchedulerOutput) -> None:
        """Count the step's tokens as computed, except drafts: each is counted once it is accepted."""
        for request, num_new, drafts in zip(scheduled.requests, scheduled.num_new_tokens, scheduled.drafts):
            request.num_computed_tokens += num_new - len(drafts)

    # Introspection -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_kvcache_blocks=len(bm.blocks), num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_free_blocks, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            spec_num_drafts=self.drafter.counts[0], spec_num_draft_tokens=self.drafter.counts[1],
            spec_num_accepted_tokens=self.drafter.counts[2], weight_bytes=self.model_executor.runner.weight_bytes,
            step_history=list(self.step_history))

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Drop every request and release the model and its KV cache."""
        self.abort_request(list(self.parents) + list(self.requests))
        self.model_executor.close()
