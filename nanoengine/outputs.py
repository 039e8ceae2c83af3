"""What the engine hands back: RequestOutput with one CompletionOutput, plus timings."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between consecutive output tokens (inter-token latency)."""
        if self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with SamplingParams.prompt_logprobs


@dataclass
class EngineStats:
    num_kvcache_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    # Speculative decoding, as vLLM counts it: verified drafts (one per request and step), their tokens,
    # and the tokens accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    weight_bytes: int = 0  # the loaded model's weights (this rank's shard), quantized weights' scales included
    # Per step, oldest first: (num_running, num_waiting, kv_cache_usage) after each step.
    step_history: list[tuple[int, int, float]] = field(default_factory=list, repr=False)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens emitted per drafted request and step: the accepted drafts and the token sampled after them."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks held by live requests."""
        return 1 - self.num_free_blocks / self.num_kvcache_blocks

    def plot(self, path: str) -> None:
        """Draw ``step_history`` (running, waiting and KV usage per step) as a PNG; needs matplotlib."""
        from nanoengine.utils.plots import plot_step_history
        plot_step_history(self.step_history, path)
