"""/v1/responses: OpenAI's Responses API, served as a chat request.

A request becomes a ChatCompletionRequest (``instructions`` as the system message, the input items as messages,
function tools as chat tools, ``text.format`` as ``response_format``), so it is validated, templated, generated
and its tool calls parsed exactly as a chat request's are; ``ResponseWriter`` tells the output as Responses items
and events. Nothing is stored: ``store: true``, ``previous_response_id`` and the other fields that need a stored
response, a hosted tool or a reasoning model are each a 400 naming the field. docs/serving.md lists the events.
"""

import copy
import time
import uuid
from typing import Annotated, Literal

from pydantic import Field, ValidationError

from nanoengine.sampling_params import INT64_MAX
from nanoengine.serve.errors import APIError
from nanoengine.serve.protocol import (
    Body,
    ChatCompletionRequest,
    Finite,
    FormatType,
    FunctionDefinition,
    JsonArguments,
    JsonObject,
    JsonSchemaFormat,
    Text,
    TopLevelBody,
)
from nanoengine.serve.unsupported import RESPONSES_NOT_IMPLEMENTED


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


class FunctionTool(FunctionDefinition):
    type: Literal["function"]  # hosted tools (web_search, file_search, ...) are not served


class NamedFunction(Body):
    type: Literal["function"]
    name: Text


class TextFormat(JsonSchemaFormat):
    type: FormatType
    json_schema: JsonObject | None = Field(None, alias="schema")


class TextOptions(Body):
    format: TextFormat | None = None


class ResponsesRequest(TopLevelBody):
    not_implemented = RESPONSES_NOT_IMPLEMENTED
    model: Text | None = None
    input: Text | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop input that does not fit
    metadata: dict[str, Text] | None = None
    user: Text | None = None

    def names(self) -> dict[str, str]:
        """A chat (or engine) field's name in this request."""
        tools = {f"tools.{i}.function": f"tools.{i}" for i in range(len(self.tools or []))}
        return {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "messages": "input",
                "prompt": "input", "prompt_token_ids": "input", "response_format": "text.format",
                "structured_outputs": "text.format", **tools}

    def as_generation(self) -> ChatCompletionRequest:
        """The equivalent chat request (its errors name the chat request's fields)."""
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
            raise APIError(400, f"{param}: {first['msg']}", param) from None

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


class ResponseWriter:
    """Writes the generated text into the Response's output items, and returns the stream's events as it goes.
    A tool-call extractor (tools.py) splits the text into content and calls first, when tools are in use."""

    named_events = True  # each SSE frame has an "event:" line, its type
    end_of_stream = None

    def __init__(self, response: dict, extractor, num_prompt_tokens: int = 0):
        self.response, self.extractor, self.num_prompt_tokens = response, extractor, num_prompt_tokens
        self.item: dict | None = None  # the output item being written
        self.sequence_number = 0

    @classmethod
    def of(cls, body: ResponsesRequest, prepared, model_name: str, decode=None) -> "ResponseWriter":
        request, tool_use = prepared.requests[0], prepared.tool_use  # one prompt, n = 1
        return cls(new_response(body, prepared.body, model_name, request.params),
                   tool_use and tool_use.extractor(), len(request.prompt_token_ids))

    async def stream(self, outputs):
        for event in self.start():
            yield event
        num_tokens = num_cached_tokens = 0
        async for _, output in outputs:
            completion = output.outputs[0]
            num_tokens += len(completion.token_ids)
            num_cached_tokens = output.num_cached_tokens
            for event in self.write(completion.text, final=completion.finish_reason is not None):
                yield event
        for event in self.finish(completion.finish_reason, {
                "input_tokens": self.num_prompt_tokens, "input_tokens_details": {"cached_tokens": num_cached_tokens},
                "output_tokens": num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt_tokens + num_tokens}):
            yield event

    async def whole(self, outputs) -> dict:
        async for _ in self.stream(outputs):
            pass
        return self.response

    def error_event(self, error: APIError) -> dict:
        return self.event("error", code=str(error.status), message=error.message, param=error.param)

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


def new_response(body: ResponsesRequest, chat: ChatCompletionRequest, model_name: str, params) -> dict:
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model_name, "output": [], "error": None,
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
