"""The OpenAI request bodies (pydantic, strict) and their mapping onto SamplingParams.

Every field of OpenAI's and vLLM's requests is honoured, or refused with a 400 naming it when set to
anything but its "off" value (unsupported.py's tables); other keys are logged once and ignored, as in
vLLM. A field's JSON type, finite floats, int64 range, UTF-8 text and JSON depth are checked here; what the
values mean, by SamplingParams and make_request, as offline.
"""

import json
from dataclasses import fields
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from nanoengine.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    field_error,
)
from nanoengine.serve.unsupported import CHAT_NOT_IMPLEMENTED, COMPLETIONS_NOT_IMPLEMENTED, NOT_IMPLEMENTED

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
    continuous_usage_stats: bool = False  # with include_usage: every chunk carries its choice's usage so far


FormatType = Literal["text", "json_object", "json_schema"]


class JsonSchemaFormat(Body):
    name: Text | None = None
    json_schema: JsonObject = Field(alias="schema")


class ResponseFormat(Body):
    type: FormatType
    json_schema: JsonSchemaFormat | None = None


class TopLevelBody(Body):
    """A request's whole body: its fields, the ones refused (``not_implemented``), and keys kept apart."""

    model_config = ConfigDict(extra="allow", strict=True)  # unknown keys land in model_extra: see unknown_fields()
    not_implemented: ClassVar[dict] = {}

    def unknown_fields(self) -> list[str]:
        """The body's keys that no OpenAI or vLLM request has; raises for one this server does not implement."""
        for name, value in (self.model_extra or {}).items():
            off, why = self.not_implemented.get(name, ((value,), ""))
            if value not in off:
                raise field_error(name, f"{name}: {why}")
        return [name for name in self.model_extra or {} if name not in self.not_implemented]

    def names(self) -> dict[str, str]:
        """The body's name for each engine field (or, for a body served as a chat request, chat field) that an
        error may name, where it differs: see APIError.renamed."""
        return {}


# SamplingParams' fields that a request passes on as they are, when it has them; the others are computed.
COMPUTED = {"max_tokens", "logprobs", "prompt_logprobs", "logit_bias", "structured_outputs", "output_kind"}
PASSED_ON = [f.name for f in fields(SamplingParams) if f.init and f.name not in COMPUTED]


class GenerationRequest(TopLevelBody):
    """What /v1/completions and /v1/chat/completions share (OpenAI's fields, then vLLM's extensions)."""

    not_implemented: ClassVar[dict] = NOT_IMPLEMENTED
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
    logit_bias: dict[Text, Finite] | None = None  # token id (as a string) -> bias
    # Accepted, with no effect on the output (OpenAI's and vLLM's too): who asks, and hints for a cache router.
    user: Text | None = None
    metadata: JsonObject | None = None
    session_id: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None

    def as_generation(self) -> "GenerationRequest":
        return self

    def names(self) -> dict[str, str]:
        names = {"prompt_token_ids": "prompt"}
        return names | ({"structured_outputs": "response_format"} if self.structured_outputs is None else {})

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """``defaults``: the model's generation_config values (``LLMEngine.config.default_sampling_params()``)."""
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options needs stream=true")
        passed = {name: getattr(self, name) for name in PASSED_ON if getattr(self, name) is not None}
        return SamplingParams(**{name: value for name, value in defaults.items() if name != "max_tokens"} | passed,
                              max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              logit_bias=token_id_keys(self.logit_bias), output_kind=RequestOutputKind.DELTA,
                              structured_outputs=structured_outputs_params(self.response_format,
                                                                           self.structured_outputs))


def token_id_keys(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON's string keys as token ids (SamplingParams checks the values, the engine the ids)."""
    if logit_bias is None:
        return None
    try:
        return {int(key): bias for key, bias in logit_bias.items()}
    except ValueError:
        raise field_error("logit_bias", f"logit_bias: its keys must be token ids, got {list(logit_bias)[:5]}") \
            from None


class CompletionRequest(GenerationRequest):
    not_implemented: ClassVar[dict] = NOT_IMPLEMENTED | COMPLETIONS_NOT_IMPLEMENTED
    prompt: Text | list[Int64] | list[Text] | list[list[Int64]]
    max_tokens: Int64 | None = 16  # OpenAI's default for completions
    logprobs: Int64 | None = None
    echo: bool = False  # each choice starts with its prompt (and, with logprobs, the prompt tokens' logprobs)
    best_of: Int64 | None = None  # served when it equals n
    prompt_logprobs: Int64 | None = None  # vLLM's: the prompt tokens' logprobs in the choice, not streamed

    def prompts(self) -> list[str | list[int]]:
        """A string, a list of token ids, or a list of either: one engine request each."""
        if isinstance(self.prompt, str) or all(isinstance(p, int) for p in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise field_error("best_of", f"best_of must equal n ({self.n}), got {self.best_of}: choosing the best n "
                                         f"of more samples is not implemented (nor in vLLM's V1 engine)")
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "max_tokens=0 returns nothing without echo=true")
        if self.prompt_logprobs is not None and self.stream:
            raise field_error("prompt_logprobs", "prompt_logprobs are not streamed (as in vLLM): use echo")
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else self.prompt_logprobs
        return self.sampling_params(self.max_tokens, self.logprobs, defaults, prompt_logprobs)


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
    not_implemented: ClassVar[dict] = NOT_IMPLEMENTED | CHAT_NOT_IMPLEMENTED
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # with tools: "auto"
    parallel_tool_calls: bool = True
    continue_final_message: bool = False  # the model extends the last (assistant) message
    chat_template_kwargs: JsonObject | None = None  # extra variables for the chat template (e.g. enable_thinking)
    documents: list[dict[Text, Text]] | None = None  # for templates that render retrieved documents
    include_reasoning: bool = True  # vLLM's; no reasoning parser runs, so there is no reasoning to leave out

    def names(self) -> dict[str, str]:
        names = super().names() | {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            names["structured_outputs"] = "tools"  # the grammar of a forced tool call: its parameters' schema
        return names

    def template_options(self) -> dict:
        """What the chat template gets besides the messages."""
        taken = sorted(TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if taken:
            raise field_error("chat_template_kwargs", f"chat_template_kwargs may not set {taken}: give them as "
                                                      f"request fields")
        if self.add_generation_prompt and self.continue_final_message:
            raise field_error("continue_final_message", "continue_final_message needs add_generation_prompt=false")
        documents = {} if self.documents is None else {"documents": self.documents}
        return {**(self.chat_template_kwargs or {}), **documents, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        if max_tokens == 0:
            raise field_error("max_tokens", "max_tokens must be at least 1 (max_tokens=0 with echo is served on "
                                            "/v1/completions)")
        return self.sampling_params(max_tokens, logprobs, defaults)


class TokenizeRequest(Body):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: Text | None = None
    tokens: list[Int64]


# apply_chat_template's own arguments: chat_template_kwargs may not set them.
TEMPLATE_ARGUMENTS = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


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
