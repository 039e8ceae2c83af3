"""The HTTP front: FastAPI routes in OpenAI's shapes over an EngineCoreClient.

Each request is tokenized (chat template included) and fully validated here, by the engine's own
``make_request`` run against a tokenizer and the config without the model, so a bad request is a
400 that never reaches the engine core. That work (tokenizing, templating, compiling a grammar) runs
in a worker thread, so that a long prompt never holds up /health or another client's stream; a body
over ``max_request_bytes`` is refused with 413 before it is read whole. Every error, FastAPI's own
404 and 405 included, has OpenAI's body. Accepted requests stream DELTA outputs back: the engine
core detokenizes, because it already must to find stop strings. A response starts (its status sent) only
with the request's first token, so a request refused by its core or past its queue deadline (see
admission.py) gets a proper HTTP error, streamed or not.
"""

import asyncio
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, replace
from importlib.metadata import version

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from nanoengine.engine.processor import Processor
from nanoengine.engine.request import ParentRequest
from nanoengine.engine.request import Request as EngineRequest
from nanoengine.sampling_params import field_error
from nanoengine.serve.admission import Admission, AdmissionGate, AdmissionLimits, Ticket
from nanoengine.serve.choices import Choices, completion_logprobs, vllm_prompt_logprobs
from nanoengine.serve.client import EngineCoreClient, EngineUnavailableError
from nanoengine.serve.engine_core import EngineCoreRequest
from nanoengine.serve.metrics import Metrics
from nanoengine.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
)
from nanoengine.serve.tools import ToolUse

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
logger = logging.getLogger("nanoengine.serve")


class APIError(Exception):
    headers: dict[str, str] | None = None

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def engine_gone(why: str) -> APIError:
    return APIError(503, why, kind="service_unavailable")


def overloaded(why: str, retry_after: int) -> APIError:
    error = APIError(429, f"the server is overloaded: {why}; retry later", kind="rate_limit_exceeded")
    error.headers = {"retry-after": str(retry_after)}
    return error


@dataclass
class Prepared:
    """A request validated and tokenized: one engine request per prompt (a chat has one)."""

    request_id: str
    requests: list[EngineCoreRequest]
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text
    tool_use: ToolUse | None = None  # a chat's tools and tool_choice, checked


