"""The OpenAI request bodies (pydantic) and their mapping onto SamplingParams.

Fields the server does not know are ignored, as vLLM and OpenAI clients expect. A known field is
checked strictly at this boundary: its JSON type (no "16" for 16, no true for 1), finite floats,
ints that fit the int64 tensors they feed, text that encodes as UTF-8, and JSON values nested at
most MAX_JSON_DEPTH deep. What the values mean is checked by SamplingParams and
LLMEngine.make_request, the checks the offline LLM runs. Every error names its field.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from nanoengine.config import GENERATION_DEFAULTS
from nanoengine.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    field_error,
)

MAX_JSON_DEPTH = 32  # a deeper schema is refused: compiling and pickling it grow with its depth


def utf8(text: str) -> str:
    text.encode()  # a lone surrogate raises UnicodeEncodeError, a ValueError that pydantic reports for the field
    return text


def shallow_json(value: Any) -> Any:
    """``value`` if it nests at most MAX_JSON_DEPTH deep and its strings (keys too) encode as UTF-8."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((part, depth + 1) for pair in item.items() for part in pair)
        elif isinstance(item, list):
            stack.extend((part, depth + 1) for part in item)
        elif isinstance(item, str):
            utf8(item)
    return value


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Text = Annotated[str, AfterValidator(utf8)]
JsonObject = Annotated[dict[str, Any], AfterValidator(shallow_json)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    name: Text | None = None
    json_schema: JsonObject = Field(alias="schema")


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# The request fields that generation_config.json can default (its max_new_tokens is the token limit).
SAMPLING_FIELDS = tuple(name for name in GENERATION_DEFAULTS if name != "max_new_tokens")


class GenerationRequest(Body):
    """What /v1/completions and /v1/chat/completions share (OpenAI's fields, then vLLM's extensions)."""

    model: Text | None = None
    max_tokens: Int64 | None = None
    n: Int64 = 1
    # The sampling fields are None when the request leaves them out: the model's generation_config fills
    # those (as in vLLM's server), and SamplingParams' own defaults fill the rest.
    temperature: Finite | None = None
    top_p: Finite | None = None
    presence_penalty: Finite | None = None
    frequency_penalty: Finite | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    top_k: Int64 | None = None
    min_p: Finite | None = None
    repetition_penalty: Finite | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    cache_salt: Text | None = None
    structured_outputs: JsonObject | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict) -> SamplingParams:
        """``defaults``: the model's generation_config values (``LLMEngine.config.default_sampling_params()``)."""
        if self.n != 1:
            raise field_error("n", f"only n=1 is served (one choice per request), got n={self.n}")
        given = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        sampling = {name: value for name, value in defaults.items() if name in SAMPLING_FIELDS} | given
        return SamplingParams(
            **sampling, seed=self.seed, max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=self.stop, stop_token_ids=self.stop_token_ids,
            logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs_params(self.response_format, self.structured_outputs))


class CompletionRequest(GenerationRequest):
    prompt: Text | list[Int64]
    max_tokens: Int64 | None = 16  # OpenAI's default for completions
    logprobs: Int64 | None = None

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs, defaults)


class TextPart(Body):
    type: Literal["text"]  # the chat templates here take text only
    text: Text


ToolName = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(utf8)]


class FunctionDefinition(Body):
    name: ToolName
    description: Text | None = None
    parameters: JsonObject | None = None  # a JSON schema; None takes no arguments
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: Text


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


def json_arguments(arguments: str) -> str:
    try:
        shallow_json(json.loads(arguments) if arguments else {})
    except json.JSONDecodeError as error:
        raise ValueError(f"the arguments are not JSON: {error}") from None
    return arguments


JsonArguments = Annotated[str, AfterValidator(json_arguments)]  # a call's arguments as the model wrote them


class FunctionCall(Body):
    name: Text
    arguments: JsonArguments


class ToolCall(Body):
    """A call the assistant made, sent back in the conversation's history."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """Arguments as a dict: what chat templates that render tool calls expect (vLLM parses them too)."""
        arguments = json.loads(self.function.arguments) if self.function.arguments else {}
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(Body):
    model_config = ConfigDict(extra="allow", strict=True)  # e.g. "name": passed on to the chat template
    role: Text
    # None only for an assistant message that made tool calls (OpenAI's history shape)
    content: Text | list[TextPart] | None = Field(default=None, validate_default=True)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None  # a role "tool" message's answer to that call

    @field_validator("content")
    @classmethod
    def content_or_tool_calls(cls, content, info: ValidationInfo):
        if content is None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message may leave out its content")
        return content

    @model_validator(mode="after")
    def shallow_extra_fields(self) -> "ChatMessage":
        shallow_json(self.model_extra)
        return self

    def for_template(self) -> dict:
        """Text parts joined into one string (no content: ""), tool calls' arguments as dicts."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            message["content"] = ""
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # with tools: "auto"
    parallel_tool_calls: bool = True

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        return self.sampling_params(max_tokens, logprobs, defaults)


def structured_outputs_params(response_format: ResponseFormat | None,
                              structured_outputs: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format, or vLLM's structured_outputs ({json, regex, choice, grammar}), as engine params."""
    if structured_outputs is not None:
        if response_format is not None and response_format.type != "text":
            raise field_error("structured_outputs", "give either response_format or structured_outputs, not both")
        try:
            return StructuredOutputsParams(**structured_outputs)
        except TypeError as error:  # an unknown key
            raise field_error("structured_outputs", f"structured_outputs: {error}", TypeError) from None
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None:
        raise field_error("response_format", "response_format of type json_schema needs a json_schema field")
    return StructuredOutputsParams(json=response_format.json_schema.json_schema)
