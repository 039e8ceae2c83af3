"""LLM: the one-call API. generate() and chat() run the engine loop until every prompt is done."""

import time
from collections.abc import Sequence
from itertools import count

from tqdm.auto import tqdm

from nanoengine.config import EngineConfig
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import EngineStats, RequestOutput
from nanoengine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str, **options):
        if "data_parallel_size" in options:
            raise ValueError(f"LLM(data_parallel_size={options['data_parallel_size']}): LLM runs one engine in "
                             f"this process; for data parallelism run `nanoengine serve --data-parallel-size N`, "
                             f"or one LLM per process, each on its share of the prompts")
        self.config = EngineConfig.from_options(model, options)
        self.llm_engine = LLMEngine(self.config)
        self.request_counter = count()
        self.generation_defaults = self.config.default_sampling_params()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request gets when it passes no SamplingParams: the model's generation_config.json sampling fields."""
        return SamplingParams(**self.generation_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; the outputs come back in the prompts' order."""
        prompts = as_prompt_list(prompts)
        params = per_prompt("sampling_params", sampling_params, len(prompts), self.get_default_sampling_params())
        priorities = per_prompt("priority", priority, len(prompts), 0, broadcast=False)
        engine = self.llm_engine
        # Validate every prompt before queuing any, so a bad one leaves the engine untouched.
        requests = [engine.make_request(str(next(self.request_counter)), prompt, final_only(p), prio)
                    for prompt, p, prio in zip(prompts, params, priorities)]
        for request in requests:
            engine.enqueue(request)
        return self.run_until_done([r.request_id for r in requests], use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, priority: list[int] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of them.

        ``chat_template`` replaces the tokenizer's template; ``chat_template_kwargs`` are extra template
        variables; ``continue_final_message`` lets the model extend the last (assistant) message.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        rendered = [self.llm_engine.processor.render_chat(c, chat_template=chat_template, tools=tools,
                                                add_generation_prompt=add_generation_prompt,
                                                continue_final_message=continue_final_message,
                                                **(chat_template_kwargs or {}))
                    for c in conversations]
        token_prompts = [{"prompt_token_ids": token_ids} for _, token_ids in rendered]
        outputs = self.generate(token_prompts, sampling_params, use_tqdm, priority)
        for output, (prompt, _) in zip(outputs, rendered):
            output.prompt = prompt
        return outputs

    def run_until_done(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until these requests finish; outputs of requests added to llm_engine directly are kept for it."""
        finished: dict[str, RequestOutput] = {}
        wanted, others = set(request_ids), []
        engine = self.llm_engine
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        speed = ThroughputMeter()
        try:
            while len(finished) < len(request_ids) and engine.scheduler.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id not in wanted:
                        others.append(output)
                    elif output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
                speed.add(*engine.last_step_tokens)
                bar.set_postfix_str(speed.text(), refresh=False)
        except BaseException:
            engine.abort_request(request_ids)  # leave the engine clean for the next call
            raise
        finally:
            bar.close()
            engine.hold_outputs(others)
        return [finished[rid] for rid in request_ids]

    def stats(self) -> EngineStats:
        return self.llm_engine.stats()

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def close(self) -> None:
        """Release the engine (and, with tensor parallelism, its workers). Safe to call twice."""
        self.llm_engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a non-empty list (or a single prompt)")
    return list(prompts)


def per_prompt(name: str, value, num_prompts: int, default, broadcast: bool = True) -> list:
    """One value per prompt: a list as given (its length checked), a single value repeated."""
    if value is None:
        return [default] * num_prompts
    if isinstance(value, list | tuple):
        if len(value) != num_prompts:
            raise ValueError(f"{name} has {len(value)} entries for {num_prompts} prompts")
        return list(value)
    if not broadcast:
        raise TypeError(f"{name} must be a list with one entry per prompt")
    return [value] * num_prompts


def final_only(params: SamplingParams) -> SamplingParams:
    """generate() needs each request's output once, at the end."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    if params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params
    copy = SamplingParams(**{k: v for k, v in vars(params).items() if k != "stop_strings"})
    copy.output_kind = RequestOutputKind.FINAL_ONLY
    return copy


class ThroughputMeter:
    """Prefill and decode tokens per second since the start of a generate() call."""

    def __init__(self):
        self.started = time.perf_counter()
        self.prefill_tokens = self.decode_tokens = 0

    def add(self, prefill_tokens: int, decode_tokens: int) -> None:
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens

    def text(self) -> str:
        seconds = max(time.perf_counter() - self.started, 1e-9)
        return f"prefill {self.prefill_tokens / seconds:,.0f} tok/s, decode {self.decode_tokens / seconds:,.0f} tok/s"
