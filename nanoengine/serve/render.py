"""Completion and chat replies, whole or streamed, from the engine's DELTA outputs.

A reply has one choice per (prompt, sample), in OpenAI's order (prompt-major: the n samples of prompt 0, then
those of prompt 1, ...). With ``echo`` (completions), a choice's first piece starts with its prompt: its text,
and with ``logprobs`` the prompt tokens' entries (None for the first token, which nothing predicts).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nanoengine.outputs import Logprob, RequestOutput
from nanoengine.serve.errors import APIError
from nanoengine.serve.protocol import ChatCompletionRequest, GenerationRequest
from nanoengine.serve.tools import ToolUse


@dataclass
class Piece:
    """What one output adds to a choice."""

    text: str
    token_ids: list[int]
    entries: list[dict[int, Logprob] | None] | None  # the engine's logprobs of each token, when asked for
    text_offset: int  # where the piece starts in the choice's text


@dataclass
class Choice:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    entries: list[dict[int, Logprob] | None] = field(default_factory=list)
    num_output_tokens: int = 0  # generated tokens (echoed prompt tokens are not counted)
    finish_reason: str | None = None


class Choices:
    def __init__(self, n: int, echo_texts: list[str] | None):
        self.n, self.echo_texts = n, echo_texts
        self.by_index: dict[int, Choice] = {}
        self.prompt_logprobs: dict[int, list] = {}  # per prompt, when asked for
        self.num_cached_tokens: dict[int, int] = {}  # per prompt: its tokens found in the prefix cache

    def add(self, prompt_index: int, output: RequestOutput) -> tuple[Choice, Piece]:
        completion = output.outputs[0]
        index = prompt_index * self.n + completion.index
        choice = self.by_index.get(index)
        if output.prompt_logprobs:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        self.num_cached_tokens[prompt_index] = output.num_cached_tokens
        piece = Piece(completion.text, list(completion.token_ids), completion.logprobs,
                      0 if choice is None else len(choice.text))
        if choice is None:
            choice = self.by_index[index] = Choice(index, prompt_index)
            if self.echo_texts is not None:
                piece.text = self.echo_texts[prompt_index] + piece.text
                piece.token_ids = output.prompt_token_ids + piece.token_ids
                if piece.entries is not None:
                    piece.entries = output.prompt_logprobs + piece.entries
        choice.text += piece.text
        choice.token_ids += piece.token_ids
        choice.entries += piece.entries or []
        choice.num_output_tokens += len(completion.token_ids)
        choice.finish_reason = completion.finish_reason
        return choice, piece

    def in_order(self) -> list[Choice]:
        return [self.by_index[i] for i in sorted(self.by_index)]

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.by_index.values())


class ChoicesRenderer:
    """A /v1/completions or /v1/chat/completions reply: ``whole`` returns it, ``stream`` yields its chunks."""

    named_events = False  # SSE frames are "data:" lines only
    end_of_stream = "data: [DONE]\n\n"

    def __init__(self, body: GenerationRequest, prepared, model_name: str, decode: Callable[[int], str]):
        self.body, self.prepared, self.decode = body, prepared, decode
        self.chat = isinstance(body, ChatCompletionRequest)
        self.base = {"id": prepared.request_id, "created": int(time.time()), "model": model_name}
        self.choices = Choices(body.n, prepared.echo_texts)
        self.tool_use: ToolUse | None = prepared.tool_use
        self.num_top = prepared.requests[0].params.logprobs

    def logprobs(self, token_ids: list[int], entries, text_offset: int) -> dict | None:
        if self.num_top is None:
            return None
        if self.chat:
            return chat_logprobs(token_ids, entries, self.num_top)
        return completion_logprobs(token_ids, entries, self.num_top, text_offset, self.decode)

    def usage(self) -> dict:
        return usage(sum(len(r.prompt_token_ids) for r in self.prepared.requests), self.choices.num_output_tokens,
                     sum(self.choices.num_cached_tokens.values()))

    async def whole(self, outputs) -> dict:
        async for prompt_index, output in outputs:
            self.choices.add(prompt_index, output)
        replies = []
        for choice in self.choices.in_order():
            reply = make_choice(self.chat, False, choice.index, choice.text, choice.finish_reason,
                                self.logprobs(choice.token_ids, choice.entries, 0))
            if not self.chat and self.body.prompt_logprobs is not None:
                reply["prompt_logprobs"] = vllm_prompt_logprobs(self.choices.prompt_logprobs[choice.prompt_index])
            replies.append(reply if self.tool_use is None else self.tool_use.shape_message(reply))
        return {**self.base, "object": "chat.completion" if self.chat else "text_completion", "choices": replies,
                "usage": self.usage()}

    async def stream(self, outputs):
        base = {**self.base, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        shaper = self.tool_use and self.tool_use.chunk_shaper()
        options = self.body.stream_options
        include_usage = options is not None and options.include_usage
        continuous_usage = include_usage and options.continuous_usage_stats
        extra = {"usage": None} if include_usage else {}
        if self.chat:
            for index in range(len(self.prepared.requests) * self.body.n):
                first = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield {**base, "choices": [first], **extra}
        async for prompt_index, output in outputs:
            choice, piece = self.choices.add(prompt_index, output)
            logprobs = self.logprobs(piece.token_ids, piece.entries, piece.text_offset)
            chunk = make_choice(self.chat, True, choice.index, piece.text, choice.finish_reason, logprobs)
            if shaper and (chunk := shaper.shape(chunk)) is None:
                continue  # text held back, e.g. what may start a tool call's tag
            if continuous_usage:
                extra = {"usage": usage(len(output.prompt_token_ids), choice.num_output_tokens,
                                        self.choices.num_cached_tokens[prompt_index])}
            yield {**base, "choices": [chunk], **extra}
        if include_usage:
            yield {**base, "choices": [], "usage": self.usage()}

    @staticmethod
    def error_event(error: APIError) -> dict:
        return error.body()


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage, with the prompt tokens found in the prefix cache where vLLM reports them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(token_ids: list[int], logprobs: list, num_top: int) -> dict:
    """The chat API's logprobs, from the engine's per-token {token id: Logprob} (the sampled id included)."""
    rows = [(entry[token_id], sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank))
            for token_id, entry in zip(token_ids, logprobs)]

    def item(lp):
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
    return {"content": [{**item(s), "top_logprobs": [item(t) for t in top]} for s, top in rows]}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], num_top: int,
                        text_offset: int, decode: Callable[[int], str]) -> dict:
    """The completions API's logprobs: per token its text, logprob and offset in the choice's text, and the
    ``num_top`` most likely tokens plus the chosen one (as OpenAI and vLLM give them). An echoed prompt's first
    token has no logprob: None, and None for its top tokens."""
    tokens, token_logprobs, top_logprobs, text_offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            token, logprob, top = decode(token_id), None, None
        else:
            chosen = entry[token_id]
            token, logprob = chosen.decoded_token, chosen.logprob
            top = {lp.decoded_token: lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)
                   if lp.rank <= num_top or lp is chosen}
        tokens.append(token)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        text_offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offsets}


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token None (the first) or {token id: its Logprob}."""
    return [None if entry is None else {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                                        "decoded_token": lp.decoded_token}
                                        for token_id, lp in entry.items()}
            for entry in entries]
