"""The choices of one completion or chat reply: one per (prompt, sample), in OpenAI's order (prompt-major: the
n samples of prompt 0, then those of prompt 1, ...), filled from the engine's DELTA outputs.

With ``echo`` (completions), a choice's first piece starts with its prompt: the prompt's text, and with
``logprobs`` the prompt tokens' entries (None for the first token, which nothing predicts), which the engine
computed as ``prompt_logprobs``.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from nanoengine.outputs import Logprob, RequestOutput


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
