"""The scheduler: which requests run this step, and how many tokens each computes.

There are no prefill and decode phases. Each step has a token budget
(``max_num_batched_tokens``); running requests are served first, then waiting
ones, and each gets ``num_tokens - num_computed_tokens`` new tokens, capped by
what is left of the budget and by ``long_prefill_token_threshold``. So a
decode (1 token), a prompt's next chunk and a fresh prompt all share a step.
With speculative decoding a decode also carries its drafts: they take what
the running requests leave of the budget (drafts are cut before requests).
When the KV cache is full, a running request is preempted: its blocks are
freed, its progress is forgotten, and it waits to be recomputed.
"""

import time
from dataclasses import dataclass, field

from nanoengine.config import EngineConfig
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per scheduled request, in the same order
    admitted: list[Request] = field(default_factory=list)  # taken from waiting this step (also in requests)
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step
    drafts: list[list[int]] = field(default_factory=list)  # per scheduled request: its drafts (in num_new_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self) -> list[bool]:
        """Per request: True when its whole context is in after this step, so that it samples a token (unless it
        asks for none: max_tokens=0)."""
        return [r.num_computed_tokens + n - len(d) == r.num_tokens and r.max_tokens > 0
                for r, n, d in zip(self.requests, self.num_new_tokens, self.drafts)]

    def add(self, request: Request, num_new_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_new_tokens)
        self.drafts.append([])

    def remove(self, request: Request) -> int:
        i = self.requests.index(request)
        del self.requests[i], self.drafts[i]
        return self.num_new_tokens.pop(i)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: list[Request] = []  # kept in serving order: the head is served first
        self.running: list[Request] = []  # in the order they were admitted
        self.num_preemptions = 0

    def order_key(self, request: Request) -> tuple:
        """Lower runs first; under memory pressure the largest key is preempted."""
        return (request.priority, request.arrival_time) if self.by_priority else (request.arrival_time,)

    def add(self, request: Request) -> None:
        self.push_waiting(request)

    def push_waiting(self, request: Request) -> None:
        if self.by_priority:
            keys = [self.order_key(r) for r in self.waiting]
            position = next((i for i, k in enumerate(keys) if k > self.order_key(request)), len(keys))
            self.waiting.insert(position, request)
        elif request.status == RequestStatus.PREEMPTED:
            self.waiting.insert(0, request)  # FCFS: a preempted request resumes first
        else:
            self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def capped(self, num_remaining: int, budget: int) -> int:
        num_new = min(num_remaining, budget)
        if self.config.long_prefill_token_threshold:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return num_new

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget, preempted = self.schedule_running(out, self.config.max_num_batched_tokens)
        budget = self.schedule_drafts(out, budget)
        if not preempted:
            self.schedule_waiting(out, budget)
        now = time.time()
        for request in out.requests:
            request.metrics.first_scheduled_time = request.metrics.first_scheduled_time or now
        return out

    def schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Serve running requests in order, preempting when blocks run out. Returns (budget left, preempted?)."""
        preempted = False
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = self.capped(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.preemption_victim()
                if victim in out.requests:
                    budget += out.remove(victim)
                self.preempt(victim)
                out.preempted.append(victim)
                preempted = True
                if victim is request:
                    break
            else:
                out.add(request, num_new)
                budget -= num_new
        return budget, preempted

    def schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Add each scheduled decode's drafts while budget and free blocks last (never preempting for them)."""
        for i, request in enumerate(out.requests):
            num_new = out.num_new_tokens[i]
            if budget <= 0 or not request.spec_token_ids or num_new != request.num_tokens - request.num_computed_tokens:
                continue
            num_drafts = self.capped(num_new + len(request.spec_token_ids), num_new + budget) - num_new
            if num_drafts > 0 and self.block_manager.allocate_slots(request, num_new + num_drafts):
                out.num_new_tokens[i] += num_drafts
                out.drafts[i] = request.spec_token_ids[:num_drafts]
                budget -= num_drafts
        return budget

    def preemption_victim(self) -> Request:
        """As vLLM: the least important (then latest) under priority; under FCFS the last request admitted."""
        return max(self.running, key=self.order_key) if self.by_priority else self.running[-1]

    def schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached_prefix = self.block_manager.find_cached_prefix(request)
            num_computed = len(cached_prefix) * self.block_manager.block_size
            num_new = self.capped(request.num_tokens - num_computed, budget)
            if not self.block_manager.allocate_slots(request, num_new, cached_prefix):
                break
            self.block_manager.record_lookup(request, cached_prefix)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.add(request, num_new)
            out.admitted.append(request)
            budget -= num_new

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.push_waiting(request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire a running or waiting request and give back its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
