"""/v1/responses: OpenAI's Responses API, served through the chat machinery.

A request becomes a ChatCompletionRequest (``instructions`` as the system message, the input items as messages,
function tools as chat tools, ``text.format`` as ``response_format``), so it is validated, templated, generated
and its tool calls parsed exactly as a chat request's are. The output is told as Responses items: a message with
its ``output_text``, and a ``function_call`` item per call; streamed, as the Responses events
(``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.function_call_arguments.delta`` ... ``.done``, ``response.output_item.done``, then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` ran out).

Nothing is stored: a request that leaves ``store`` out is answered with ``store: false`` (OpenAI's default is
true), and ``store: true`` is refused, as are ``previous_response_id`` and the other fields that need a stored
response, a hosted tool or a reasoning model: each a 400 naming the field.
"""

import copy
import json
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError

from nanoengine.sampling_params import INT64_MAX
from nanoengine.serve.api_server import APIError, OpenAIServer, prepend, until_disconnected
from nanoengine.serve.protocol import (
    Body,
    ChatCompletionRequest,
    Finite,
    JsonArguments,
    JsonObject,
    Text,
    ToolName,
)


class InputText(Body):
    type: Literal["input_text", "output_text"]  # output_text: an assistant's earlier answer
    text: Text


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: JsonArguments


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text


class FunctionTool(Body):
    type: Literal["function"]  # hosted tools (web_search, file_search, ...) are not served
    name: ToolName
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class NamedFunction(Body):
    type: Literal["function"]
    name: Text


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    json_schema: JsonObject | None = Field(None, alias="schema")


class TextOptions(Body):
    format: TextFormat | None = None


# Fields whose meaning needs a stored response, a hosted tool or a reasoning model: refused when given.
UNSUPPORTED = ("previous_response_id", "conversation", "prompt", "background", "include", "reasoning",
               "top_logprobs", "max_tool_calls")


class ResponsesRequest(Body):
    model: Text | None = None
    input: Text | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    stream: bool = False
    store: bool = False  # OpenAI's default is true; nothing is stored here
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop input that does not fit
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    previous_response_id: Text | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    include: list[Any] | None = None
    reasoning: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    def check_served(self) -> None:
        if self.store:
            raise APIError(400, "store: this server stores no responses; send store=false", "store")
        given = next((name for name in UNSUPPORTED if getattr(self, name) not in (None, False, [])), None)
        if given is not None:
            raise APIError(400, f"{given}: not supported by this server (responses are not stored, and there are "
                                f"no hosted tools or reasoning settings)", given)

    def to_chat(self) -> ChatCompletionRequest:
        """The equivalent chat request (its errors name this request's fields)."""
        chat = {"model": self.model, "messages": self.messages(), "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
                "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                          for tool in self.tools] if self.tools else None,
                "tool_choice": ({"type": "function", "function": {"name": self.tool_choice.name}}
                                if isinstance(self.tool_choice, NamedFunction) else self.tool_choice),
                "response_format": self.response_format()}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(part) for part in first["loc"])
            raise renamed(APIError(400, f"{param}: {first['msg']}", param)) from None

    def messages(self) -> list[dict]:
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        for item in [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input:
            if isinstance(item, InputMessage):
                messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1].get("tool_calls"):  # calls made together: one assistant message
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages

    def response_format(self) -> dict | None:
        form = self.text and self.text.format
        if form is None or form.type != "json_schema":
            return form and {"type": form.type}
        if form.json_schema is None:
            raise APIError(400, "text.format.schema: a json_schema format needs a schema", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": form.name, "schema": form.json_schema}}


# A chat field's name in a Responses request (the rest are the same).
RESPONSES_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def renamed(error: APIError) -> APIError:
    """An APIError about the chat request, naming the Responses request's field."""
    param = error.param or ""
    new = RESPONSES_NAMES.get(param.split(".")[0], param.split(".")[0]) + param[len(param.split(".")[0]):]
    new = new.replace(".function.", ".", 1) if new.startswith("tools.") else new
    error.message = error.message.replace(param, new, 1) if param else error.message
    error.param = new or None
    return error


class ResponseWriter:
    """Writes the generated text into the Response's output items, and returns the stream's events as it goes.
    A tool-call extractor (tools.py) splits the text into content and calls first, when tools are in use."""

    def __init__(self, response: dict, extractor):
        self.response, self.extractor = response, extractor
        self.item: dict | None = None  # the output item being written
        self.sequence_number = 0

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **copy.deepcopy(fields)}
        self.sequence_number += 1
        return event

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def write(self, text: str, final: bool) -> list[dict]:
        content, deltas = self.extractor.feed(text, final) if self.extractor else (text, [])
        events = self.write_text(content) if content else []
        for delta in deltas:
            if "id" in delta:
                events += self.open_item({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                                          "call_id": delta["id"], "name": delta["function"]["name"], "arguments": "",
                                          "status": "in_progress"})
            if delta["function"]["arguments"]:
                self.item["arguments"] += delta["function"]["arguments"]
                events.append(self.event("response.function_call_arguments.delta", delta=delta["function"]["arguments"],
                                         **self.where()))
        return events

    def write_text(self, text: str) -> list[dict]:
        events = []
        if self.item is None or self.item["type"] != "message":
            events += self.open_item({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                                      "role": "assistant", "content": []})
            self.item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self.event("response.content_part.added", content_index=0, part=self.item["content"][0],
                                     **self.where()))
        self.item["content"][0]["text"] += text
        return [*events, self.event("response.output_text.delta", content_index=0, delta=text, logprobs=[],
                                    **self.where())]

    def where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.response["output"]) - 1}

    def open_item(self, item: dict) -> list[dict]:
        events = self.close_item("completed")
        self.item = item
        self.response["output"].append(item)
        return [*events, self.event("response.output_item.added", item=item, output_index=self.where()["output_index"])]

    def close_item(self, status: str) -> list[dict]:
        item, events = self.item, []
        if item is None:
            return events
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", content_index=0, text=part["text"], logprobs=[],
                                  **self.where()),
                       self.event("response.content_part.done", content_index=0, part=part, **self.where())]
        else:
            events.append(self.event("response.function_call_arguments.done", arguments=item["arguments"],
                                     name=item["name"], **self.where()))
        events.append(self.event("response.output_item.done", item=item, output_index=self.where()["output_index"]))
        self.item = None
        return events

    def finish(self, finish_reason: str, usage: dict) -> list[dict]:
        complete = finish_reason != "length"
        events = self.close_item("completed" if complete else "incomplete")
        self.response.update(status="completed" if complete else "incomplete", usage=usage,
                             incomplete_details=None if complete else {"reason": "max_output_tokens"})
        return [*events, self.event("response.completed" if complete else "response.incomplete",
                                    response=self.response)]