class OpenAIServer:
    def __init__(self, client: EngineCoreClient, validator: Processor, model_names: list[str],
                 metrics: Metrics, tool_call_parser: str | None = None, admission: Admission | None = None):
        self.client, self.validator, self.model_names, self.metrics = client, validator, model_names, metrics
        self.tool_call_parser = tool_call_parser  # for tool_choice "auto" (None: refused)
        self.admission = admission or Admission(AdmissionLimits(0, 0, 0))
        self.generation_defaults = validator.config.default_sampling_params()
        self.shutting_down = False
        self.warned_fields: set[str] = set()  # unknown request keys, logged once each

    def stop(self) -> None:
        """Refuse new requests and end the running ones (the engine core aborts them)."""
        self.shutting_down = True
        self.client.fail_all(EngineUnavailableError("the server is shutting down"))

    async def admit(self, body: GenerationRequest, http: Request) -> Prepared:
        """The request prepared and counted as waiting, or a 429 when its prompts would overfill the queue."""
        prepared = await asyncio.to_thread(self.prepare, body)
        num_tokens = sum(len(request.prompt_token_ids) for request in prepared.requests)
        if why := self.admission.add_tokens(http.state.admission, num_tokens):
            raise overloaded(why, self.admission.retry_after())
        return prepared

    def prepare(self, body: GenerationRequest) -> Prepared:
        """The request validated and tokenized (slow for a long prompt: called in a worker thread)."""
        if self.client.dead or self.shutting_down:
            raise engine_gone(self.client.dead or "the server is shutting down")
        if body.model is not None and body.model not in self.model_names:
            raise APIError(400, f"model {body.model!r} is not served here (this server serves "
                                f"{self.model_names[0]!r})", "model")
        chat = isinstance(body, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        tool_use = self.tool_use(body)
        try:
            self.warn_unknown_fields(body)
            prompts = [{"prompt_token_ids": self.chat_prompt(body, tool_use)}] if chat else [
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
            engine_field = getattr(error, "param", None)
            param = request_field(body, engine_field)
            raise APIError(400, str(error) if param == engine_field else f"{param}: {error}", param) from error
        requests = [engine_core_request(request) for request in made]
        echo_texts = None
        if not chat and body.echo:
            echo_texts = [p.get("prompt") or self.validator.tokenizer.decode(r.prompt_token_ids)
                          for p, r in zip(prompts, requests)]
        return Prepared(request_id, requests, echo_texts, tool_use)

    def warn_unknown_fields(self, body: GenerationRequest) -> None:
        for name in body.unknown_fields():
            if name not in self.warned_fields:
                self.warned_fields.add(name)
                logger.warning("ignoring the request field %r, which no OpenAI or vLLM request has (logged once)",
                               name)

    def chat_prompt(self, body: ChatCompletionRequest, tool_use: ToolUse | None) -> list[int]:
        messages = [m.for_template() for m in body.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        options = body.template_options()
        try:
            text, token_ids = self.validator.render_chat(messages, tools=tools, **options)
            if tool_use and tool_use.choice == "auto" and text == self.validator.render_chat(messages, **options)[0]:
                raise APIError(400, 'the model\'s chat template does not render tools, so with tool_choice "auto" '
                                    'the model would never see them; name a function or use "required"', "tools")
            return token_ids
        except (ValueError, TemplateError) as error:  # e.g. a role the template refuses
            raise APIError(400, str(error), "messages") from error

    def tool_use(self, body: GenerationRequest) -> ToolUse | None:
        if not isinstance(body, ChatCompletionRequest):
            return None
        try:
            return ToolUse.of(body, self.tool_call_parser)
        except ValueError as error:
            raise APIError(400, str(error), error.param) from error

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

    async def respond(self, body: GenerationRequest, prepared: Prepared, chat: bool, http: Request):
        base = {"id": prepared.request_id, "created": int(time.time()), "model": self.model_names[0]}
        choices, tool_use = Choices(body.n, prepared.echo_texts), prepared.tool_use
        outputs = self.all_outputs(prepared.requests, http.state.admission)
        first = await until_disconnected(self.first_output(outputs, http.state.admission), http)
        if first is None:
            return Response(status_code=499)  # "client closed request": nobody reads it
        outputs = prepend(first, outputs)
        if body.stream:  # a client that hangs up closes the stream, and with it the request
            return StreamingResponse(self.sse(base, body, prepared, choices, chat, outputs, tool_use),
                                     media_type="text/event-stream")
        reply = await until_disconnected(self.whole_reply(base, body, prepared, choices, chat, outputs, tool_use), http)
        return Response(status_code=499) if reply is None else reply

    async def first_output(self, outputs, ticket: Ticket):
        """The request's first output, or a 503 once it waited past --max-queue-seconds (then it is aborted)."""
        try:
            return await asyncio.wait_for(anext(outputs), self.admission.seconds_left(ticket))
        except asyncio.TimeoutError:
            raise engine_gone(f"the request waited {self.admission.limits.max_queue_seconds:g} s without starting "
                              f"(--max-queue-seconds): the server is overloaded; retry later") from None

    def logprobs(self, chat: bool, token_ids: list[int], entries, num_top: int | None, text_offset: int):
        if num_top is None:
            return None
        if chat:
            return format_logprobs(token_ids, entries, num_top)
        return completion_logprobs(token_ids, entries, num_top, text_offset,
                                   lambda token_id: self.validator.tokenizer.decode([token_id]))

    async def whole_reply(self, base: dict, body: GenerationRequest, prepared: Prepared, choices: Choices,
                          chat: bool, outputs, tool_use: ToolUse | None) -> dict:
        async for prompt_index, output in outputs:
            choices.add(prompt_index, output)
        num_top = prepared.requests[0].params.logprobs
        replies = []
        for choice in choices.in_order():
            reply = make_choice(chat, False, choice.index, choice.text, choice.finish_reason,
                                self.logprobs(chat, choice.token_ids, choice.entries, num_top, 0))
            if not chat and body.prompt_logprobs is not None:
                reply["prompt_logprobs"] = vllm_prompt_logprobs(choices.prompt_logprobs[choice.prompt_index])
            replies.append(reply if tool_use is None else tool_use.shape_message(reply))
        return {**base, "object": "chat.completion" if chat else "text_completion", "choices": replies,
                "usage": usage(sum(len(r.prompt_token_ids) for r in prepared.requests), choices.num_output_tokens,
                               sum(choices.num_cached_tokens.values()))}

    async def sse(self, base: dict, body: GenerationRequest, prepared: Prepared, choices: Choices, chat: bool,
                  outputs, tool_use: ToolUse | None):
        base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
        shaper = tool_use and tool_use.chunk_shaper()
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options.continuous_usage_stats
        extra = {"usage": None} if include_usage else {}
        num_top = prepared.requests[0].params.logprobs
        try:
            if chat:
                for index in range(len(prepared.requests) * body.n):
                    first = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield sse_event({**base, "choices": [first], **extra})
            async for prompt_index, output in outputs:
                choice, piece = choices.add(prompt_index, output)
                logprobs = self.logprobs(chat, piece.token_ids, piece.entries, num_top, piece.text_offset)
                chunk = make_choice(chat, True, choice.index, piece.text, choice.finish_reason, logprobs)
                if shaper and (chunk := shaper.shape(chunk)) is None:
                    continue  # text held back, e.g. what may start a tool call's tag
                if continuous_usage:
                    extra = {"usage": usage(len(output.prompt_token_ids), choice.num_output_tokens,
                                            choices.num_cached_tokens[prompt_index])}
                yield sse_event({**base, "choices": [chunk], **extra})
            if include_usage:
                yield sse_event({**base, "choices": [], "usage": usage(
                    sum(len(r.prompt_token_ids) for r in prepared.requests), choices.num_output_tokens,
                    sum(choices.num_cached_tokens.values()))})
        except APIError as error:
            yield sse_event(error.body())
        yield "data: [DONE]\n\n"

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


def request_field(body: GenerationRequest, engine_field: str | None) -> str | None:
    """The body's name for an engine field that a check named."""
    chat = isinstance(body, ChatCompletionRequest)
    if engine_field == "max_tokens" and chat and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    if engine_field in ("prompt", "prompt_token_ids"):
        return "messages" if chat else "prompt"
    if engine_field == "logprobs" and chat:
        return "top_logprobs"
    if engine_field == "structured_outputs" and chat and body.tools and body.tool_choice not in (None, "none", "auto"):
        return "tools"  # the grammar of a forced tool call: its parameters' schema
    if engine_field == "structured_outputs" and body.structured_outputs is None:
        return "response_format"
    return engine_field


def validation_error_param(error: dict) -> str:
    """A pydantic error's location as a dotted field path, without the union members it tried (``str``,
    ``list[int]``, a model's class name)."""
    return ".".join(str(p) for p in error["loc"][1:] if isinstance(p, int) or p.isidentifier() and p[0].islower())


def most_specific(errors: list[dict]) -> dict:
    """Of a field's errors (one per member of a union type), the one that went deepest into the value."""
    return max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))


class BodySizeLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused (413) before more of it is read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = int(dict(scope["headers"]).get(b"content-length", 0))
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if max(declared, received) > self.limit:
                raise HTTPException(413, f"the request body exceeds the server's limit of {self.limit} bytes "
                                         f"(--max-request-bytes)")
            return message

        await self.app(scope, limited_receive, send)


def make_choice(chat: bool, streamed: bool, index: int, text: str, finish_reason: str | None,
                logprobs: dict | None) -> dict:
    """A choice of a whole reply, or of a chunk of a streamed one."""
    if not chat:
        content = {"text": text}
    elif streamed:
        content = {"delta": {"content": text}}
    else:
        content = {"message": {"role": "assistant", "content": text}}
    return {"index": index, "finish_reason": finish_reason, "logprobs": logprobs, **content}


def format_logprobs(token_ids: list[int], logprobs: list, num_top: int) -> dict:
    """The chat API's logprobs, from the engine's per-token {token id: Logprob} (the sampled id included)."""
    rows = [(entry[token_id], sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank))
            for token_id, entry in zip(token_ids, logprobs)]

    def item(lp):
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
    return {"content": [{**item(s), "top_logprobs": [item(t) for t in top]} for s, top in rows]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage, with the prompt tokens found in the prefix cache where vLLM reports them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def create_app(server: OpenAIServer, api_key: str | None, max_request_bytes: int) -> FastAPI:
    app = FastAPI(title="nanoengine")
    app.add_middleware(BodySizeLimit, limit=max_request_bytes)
    app.add_middleware(AdmissionGate, admission=server.admission)  # the outer one: refuses before reading

    def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if api_key is not None and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           kind="authentication_error")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_names[0], "object": "model", "owned_by": "nanoengine",
                                            "created": 0, "max_model_len": server.validator.config.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await server.respond(body, await server.admit(body, http), False, http)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        return await server.respond(body, await server.admit(body, http), True, http)

    from nanoengine.serve.responses import ResponsesRequest, create_response  # it builds on this module

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, http: Request):
        return await create_response(server, body, http)

    app.include_router(v1)
    # vLLM's tokenizer routes, outside /v1 as there, behind the API key as the rest.
    keyed = APIRouter(dependencies=[Depends(check_api_key)])

    @keyed.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await asyncio.to_thread(server.tokenize, body)

    @keyed.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await asyncio.to_thread(server.detokenize, body)

    app.include_router(keyed)

    @app.get("/version")
    async def served_version():
        return {"version": version("nanoengine")}

    @app.get("/health")
    async def health():
        """Liveness: 200 while any engine core serves or is being restarted ("degraded" unless all serve), else
        503; each core's state."""
        engines = server.client.health()
        serving = sum(engine["state"] == "ready" for engine in engines)
        alive = sum(engine["state"] != "dead" for engine in engines)
        status = ("unavailable" if server.shutting_down or not alive
                  else "ok" if serving == len(engines) else "degraded")
        return JSONResponse({"status": status, "engines": engines}, status_code=503 if status == "unavailable" else 200)

    @app.get("/ready")
    async def ready():
        """Readiness: 503 while the queue is full, the server drains or no engine core serves; else 200."""
        serving = sum(engine["state"] == "ready" for engine in server.client.health())
        is_ready, why = server.admission.readiness(serving)
        return JSONResponse(why, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, error: RequestValidationError):
        errors = error.errors()
        if errors[0]["type"] == "json_invalid":
            return JSONResponse(APIError(400, f"the body is not valid JSON: {errors[0]['ctx']['error']}").body(),
                                status_code=400)
        first_field = validation_error_param(errors[0]).split(".")[0]
        worst = most_specific([e for e in errors if validation_error_param(e).split(".")[0] == first_field])
        param = validation_error_param(worst) or None
        message = worst["msg"].removeprefix("Value error, ")
        return JSONResponse(APIError(400, f"{param}: {message}" if param else message, param).body(),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):  # 404, 405, 413, a body that could not be parsed
        return JSONResponse(APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code,
                            headers=error.headers)

    return app
