"""The engine loop: requests go in with add_request, each step() runs one batch and says what changed."""

import logging
import time
import warnings
from collections import deque
from dataclasses import replace

from transformers import AutoTokenizer, GenerationConfig

from nanoengine.config import EngineConfig
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.detokenizer import IncrementalDetokenizer
from nanoengine.engine.executor import make_executor
from nanoengine.engine.model_runner import StepResult
from nanoengine.engine.request import ParentRequest, Request
from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.engine.spec_decode import AcceptanceRate, DraftLength, StepCost, propose_ngram, worth_drafting
from nanoengine.engine.structured_output import GrammarBitmask, StructuredOutputManager, grammar_prefix
from nanoengine.engine.trace import StepTrace
from nanoengine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from nanoengine.sampling_params import RequestOutputKind, SamplingParams, check_number, check_text, field_error

logger = logging.getLogger("nanoengine")
STEP_HISTORY = 10_000  # steps whose (running, waiting, kv usage) the stats keep


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.init_request_checks(config)
        self.model_executor = make_executor(config)
        self.block_manager = BlockManager(self.model_executor.runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, config.prefix_caching_hash_algo)
        self.scheduler = Scheduler(config, self.block_manager)
        self.fit_max_model_len_to_kv_cache()
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.sent_offsets: dict[str, tuple[int, int]] = {}  # DELTA outputs: (tokens, chars) already returned
        self.held_outputs: list[RequestOutput] = []  # outputs an LLM.generate call stepped past: the next step's
        self.step_history: deque[tuple[int, int, float]] = deque(maxlen=STEP_HISTORY)
        self.last_step_tokens = (0, 0)  # (prefill tokens, decode tokens) of the last step
        self.spec_counts = [0, 0, 0]  # speculative decoding: (drafted requests, draft tokens, accepted tokens)
        self.step_cost = StepCost()  # with speculative decoding: what a decode step costs per row
        self.acceptance = AcceptanceRate(decay=0.99)  # over every request's verified drafts: a new one's prior
        self.trace = StepTrace(self.scheduler) if config.trace else None

    def init_request_checks(self, config: EngineConfig) -> None:
        """All that ``make_request`` needs: the server's front process builds requests with this state alone."""
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.eos_token_ids = self.find_eos_token_ids()
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, ParentRequest] = {}  # n > 1: the request the user sees, by its id
        self.structured_outputs: StructuredOutputManager | None = None  # made for the first structured request

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

    def find_eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} - {None}
        try:
            eos = GenerationConfig.from_pretrained(self.config.model).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
        return ids

    # Requests in ----------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None) -> Request | ParentRequest:
        """Validate everything about a request and build it, without queuing it."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests or request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        arrival_time = time.time() if arrival_time is None else arrival_time  # wall clock, as vLLM users pass
        if params.n > 1:
            return self.make_parent_request(request_id, prompt, params, priority, arrival_time)
        check_number("priority", priority, int)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise field_error("priority", f"priority={priority} needs scheduling_policy='priority' (it is "
                                          f"{self.config.scheduling_policy!r})")
        self.check_params_fit_vocab(params)
        text, token_ids, cache_salt = self.parse_prompt(prompt)
        self.check_prompt_tokens(token_ids)
        room = self.config.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id, text, token_ids, params, arrival_time, priority, cache_salt, max_tokens)
        request.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        if params.structured_outputs is not None:
            request.matcher = self.structured_output_manager().new_matcher(params.structured_outputs,
                                                                          request.stop_token_ids)
        return request

    def render_chat(self, conversation: list[dict], **template_options) -> tuple[str, list[int]]:
        """A conversation through the chat template: its text and token ids (the template holds any special
        tokens, so none are added). ``template_options`` go to ``apply_chat_template``."""
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, **template_options)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def structured_output_manager(self) -> StructuredOutputManager:
        if self.structured_outputs is None:
            self.structured_outputs = StructuredOutputManager(self.tokenizer, self.config.hf_config.vocab_size,
                                                              self.eos_token_ids)
        return self.structured_outputs

    def make_parent_request(self, request_id: str, prompt, params: SamplingParams, priority: int,
                            arrival_time: float) -> ParentRequest:
        """n > 1 fans out, as in vLLM, into n requests "i_<id>" that share the prompt's blocks through the prefix
        cache; child i is seeded with seed + i, so it samples what a separate request with that seed would."""
        children = [self.make_request(f"{i}_{request_id}", prompt, replace(
            params, n=1, seed=None if params.seed is None else params.seed + i), priority, arrival_time)
            for i in range(params.n)]
        return ParentRequest(request_id, params, children)

    def parse_prompt(self, prompt) -> tuple[str | None, list[int], str | None]:
        """A prompt is a str, a list of token ids, or a dict with ``prompt`` or ``prompt_token_ids``."""
        cache_salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise field_error("prompt", f"unknown prompt field(s): {sorted(unknown)}")
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise field_error("prompt", "a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
            cache_salt = prompt.get("cache_salt")
            if cache_salt is not None:
                check_text("cache_salt", cache_salt)
            if "prompt" in prompt:
                check_text("prompt", prompt["prompt"])
            elif not isinstance(prompt["prompt_token_ids"], list | tuple):
                raise field_error("prompt_token_ids", f"prompt_token_ids must be a list of ints, got "
                                                      f"{type(prompt['prompt_token_ids']).__name__}", TypeError)
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, list | tuple):
            return None, list(prompt), cache_salt
        check_text("prompt", prompt)
        if not prompt:
            raise field_error("prompt", "prompt is empty")
        return prompt, self.tokenizer.encode(prompt), cache_salt

    def check_in_vocab(self, field: str, token_ids: list[int]) -> None:
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise field_error(field, f"{field} has {len(bad)} id(s) outside the vocabulary [0, {vocab_size}): "
                                     f"{bad[:5]}")

    def check_params_fit_vocab(self, params: SamplingParams) -> None:
        """Ids the sampler indexes with must exist, or the step would fail for the whole batch."""
        for name in ("logprobs", "prompt_logprobs"):
            num_top = getattr(params, name)
            if num_top is not None:
                check_number(name, num_top, int, high=self.config.max_logprobs, why="the engine's max_logprobs")
        self.check_in_vocab("stop_token_ids", params.stop_token_ids)
        self.check_in_vocab("logit_bias", list(params.logit_bias or ()))

    def check_prompt_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise field_error("prompt_token_ids", "prompt_token_ids is empty")
        self.check_in_vocab("prompt_token_ids", token_ids)
        if len(token_ids) >= self.config.max_model_len:
            raise field_error("prompt", f"prompt is {len(token_ids)} tokens, which leaves no room to generate "
                                        f"within max_model_len={self.config.max_model_len}")

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
        if self.config.speculative is not None:
            request.draft_length = DraftLength(self.config.speculative.num_speculative_tokens,
                                               prior=self.acceptance.value)
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens)
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
        self.detokenizers.pop(request.request_id, None)
        self.sent_offsets.pop(request.request_id, None)
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
        scheduled = self.scheduler.schedule()
        if not scheduled.requests:
            return held
        if self.trace is not None:
            self.trace.log(scheduled)
        try:
            start = time.perf_counter()
            result = self.model_executor.execute_model(scheduled, self.grammar_bitmask(scheduled))
            self.record_step_cost(scheduled, time.perf_counter() - start)
        except Exception as error:
            result, failed = self.execute_one_by_one(scheduled, error)
            for request in failed:
                self.emit(request, held, time.time())
        self.count_step_tokens(scheduled)
        self.advance(scheduled)
        self.record_prompt_logprobs(result)
        outputs = held + self.apply_samples(result) + self.finish_prompt_only(scheduled)
        if self.trace is not None:
            self.trace.log_verified(result)
        self.propose_drafts(result.requests)
        usage = 1 - self.block_manager.num_free_blocks / len(self.block_manager.blocks)
        self.step_history.append((len(self.scheduler.running), len(self.scheduler.waiting), usage))
        return outputs

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
        if self.structured_outputs is None:
            return None
        sampling = [(r, d) for r, d, samples in zip(scheduled.requests, scheduled.drafts, scheduled.samples())
                    if samples]
        return self.structured_outputs.bitmask_for([r.matcher for r, _ in sampling], [d for _, d in sampling])

    def count_step_tokens(self, scheduled: SchedulerOutput) -> None:
        decode = sum(n for r, n, d in zip(scheduled.requests, scheduled.num_new_tokens, scheduled.drafts)
                     if n - len(d) == 1 and r.num_computed_tokens >= r.num_prompt_tokens)
        self.last_step_tokens = (scheduled.total_tokens - decode, decode)

    def advance(self, scheduled: SchedulerOutput) -> None:
        """Count the step's tokens as computed, except drafts: each is counted once it is accepted."""
        for request, num_new, drafts in zip(scheduled.requests, scheduled.num_new_tokens, scheduled.drafts):
            request.num_computed_tokens += num_new - len(drafts)

    def apply_samples(self, result: StepResult) -> list[RequestOutput]:
        now = time.time()
        outputs = []
        for i, (request, run) in enumerate(zip(result.requests, result.token_ids)):
            logprobs_rows = None if result.logprobs is None else result.logprobs[i]
            for j, token_id in enumerate(run):
                request.num_computed_tokens += j > 0  # the draft before this token was accepted
                self.append_token(request, token_id, now, logprobs_rows[j] if logprobs_rows else None)
                if request.is_finished:
                    break
            if result.num_drafts[i]:
                self.record_verification(request, result.num_drafts[i], len(run) - 1)
            self.emit(request, outputs, now)
        return outputs

    def finish_prompt_only(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """A request with max_tokens=0 ends once its prompt is computed, having sampled nothing: its output is
        its prompt logprobs (lm-eval's loglikelihood requests)."""
        outputs, now = [], time.time()
        for request in scheduled.requests:
            if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                self.scheduler.finish(request, "length")
                self.emit(request, outputs, now)
        return outputs

    def emit(self, request: Request, outputs: list[RequestOutput], now: float) -> None:
        """Add the request's output, if it has one to give now; a finished request is then forgotten."""
        output = self.make_output(request)
        if output is not None and request.parent is not None:
            output = self.gather_child_output(request, output)
        if output is not None:
            outputs.append(output)
        if request.is_finished:
            request.metrics.finished_time = now
            self.forget(request)

    def append_token(self, request: Request, token_id: int, now: float, logprobs_row: tuple | None) -> None:
        request.append_output_token(token_id)
        self.record_token_time(request, now)
        if logprobs_row is not None and request.logprobs is not None:
            self.record_logprobs(request, token_id, logprobs_row)
        if request.matcher is not None and not request.matcher.accept_token(token_id):
            # The mask makes this impossible; if it happens anyway, only this request ends.
            self.scheduler.finish(request, "error", f"structured_outputs: the grammar rejected token {token_id}")
        else:
            self.check_stop(request, token_id)

    # Speculative decoding ------------------------------------------------------------------------

    def record_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count the drafts, adapt the request's draft length, and give back the blocks of rejected drafts."""
        for i, count in enumerate((1, num_drafts, num_accepted)):
            self.spec_counts[i] += count
        request.draft_length.update(num_drafts, num_accepted)
        self.acceptance.update(num_drafts, num_accepted)
        if not request.is_finished:
            size = self.block_manager.block_size
            self.block_manager.free(request, num_kept_blocks=-(-request.num_computed_tokens // size))

    def record_step_cost(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Time the steps that only decode (with or without drafts), for ``worth_drafting``."""
        if self.config.speculative is not None and all(
                n == 1 + len(d) for n, d in zip(scheduled.num_new_tokens, scheduled.drafts)):
            self.step_cost.add(sum(scheduled.num_new_tokens), seconds)

    def propose_drafts(self, requests: list[Request]) -> None:
        """Draft the next tokens of each request that just sampled (see spec_decode.py)."""
        spec = self.config.speculative
        for request in requests:
            request.spec_token_ids = []
            if spec is None or request.is_finished:
                continue
            structured = request.matcher is not None
            if structured and request.num_output_tokens < request.params.min_tokens:
                continue  # its rows' stop-token bans would need the matcher's state after each draft
            # What the request may still emit, less the token sampled after the drafts.
            room = min(request.max_tokens - request.num_output_tokens,
                       self.config.max_model_len - request.num_tokens) - 1
            num_drafts = min(room, request.draft_length.allowed())
            if num_drafts > 0:
                drafts = propose_ngram(request.all_token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                       num_drafts)
                request.spec_token_ids = grammar_prefix(request.matcher, drafts) if structured else drafts
        if spec is not None:
            self.keep_drafts_that_pay([r for r in requests if not r.is_finished])

    def keep_drafts_that_pay(self, decoding: list[Request]) -> None:
        drafted = [r for r in decoding if r.spec_token_ids]
        if not drafted:
            return  # nothing to cut: skip the fit, which runs every step
        kept = worth_drafting([r.draft_length.acceptance for r in drafted], [len(r.spec_token_ids) for r in drafted],
                              len(decoding), self.step_cost.fit())
        for request, num_kept in zip(drafted, kept):
            request.spec_token_ids = request.spec_token_ids[:num_kept]

    def record_token_time(self, request: Request, now: float) -> None:
        metrics = request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        metrics.num_generation_tokens += 1

    def record_logprobs(self, request: Request, token_id: int, row: tuple) -> None:
        request.logprobs.append(self.logprob_entry(token_id, row, request.params.logprobs))
        request.cumulative_logprob += row[0]

    def record_prompt_logprobs(self, result: StepResult) -> None:
        """Each row is the next prompt position's: chunks join up, since position i is entry i."""
        for request, rows in result.prompt_logprobs:
            for row in rows:
                token_id = request.prompt_token_ids[len(request.prompt_logprobs)]
                request.prompt_logprobs.append(self.logprob_entry(token_id, row, request.params.prompt_logprobs))

    def logprob_entry(self, token_id: int, row: tuple, num_top: int) -> dict[int, Logprob]:
        """vLLM's logprobs of one position: the chosen token first, then the ``num_top`` most likely."""
        logprob, rank, top_ids, top_values = row
        entry = {token_id: Logprob(logprob, rank, self.tokenizer.decode([token_id]))}
        for top_rank, (tid, value) in enumerate(zip(top_ids[:num_top], top_values[:num_top]), start=1):
            entry[tid] = Logprob(value, top_rank, self.tokenizer.decode([tid]))
        return entry

    def check_stop(self, request: Request, token_id: int) -> None:
        params = request.params
        past_min_tokens = request.num_output_tokens > params.min_tokens
        grammar_ended = request.matcher is not None and request.matcher.is_terminated()
        stop_token = (token_id in request.stop_token_ids and past_min_tokens) or grammar_ended
        detokenizer = self.detokenizers[request.request_id]
        if not stop_token or params.include_stop_str_in_output:
            new_text = detokenizer.add(token_id)
            if params.stop_strings and past_min_tokens and self.cut_at_stop_string(request, detokenizer,
                                                                                   len(new_text)):
                return
        if stop_token:  # vLLM's stop_reason: None for the tokenizer's EOS, else the stop token id
            primary_eos = token_id == self.tokenizer.eos_token_id and not params.ignore_eos
            return self.scheduler.finish(request, "stop", None if primary_eos else token_id)
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            self.scheduler.finish(request, "length")

    def cut_at_stop_string(self, request: Request, detokenizer: IncrementalDetokenizer, num_new_chars: int) -> bool:
        """End the request if its text now contains a stop string; the text is cut before it (or after it)."""
        params = request.params
        text = detokenizer.text
        search_from = max(0, len(text) - num_new_chars - max(len(s) for s in params.stop_strings) + 1)
        for stop in params.stop_strings:
            at = text.find(stop, search_from)
            if at >= 0:
                detokenizer.text = text[:at + len(stop)] if params.include_stop_str_in_output else text[:at]
                self.scheduler.finish(request, "stop", stop)
                return True
        return False

    # Outputs -------------------------------------------------------------------------------------

    def make_output(self, request: Request) -> RequestOutput | None:
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not request.is_finished:
            return None
        text, token_ids = self.output_text(request), request.output_token_ids
        logprobs, prompt_logprobs = request.logprobs, request.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            sent_tokens, sent_chars = self.sent_offsets.get(request.request_id, (0, 0))
            self.sent_offsets[request.request_id] = (len(token_ids), len(text))
            text, token_ids = text[sent_chars:], token_ids[sent_tokens:]
            logprobs = None if logprobs is None else logprobs[sent_tokens:]
            if prompt_logprobs is not None and sent_tokens:  # vLLM: all of them in the first delta only
                prompt_logprobs = []
        completion = CompletionOutput(
            index=request.index, text=text, token_ids=list(token_ids),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=None if logprobs is None else list(logprobs),
            finish_reason=request.finish_reason, stop_reason=request.stop_reason)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                             request.is_finished, request.metrics, max(request.num_cached_tokens, 0),
                             None if prompt_logprobs is None else list(prompt_logprobs))

    def output_text(self, request: Request) -> str:
        params = request.params
        detokenizer = self.detokenizers[request.request_id]
        if request.is_finished or not params.stop_strings or params.include_stop_str_in_output:
            return detokenizer.text
        # Hold back what may yet turn out to start a stop string, so that no output is ever taken back.
        held_back = max(len(s) for s in params.stop_strings) - 1
        return detokenizer.text[:max(0, len(detokenizer.text) - held_back)]

    def gather_child_output(self, child: Request, output: RequestOutput) -> RequestOutput | None:
        """A child's output as its parent's, as vLLM gives it: streamed, each child's completion as it comes;
        FINAL_ONLY, all n completions at once. The parent is finished when its last child is."""
        parent = child.parent
        parent.completions[child.index] = output.outputs[0]
        finished = all(c.is_finished for c in parent.children)
        final_only = parent.params.output_kind == RequestOutputKind.FINAL_ONLY
        if final_only and not finished:
            return None
        completions = list(parent.completions) if final_only else output.outputs
        return replace(output, request_id=parent.request_id, outputs=completions, finished=finished)

    # Introspection -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_kvcache_blocks=len(bm.blocks), num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_free_blocks, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            spec_num_drafts=self.spec_counts[0], spec_num_draft_tokens=self.spec_counts[1],
            spec_num_accepted_tokens=self.spec_counts[2], step_history=list(self.step_history))

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Drop every request and release the model and its KV cache."""
        self.abort_request(list(self.parents) + list(self.requests))
        self.model_executor.close()
