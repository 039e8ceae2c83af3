"""One request's state as it moves through the engine."""

import enum

import torch

from nanoengine.outputs import CompletionOutput, Logprob, RequestMetrics
from nanoengine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request:
    """A prompt plus what has been generated; ``num_computed_tokens`` says how many have KV in the cache.

    There is no prefill or decode phase: each step the scheduler gives a
    request up to ``num_tokens - num_computed_tokens`` new tokens to compute.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, priority: int = 0, cache_salt: str | None = None, max_tokens: int = 16):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens, or what max_model_len leaves when that is None
        self.priority = priority
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache when first scheduled
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.registered_parent: int | None = None  # the serial of the block holding the last of those prefixes
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_token_ids: set[int] = set()  # EOS (unless ignore_eos) and params.stop_token_ids
        self.matcher = None  # a structured request's grammar matcher (xgrammar), set by the engine
        self.spec_token_ids: list[int] = []  # drafts of the tokens after all_token_ids, not verified yet
        self.draft_length = None  # with speculative decoding: its DraftLength, set by the engine
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        # The first prompt token has no logprob (nothing predicts it): None, as in vLLM.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.cumulative_logprob = 0.0
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.parent: ParentRequest | None = None  # set when this request is one of n samples of a prompt
        self.index = 0  # which of the parent's n samples this is

    def generator_at(self, output_index: int) -> torch.Generator | None:
        """A seeded request's noise for its ``output_index``-th token depends on (seed, index) alone, so
        that drafts, preemptions and other requests in the batch never change what it samples."""
        if self.params.seed is None:
            return None
        return torch.Generator().manual_seed((self.params.seed * 0x9E3779B97F4A7C15 + output_index) % 2**64)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


class ParentRequest:
    """A request with n > 1: n child requests sample its prompt; their outputs are gathered under its id."""

    def __init__(self, request_id: str, params: SamplingParams, children: list[Request]):
        self.request_id = request_id
        self.params = params
        self.children = children
        self.completions: list[CompletionOutput | None] = [None] * len(children)  # each child's latest
        for index, child in enumerate(children):
            child.parent, child.index = self, index