def new_response(body: ResponsesRequest, chat: ChatCompletionRequest, server, params) -> dict:
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": server.model_names[0], "output": [], "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction)
                            else body.tool_choice or ("auto" if body.tools else "none")),
            "parallel_tool_calls": body.parallel_tool_calls, "store": False, "previous_response_id": None,
            "text": {"format": (chat.response_format and chat.response_format.model_dump(by_alias=True,
                                                                                          exclude_none=True))
                     or {"type": "text"}},
            "truncation": "disabled", "reasoning": None, "metadata": body.metadata or {}, "user": body.user,
            "usage": None}


async def create_response(server: OpenAIServer, body: ResponsesRequest, http: Request):
    """The route: the request checked, admitted and queued as a chat request, answered as a Response (or its
    events)."""
    body.check_served()
    try:
        chat = body.to_chat()
        prepared = await server.admit(chat, http)
        request, tool_use = prepared.requests[0], prepared.tool_use  # one prompt, n = 1
    except APIError as error:
        raise renamed(error) from None
    writer = ResponseWriter(new_response(body, chat, server, request.params), tool_use and tool_use.extractor())
    outputs = server.outputs(request, http.state.admission)
    first = await until_disconnected(server.first_output(outputs, http.state.admission), http)
    if first is None:
        return Response(status_code=499)  # the client has gone: nobody reads it
    outputs = prepend(first, outputs)
    if body.stream:
        return StreamingResponse(sse(request, writer, outputs), media_type="text/event-stream")
    reply = await until_disconnected(drain(request, writer, outputs), http)
    return Response(status_code=499) if reply is None else reply


async def events(request, writer: ResponseWriter, outputs):
    yield writer.start()
    num_tokens = num_cached_tokens = 0
    async for output in outputs:
        completion = output.outputs[0]
        num_tokens += len(completion.token_ids)
        num_cached_tokens = output.num_cached_tokens
        yield writer.write(completion.text, final=completion.finish_reason is not None)
    num_prompt_tokens = len(request.prompt_token_ids)
    yield writer.finish(completion.finish_reason, {
        "input_tokens": num_prompt_tokens, "input_tokens_details": {"cached_tokens": num_cached_tokens},
        "output_tokens": num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_prompt_tokens + num_tokens})


async def drain(request, writer: ResponseWriter, outputs) -> dict:
    async for _ in events(request, writer, outputs):
        pass
    return writer.response


async def sse(request, writer: ResponseWriter, outputs):
    try:
        async for batch in events(request, writer, outputs):
            for event in batch:
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
    except APIError as error:
        event = writer.event("error", code=str(error.status), message=error.message, param=error.param)
        yield f"event: error\ndata: {json.dumps(event)}\n\n"
