"""The one response pipeline: a body becomes engine requests and a renderer, and one transport answers.

``prepare`` validates and tokenizes a body with the engine's own ``make_request`` (against the tokenizer and
the config, without the model), so a bad request is a 400 that never reaches an engine core; it runs in a
worker thread, so a long prompt never holds up another client. ``respond`` waits for the first output before
it sends a status (so a request refused by its core, or past its queue deadline, gets a proper HTTP error),
answers 499 when the client leaves, and then streams the renderer's events (SSE) or returns its whole reply.
"""

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError

from nanoengine.engine.processor import Processor
from nanoengine.engine.request import ParentRequest
from nanoengine.engine.request import Request as EngineRequest
from nanoengine.sampling_params import field_error
from nanoengine.serve.client import EngineCoreClient, EngineUnavailableError
from nanoengine.serve.cluster.admission import AdmissionControl, AdmissionLimits, Ticket
from nanoengine.serve.codec import EngineCoreRequest
from nanoengine.serve.errors import SHUTTING_DOWN, APIError, engine_gone, overloaded
from nanoengine.serve.metrics import Metrics
from nanoengine.serve.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
    TopLevelBody,
)
from nanoengine.serve.tools import ToolUse

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}
logger = logging.getLogger("nanoengine.serve")


@dataclass
class Prepared:
    """A request validated and tokenized: one engine request per prompt (a chat has one)."""

    request_id: str
    body: GenerationRequest  # what the engine requests were made from (a Responses request's chat request)
    requests: list[EngineCoreRequest]
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text
    tool_use: ToolUse | None = None  # a chat's tools and tool_choice, checked


