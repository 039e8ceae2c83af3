"""The output side, as vLLM V1's OutputProcessor: what a step's sampled tokens become for the user.

Each token is appended to its request and detokenized incrementally; stop tokens, stop strings, max_tokens
and the grammar's end finish a request (through the scheduler, which frees its blocks); logprobs are recorded
as vLLM reports them; a RequestOutput is made as the request's output_kind asks (CUMULATIVE, DELTA or
FINAL_ONLY), and the n children of a request with n > 1 are gathered under their parent's id.
"""

import time
from dataclasses import replace

from transformers import PreTrainedTokenizerBase

from nanoengine.config import EngineConfig
from nanoengine.engine.detokenizer import IncrementalDetokenizer
from nanoengine.engine.model_runner import StepResult
from nanoengine.engine.request import Request
from nanoengine.engine.scheduler import Scheduler, SchedulerOutput
from nanoengine.outputs import CompletionOutput, Logprob, RequestOutput
from nanoengine.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase, scheduler: Scheduler):
        self.config, self.tokenizer, self.scheduler = config, tokenizer, scheduler
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.sent_offsets: dict[str, tuple[int, int]] = {}  # DELTA outputs: (tokens, chars) already returned

    def add_request(self, request: Request) -> None:
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens)

    def forget(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self.sent_offsets.pop(request_id, None)

    def process(self, scheduled: SchedulerOutput, result: StepResult, failed: list[Request]) -> list[RequestOutput]:
        """The outputs of a step: the requests that failed in it (finished with an error), then every request
        that sampled, each token appended and checked for a stop in turn, then those that asked for no token
        (max_tokens=0) and now have their whole prompt in: their output is its prompt logprobs."""
        now = time.time()
        outputs = []
        for request in failed:
            self.emit(request, outputs, now)
        self.record_prompt_logprobs(result)
        for i, (request, run) in enumerate(zip(result.requests, result.token_ids)):
            logprobs_rows = None if result.logprobs is None else result.logprobs[i]
            for j, token_id in enumerate(run):
                request.num_computed_tokens += j > 0  # the draft before this token was accepted
                self.append_token(request, token_id, now, logprobs_rows[j] if logprobs_rows else None)
                if request.is_finished:
                    break
            self.emit(request, outputs, now)
        for request in scheduled.requests:
            prompt_done = request.num_computed_tokens == request.num_tokens
            if request.max_tokens == 0 and prompt_done and not request.is_finished:
                self.scheduler.finish(request, "length")
                self.emit(request, outputs, now)
        return outputs

    def emit(self, request: Request, outputs: list[RequestOutput], now: float) -> None:
        """Add the request's output, if it has one to give now."""
        output = self.make_output(request)
        if output is not None and request.parent is not None:
            output = self.gather_child_output(request, output)
        if output is not None:
            outputs.append(output)
        if request.is_finished:
            request.metrics.finished_time = now

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
