"""The OpenAI request bodies (pydantic) and their mapping onto SamplingParams.

Fields the server does not know are ignored, as vLLM and OpenAI clients expect; a known field with a
bad type or value is a 400 naming it. The values themselves are checked by SamplingParams and
LLMEngine.make_request, the same checks the offline LLM runs.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoengine.config import GENERATION_DEFAULTS
from nanoengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# The request fields that generation_config.json can default (its max_new_tokens is the token limit).
SAMPLING_FIELDS = tuple(name for name in GENERATION_DEFAULTS if name != "max_new_tokens")


class GenerationRequest(BaseModel):
    """What /v1/completions and /v1/chat/completions share (OpenAI's fields, then vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    # The sampling fields are None when the request leaves them out: the model's generation_config fills
    # those (as in vLLM's server), and SamplingParams' own defaults fill the rest.
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict) -> SamplingParams:
        """``defaults``: the model's generation_config values (``LLMEngine.config.default_sampling_params()``)."""
        if self.n != 1:
            raise ValueError(f"only n=1 is served (one choice per request), got n={self.n}")
        given = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        sampling = {name: value for name, value in defaults.items() if name in SAMPLING_FIELDS} | given
        return SamplingParams(
            **sampling, seed=self.seed, max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=self.stop, stop_token_ids=self.stop_token_ids,
            logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs_params(self.response_format, self.structured_outputs))


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs, defaults)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. "name": passed on to the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict:
        """Text parts joined into one string: the chat templates here take text only."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise ValueError("messages: only text content parts are supported")
            message["content"] = "".join(part.get("text", "") for part in self.content)
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.max_completion_tokens or self.max_tokens, logprobs, defaults)


def structured_outputs_params(response_format: ResponseFormat | None,
                              structured_outputs: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format, or vLLM's structured_outputs ({json, regex, choice, grammar}), as engine params."""
    if structured_outputs is not None:
        if response_format is not None and response_format.type != "text":
            raise ValueError("give either response_format or structured_outputs, not both")
        return StructuredOutputsParams(**structured_outputs)  # an unknown key is a TypeError naming it
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None:
        raise ValueError("response_format of type json_schema needs a json_schema field")
    return StructuredOutputsParams(json=response_format.json_schema.json_schema)