class OpenAIServer:
    def __init__(self, client: EngineCoreClient, validator: Processor, model_names: list[str],
                 metrics: Metrics, tool_call_parser: str | None = None, admission: AdmissionControl | None = None):
        self.client, self.validator, self.model_names, self.metrics = client, validator, model_names, metrics
        self.tool_call_parser = tool_call_parser  # for tool_choice "auto" (None: refused)
        self.admission = admission or AdmissionControl(AdmissionLimits(0, 0, 0))
        self.generation_defaults = validator.config.default_sampling_params()
        self.template_renders_tools = self.renders_tools()
        self.shutting_down = False
        self.warned_fields: set[str] = set()  # unknown request keys, logged once each

    def renders_tools(self) -> bool:
        """Whether the chat template shows the model its tools (else tool_choice "auto" would hide them)."""
        try:
            with_tools = self.validator.render_chat(PROBE_MESSAGES, tools=[PROBE_TOOL])[0]
            return with_tools != self.validator.render_chat(PROBE_MESSAGES)[0]
        except (ValueError, TemplateError):
            return False

    def stop(self) -> None:
        """Refuse new requests and end the running ones (the engine core aborts them)."""
        self.shutting_down = True
        self.client.fail_all(EngineUnavailableError(SHUTTING_DOWN))

    async def serve(self, body: TopLevelBody, http: Request, renderer):
        """The route's whole work: ``renderer(body, prepared, model name, decode)`` tells the reply."""
        try:
            self.warn_unknown_fields(body)
            prepared = await self.admit(body.as_generation(), http)
        except APIError as error:
            raise error.renamed(body.names()) from None
        reply = renderer(body, prepared, self.model_names[0], self.decode_token)
        return await self.respond(prepared, reply, body.stream, http)

    def decode_token(self, token_id: int) -> str:
        return self.validator.tokenizer.decode([token_id])

    async def admit(self, body: GenerationRequest, http: Request) -> Prepared:
        """The request prepared and counted as waiting, or a 429 when its prompts would overfill the queue."""
        prepared = await asyncio.to_thread(self.prepare, body)
        num_tokens = sum(len(request.prompt_token_ids) for request in prepared.requests)
        if why := self.admission.add_tokens(http.state.admission, num_tokens):
            raise overloaded(why, self.admission.retry_after())
        return prepared

    def prepare(self, body: GenerationRequest) -> Prepared:
        """The request validated and tokenized (slow for a long prompt: called in a worker thread)."""
        if self.client.unavailable or self.shutting_down:
            raise engine_gone(self.client.unavailable or SHUTTING_DOWN)
        if body.model is not None and body.model not in self.model_names:
            raise APIError(400, f"model {body.model!r} is not served here (this server serves "
                                f"{self.model_names[0]!r})", "model")
        chat = isinstance(body, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            tool_use = ToolUse.of(body, self.tool_call_parser) if chat else None
            if tool_use and tool_use.choice == "auto" and not self.template_renders_tools:
                raise field_error("tools", 'the model\'s chat template does not render tools, so with tool_choice '
                                           '"auto" the model would never see them; name a function or use "required"')
            prompts = [{"prompt_token_ids": self.chat_prompt(body)}] if chat else [
                {"prompt_token_ids" if isinstance(prompt, list) else "prompt": prompt} for prompt in body.prompts()]
            params = body.to_sampling_params(self.generation_defaults)
            if forced := tool_use and tool_use.structured_outputs():  # a named or required tool_choice
                params = replace(params, structured_outputs=forced)
            if params.n > self.validator.config.max_num_seqs:
                raise field_error("n", f"n must be at most max_num_seqs ({self.validator.config.max_num_seqs}), "
                                       f"got {params.n}")
            made = [self.validator.make_request(f"{request_id}-{i}", {**prompt, "cache_salt": body.cache_salt},
                                                params, body.priority) for i, prompt in enumerate(prompts)]
        except (ValueError, TypeError) as error:
            raise APIError(400, str(error), getattr(error, "param", None)) from error
        requests = [engine_core_request(request) for request in made]
        echo_texts = None
        if not chat and body.echo:
            echo_texts = [p.get("prompt") or self.validator.tokenizer.decode(r.prompt_token_ids)
                          for p, r in zip(prompts, requests)]
        return Prepared(request_id, body, requests, echo_texts, tool_use)

    def warn_unknown_fields(self, body: TopLevelBody) -> None:
        try:
            unknown = body.unknown_fields()
        except ValueError as error:  # a field this server does not implement
            raise APIError(400, str(error), error.param) from None
        for name in unknown:
            if name not in self.warned_fields:
                self.warned_fields.add(name)
                logger.warning("ignoring the request field %r, which no OpenAI or vLLM request has (logged once)",
                               name)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.for_template() for m in body.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        options = body.template_options()
        try:
            return self.validator.render_chat(messages, tools=tools, **options)[1]
        except (ValueError, TemplateError) as error:  # e.g. a role the template refuses
            raise APIError(400, str(error), "messages") from error

    async def outputs(self, request: EngineCoreRequest, ticket: Ticket):
        """The request's outputs, recording metrics; engine failures become APIErrors."""
        last_token_times: dict[int, float | None] = {}  # per sample of the request (n > 1)
        try:
            async for engine, output in self.client.generate(request):
                self.admission.started(ticket)
                output.prompt_token_ids = request.prompt_token_ids  # the engine core leaves them out
                sample = output.outputs[0].index
                self.metrics.record_output(engine, output, not last_token_times, last_token_times.get(sample))
                last_token_times[sample] = output.metrics.last_token_time
                yield output
        except EngineUnavailableError as error:
            raise engine_gone(str(error)) from error
        except ValueError as error:  # refused by the engine core
            raise APIError(400, str(error), getattr(error, "param", None)) from error

    async def all_outputs(self, requests: list[EngineCoreRequest], ticket: Ticket):
        """(prompt index, output) of every engine request, as they come; all are aborted if one fails."""
        if len(requests) == 1:
            async for output in self.outputs(requests[0], ticket):
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, request: EngineCoreRequest) -> None:
            try:
                async for output in self.outputs(request, ticket):
                    queue.put_nowait((index, output))
                queue.put_nowait((index, None))
            except Exception as error:  # an APIError, or anything else: the reply fails with it
                queue.put_nowait((index, error))

        tasks = [asyncio.ensure_future(forward(i, request)) for i, request in enumerate(requests)]
        try:
            for _ in requests:
                while (item := await queue.get())[1] is not None:
                    if isinstance(item[1], Exception):
                        raise item[1]
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # EngineCoreClient.generate then aborts the unfinished ones

    async def respond(self, prepared: Prepared, renderer, stream: bool, http: Request):
        """The one transport: the first output (or a 503 past the queue deadline), 499 once the client has
        gone, then the renderer's events as SSE frames, or its whole reply."""
        ticket = http.state.admission
        outputs = self.all_outputs(prepared.requests, ticket)
        first = await until_disconnected(self.first_output(outputs, ticket), http)
        if first is None:
            return Response(status_code=499)  # "client closed request": nobody reads it
        outputs = prepend(first, outputs)
        if stream:  # a client that hangs up closes the stream, and with it the request
            return StreamingResponse(sse(renderer, outputs), media_type="text/event-stream")
        reply = await until_disconnected(renderer.whole(outputs), http)
        return Response(status_code=499) if reply is None else reply

    async def first_output(self, outputs, ticket: Ticket):
        """The request's first output, or a 503 once it waited past --max-queue-seconds (then it is aborted)."""
        try:
            return await asyncio.wait_for(anext(outputs), self.admission.seconds_left(ticket))
        except asyncio.TimeoutError:
            raise engine_gone(f"the request waited {self.admission.limits.max_queue_seconds:g} s without starting "
                              f"(--max-queue-seconds): the server is overloaded; retry later") from None

    def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt, or messages through the chat template, as token ids."""
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        text = body.prompt
        if body.messages is not None:
            try:
                text = self.validator.render_chat([m.for_template() for m in body.messages],
                                                  add_generation_prompt=body.add_generation_prompt)[0]
            except (ValueError, TemplateError) as error:
                raise APIError(400, str(error), "messages") from error
        add_special_tokens = body.messages is None if body.add_special_tokens is None else body.add_special_tokens
        token_ids = self.validator.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        token_strs = self.validator.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return {"count": len(token_ids), "max_model_len": self.validator.config.max_model_len, "tokens": token_ids,
                "token_strs": token_strs}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        try:
            self.validator.check_in_vocab("tokens", body.tokens)
        except ValueError as error:
            raise APIError(400, str(error), "tokens") from error
        return {"prompt": self.validator.tokenizer.decode(body.tokens)}


def engine_core_request(made: EngineRequest | ParentRequest) -> EngineCoreRequest:
    """What the engine core needs to make the request again (n > 1: the parent, which it fans out again)."""
    one = made.children[0] if isinstance(made, ParentRequest) else made
    return EngineCoreRequest(made.request_id, one.prompt_token_ids, made.params, one.priority, one.arrival_time,
                             one.cache_salt)


async def sse(renderer, outputs):
    """Server-sent events: each of the renderer's events as a frame, an error as the last one."""
    try:
        async for event in renderer.stream(outputs):
            yield sse_frame(renderer, event)
    except APIError as error:
        yield sse_frame(renderer, renderer.error_event(error))
    if renderer.end_of_stream:
        yield renderer.end_of_stream


def sse_frame(renderer, event: dict) -> str:
    name = f"event: {event['type']}\n" if renderer.named_events else ""
    return f"{name}data: {json.dumps(event)}\n\n"


async def until_disconnected(awaitable, http: Request):
    """What ``awaitable`` gives, or None once the client has gone (then it is cancelled, which aborts the
    request in its engine core)."""
    task = asyncio.ensure_future(awaitable)
    while not task.done():
        if await http.is_disconnected():
            task.cancel()
            return None
        await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
    return task.result()


async def prepend(first, rest):
    yield first
    async for item in rest:
        yield item
