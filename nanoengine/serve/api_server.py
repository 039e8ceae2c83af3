"""The HTTP routes: OpenAI's and vLLM's, over the one pipeline (pipeline.py), with OpenAI's error body.

Every error, FastAPI's own 404 and 405 included, has OpenAI's body (errors.py); a body over
``max_request_bytes`` is refused with 413 before it is read whole, and a generation request passes the
admission gate (cluster/admission.py) before its body is read at all.
"""

import asyncio
import secrets
from importlib.metadata import version

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from nanoengine.serve.cluster.admission import AdmissionGate
from nanoengine.serve.errors import APIError
from nanoengine.serve.pipeline import OpenAIServer
from nanoengine.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from nanoengine.serve.render import ChoicesRenderer
from nanoengine.serve.responses import ResponsesRequest, ResponseWriter


def validation_error_param(error: dict) -> str:
    """A pydantic error's location as a dotted field path, without the union members it tried (``str``,
    ``list[int]``, a model's class name)."""
    return ".".join(str(p) for p in error["loc"][1:] if isinstance(p, int) or p.isidentifier() and p[0].islower())


def most_specific(errors: list[dict]) -> dict:
    """Of a field's errors (one per member of a union type), the one that went deepest into the value; at one
    depth, a wrong value before a missing one (a tool's wrong "type" says more than its missing "name")."""
    return max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type"), e["type"] != "missing"))


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
        return await server.serve(body, http, ChoicesRenderer)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        return await server.serve(body, http, ChoicesRenderer)

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, http: Request):
        return await server.serve(body, http, ResponseWriter.of)

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
