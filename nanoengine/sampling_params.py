"""SamplingParams: how one request is decoded, validated when it is built."""

import enum
import math
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all tokens and text so far
    DELTA = 1       # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar: set exactly one of the fields (vLLM's names)."""

    json: str | dict | None = None        # a JSON schema, as a dict or a JSON string
    regex: str | None = None
    choice: list[str] | None = None       # the output is exactly one of these strings
    grammar: str | None = None            # EBNF, in xgrammar's dialect
    json_object: bool | None = None       # any JSON object
    disable_any_whitespace: bool = False  # JSON without optional whitespace: small models may loop on newlines

    def __post_init__(self):
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise invalid_constraint(f" needs exactly one of {list(CONSTRAINTS)}, got {given or 'none'}")
        types, expected = CONSTRAINTS[self.kind]
        value = getattr(self, self.kind)
        if not isinstance(value, types):
            raise invalid_constraint(f".{self.kind} must be {expected}, got {type(value).__name__}", TypeError)
        if not isinstance(self.disable_any_whitespace, bool):
            raise invalid_constraint(".disable_any_whitespace must be a bool", TypeError)
        if self.kind == "choice" and not (value and all(isinstance(c, str) and c for c in value)):
            raise invalid_constraint(f".choice must be a non-empty list of non-empty strings, got {value!r}")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))


def invalid_constraint(what: str, kind: type[Exception] = ValueError) -> Exception:
    """A bad structured_outputs value; ``what`` follows the field's name (" needs ..." or ".choice must ...")."""
    return field_error("structured_outputs", "structured_outputs" + what, kind)


CONSTRAINTS = {"json": ((str, dict), "a JSON schema (a dict or a str)"), "regex": (str, "a str"),
               "choice": (list, "a list of str"), "grammar": (str, "a str"), "json_object": (bool, "a bool")}


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    # Penalties, as layers/sampler.py defines them: presence and frequency over the output tokens,
    # repetition over the prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token after the first: its logprob and the top N
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    # Derived: the stop strings as a list.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        check_number("n", self.n, int, low=1)
        check_number("temperature", self.temperature, (int, float), low=0)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise field_error("temperature", f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                                             f"{self.temperature}")
        check_number("top_p", self.top_p, (int, float), high=1)
        if not self.top_p > 0:
            raise field_error("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check_number("top_k", self.top_k, int, low=-1)
        check_number("min_p", self.min_p, (int, float), low=0, high=1)
        check_number("presence_penalty", self.presence_penalty, (int, float), low=-2, high=2)
        check_number("frequency_penalty", self.frequency_penalty, (int, float), low=-2, high=2)
        check_number("repetition_penalty", self.repetition_penalty, (int, float))
        if not self.repetition_penalty > 0:
            raise field_error("repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            check_number("seed", self.seed, int)
        if self.max_tokens is not None:
            check_number("max_tokens", self.max_tokens, int, low=0)  # 0: only the prompt is computed
        check_number("min_tokens", self.min_tokens, int, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise field_error("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                            f"({self.max_tokens})")
        if self.logprobs is not None:
            check_number("logprobs", self.logprobs, int, low=0)
        if self.prompt_logprobs is not None:
            check_number("prompt_logprobs", self.prompt_logprobs, int, low=0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise field_error(name, f"{name} must be a bool, got {type(getattr(self, name)).__name__}", TypeError)
        if not isinstance(self.structured_outputs, StructuredOutputsParams | None):
            raise field_error("structured_outputs", f"structured_outputs must be a StructuredOutputsParams, got "
                                                   f"{type(self.structured_outputs).__name__}", TypeError)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise field_error("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}",
                              TypeError)
        self.logit_bias = self.validated_logit_bias()
        self.stop_strings = self.validated_stop()
        self.stop_token_ids = self.validated_stop_token_ids()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validated_stop(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise field_error("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        return stop

    def validated_logit_bias(self) -> dict[int, float] | None:
        """The bias as {token id: value}, each value clamped to [-100, 100] as OpenAI specifies."""
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            raise field_error("logit_bias", f"logit_bias must be a dict of token id -> number, got "
                                            f"{type(self.logit_bias).__name__}", TypeError)
        for token_id, bias in self.logit_bias.items():
            check_number("logit_bias", token_id, int)  # its keys are token ids
            check_number("logit_bias", bias, (int, float))
        return {token_id: min(100.0, max(-100.0, float(bias))) for token_id, bias in self.logit_bias.items()} or None

    def validated_stop_token_ids(self) -> list[int]:
        ids = list(self.stop_token_ids or [])
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise field_error("stop_token_ids", f"stop_token_ids must be non-negative ints, got "
                                                f"{self.stop_token_ids!r}")
        return ids


INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # every int of a request ends up in an int64 tensor or generator seed
MIN_TEMPERATURE = 0.01  # below it (and above 0) the logits / temperature overflow float32


def field_error(name: str, message: str, kind: type[Exception] = ValueError) -> Exception:
    """An error that names the request field at fault: the server reports it as the 400's ``param``."""
    error = kind(message)
    error.param = name
    return error


def check_number(name: str, value, types, low=None, high=None, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        expected = "an int" if types is int else "a number"
        raise field_error(name, f"{name} must be {expected}, got {type(value).__name__}", TypeError)
    if isinstance(value, float) and not math.isfinite(value):
        raise field_error(name, f"{name} must be a finite number, got {value}")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise field_error(name, f"{name} must fit in a signed 64-bit integer, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise field_error(name, f"{name} must be {bounds}, got {value}" + (f" ({why})" if why else ""))


def check_text(name: str, value) -> None:
    """A str that encodes as UTF-8 (JSON's escapes can carry lone surrogates, which tokenizers and hashes refuse)."""
    if not isinstance(value, str):
        raise field_error(name, f"{name} must be a str, got {type(value).__name__}", TypeError)
    try:
        value.encode()
    except UnicodeEncodeError as error:
        raise field_error(name, f"{name} is not valid Unicode text: {error.reason} at position {error.start}") \
            from None
