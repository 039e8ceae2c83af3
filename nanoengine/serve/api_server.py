"""The HTTP front: FastAPI routes in OpenAI's shapes over an EngineCoreClient.

Each request is tokenized (chat template included) and fully validated here, by the engine's own
``make_request`` run against a tokenizer and the config without the model, so a bad request is a
400 that never reaches the engine core. That work (tokenizing, templating, compiling a grammar) runs
in a worker thread, so that a long prompt never holds up /health or another client's stream; a body
over ``max_request_bytes`` is refused with 413 before it is read whole. Every error, FastAPI's own
404 and 405 included, has OpenAI's body. Accepted requests stream DELTA outputs back: the engine
core detokenizes, because it already must to find stop strings.
"""

import asyncio
import json
import secrets
import time
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from nanoengine.engine.processor import Processor
from nanoengine.serve.client import EngineCoreClient, EngineUnavailableError
from nanoengine.serve.engine_core import EngineCoreRequest
from nanoengine.serve.metrics import Metrics
from nanoengine.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def engine_gone(why: str) -> APIError:
    return APIError(503, why, kind="service_unavailable")


class OpenAIServer:
    def __init__(self, client: EngineCoreClient, validator: Processor, model_names: list[str],
                 metrics: Metrics):
        self.client, self.validator, self.model_names, self.metrics = client, validator, model_names, metrics
        self.generation_defaults = validator.config.default_sampling_params()
        self.shutting_down = False

    def stop(self) -> None:
        """Refuse new requests and end the running ones (the engine core aborts them)."""
        self.shutting_down = True
        self.client.fail_all(EngineUnavailableError("the server is shutting down"))

    def engine_request(self, body: GenerationRequest) -> EngineCoreRequest:
        """The request validated and tokenized (slow for a long prompt: called in a worker thread)."""
        if self.client.dead or self.shutting_down:
            raise engine_gone(self.client.dead or "the server is shutting down")
        if body.model is not None and body.model not in self.model_names:
            raise APIError(400, f"model {body.model!r} is not served here (this server serves "
                                f"{self.model_names[0]!r})", "model")
        chat = isinstance(body, ChatCompletionRequest)
        if chat:
            prompt = {"prompt_token_ids": self.chat_prompt(body), "cache_salt": body.cache_salt}
        else:
            prompt = {"prompt_token_ids" if isinstance(body.prompt, list) else "prompt": body.prompt,
                      "cache_salt": body.cache_salt}
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            params = body.to_sampling_params(self.generation_defaults)
            request = self.validator.make_request(request_id, prompt, params, body.priority)
        except (ValueError, TypeError) as error:
            engine_field = getattr(error, "param", None)
            param = request_field(body, engine_field)
            raise APIError(400, str(error) if param == engine_field else f"{param}: {error}", param) from error
        return EngineCoreRequest(request.request_id, request.prompt_token_ids, request.params, request.priority,
                                 request.arrival_time, request.cache_salt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        try:
            return self.validator.render_chat([m.for_template() for m in body.messages],
                                              add_generation_prompt=body.add_generation_prompt)[1]
        except (ValueError, TemplateError) as error:  # e.g. a role the template refuses
            raise APIError(400, str(error), "messages") from error

    async def outputs(self, request: EngineCoreRequest):
        """The request's outputs, recording metrics; engine failures become APIErrors."""
        last_token_time = None
        try:
            async for engine, output in self.client.generate(request):
                output.prompt_token_ids = request.prompt_token_ids  # the engine core leaves them out
                self.metrics.record_output(engine, output, last_token_time)
                last_token_time = output.metrics.last_token_time
                yield output
        except EngineUnavailableError as error:
            raise engine_gone(str(error)) from error
        except ValueError as error:  # refused by the engine core
            raise APIError(400, str(error), getattr(error, "param", None)) from error

    async def respond(self, body: GenerationRequest, request: EngineCoreRequest, chat: bool, http: Request):
        base = {"id": request.request_id, "created": int(time.time()), "model": self.model_names[0]}
        if body.stream:  # a client that hangs up closes the stream, and with it the request
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self.sse(base, request, chat, include_usage), media_type="text/event-stream")
        reply = asyncio.ensure_future(self.whole_reply(base, request, chat))
        while not reply.done():
            if await http.is_disconnected():
                reply.cancel()  # EngineCoreClient.generate then aborts the request in the engine core
                return Response(status_code=499)  # "client closed request": nobody reads it
            await asyncio.wait([reply], timeout=DISCONNECT_POLL_S)
        return reply.result()

    async def whole_reply(self, base: dict, request: EngineCoreRequest, chat: bool) -> dict:
        text, token_ids, logprobs, output = "", [], [], None
        async for output in self.outputs(request):
            completion = output.outputs[0]
            text, token_ids = text + completion.text, token_ids + completion.token_ids
            logprobs += completion.logprobs or []
        choice = make_choice(chat, False, text, output.outputs[0].finish_reason,
                             format_logprobs(chat, token_ids, logprobs, request.params.logprobs))
        return {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": usage(len(request.prompt_token_ids), len(token_ids), output.num_cached_tokens)}

    async def sse(self, base: dict, request: EngineCoreRequest, chat: bool, include_usage: bool):
        base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if include_usage else {}
        num_tokens = num_cached_tokens = 0
        try:
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield sse_event({**base, "choices": [first], **extra})
            async for output in self.outputs(request):
                completion = output.outputs[0]
                num_tokens += len(completion.token_ids)
                num_cached_tokens = output.num_cached_tokens
                logprobs = format_logprobs(chat, completion.token_ids, completion.logprobs, request.params.logprobs)
                choice = make_choice(chat, True, completion.text, completion.finish_reason, logprobs)
                yield sse_event({**base, "choices": [choice], **extra})
            if include_usage:
                yield sse_event({**base, "choices": [],
                                 "usage": usage(len(request.prompt_token_ids), num_tokens, num_cached_tokens)})
        except APIError as error:
            yield sse_event(error.body())
        yield "data: [DONE]\n\n"


def request_field(body: GenerationRequest, engine_field: str | None) -> str | None:
    """The body's name for an engine field that a check named."""
    chat = isinstance(body, ChatCompletionRequest)
    if engine_field == "max_tokens" and chat and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    if engine_field in ("prompt", "prompt_token_ids"):
        return "messages" if chat else "prompt"
    if engine_field == "logprobs" and chat:
        return "top_logprobs"
    if engine_field == "structured_outputs" and body.structured_outputs is None:
        return "response_format"
    return engine_field


def validation_error_param(error: dict) -> str:
    """A pydantic error's location as a dotted field path, without the union members it tried."""
    return ".".join(str(p) for p in error["loc"][1:] if isinstance(p, int) or p.isidentifier())


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


def make_choice(chat: bool, streamed: bool, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    """The one choice of a whole reply, or of a chunk of a streamed one."""
    if not chat:
        content = {"text": text}
    elif streamed:
        content = {"delta": {"content": text}}
    else:
        content = {"message": {"role": "assistant", "content": text}}
    return {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs, **content}


def format_logprobs(chat: bool, token_ids: list[int], logprobs: list | None, num_top: int | None) -> dict | None:
    """OpenAI's logprobs shapes, from the engine's per-token {token id: Logprob} (the sampled id included)."""
    if logprobs is None or num_top is None:
        return None
    rows = [(entry[token_id], sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank))
            for token_id, entry in zip(token_ids, logprobs)]
    if chat:
        def item(lp):
            return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
        return {"content": [{**item(s), "top_logprobs": [item(t) for t in top]} for s, top in rows]}
    return {"tokens": [s.decoded_token for s, _ in rows], "token_logprobs": [s.logprob for s, _ in rows],
            "top_logprobs": [{t.decoded_token: t.logprob for t in top} for _, top in rows]}


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
        return await server.respond(body, await asyncio.to_thread(server.engine_request, body), False, http)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        return await server.respond(body, await asyncio.to_thread(server.engine_request, body), True, http)

    app.include_router(v1)

    @app.get("/health")
    async def health():
        """200 while any engine core serves ("degraded" when some are dead), else 503; each core's state."""
        engines = server.client.health()
        serving = sum(engine["state"] == "ready" for engine in engines)
        status = ("unavailable" if server.shutting_down or not serving
                  else "ok" if serving == len(engines) else "degraded")
        return JSONResponse({"status": status, "engines": engines}, status_code=503 if status == "unavailable" else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

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
