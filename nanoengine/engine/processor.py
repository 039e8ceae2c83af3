"""The input side, as vLLM V1's Processor: validate a request, tokenize its prompt (or render a chat through the
template), and build the Request. Nothing is queued here: the engine queues what this returns, and the server's
front process uses it alone (a tokenizer and the config, no model) to answer a bad request with a 400 at once.
"""

import time
from dataclasses import replace

from gguf import GGUFReader
from transformers import AutoTokenizer

from nanoengine.config import EngineConfig
from nanoengine.engine.request import ParentRequest, Request
from nanoengine.engine.structured_output import StructuredOutputManager
from nanoengine.sampling_params import SamplingParams, check_number, check_text, field_error
from nanoengine.utils.gguf_file import gguf_tokenizer, is_gguf


def load_tokenizer(config: EngineConfig):
    """A folder's tokenizer, or the one a GGUF file's metadata describes (the model's file, read once, or another)."""
    if is_gguf(config.tokenizer):
        return gguf_tokenizer(config.gguf() if config.tokenizer == config.model else GGUFReader(config.tokenizer))
    return AutoTokenizer.from_pretrained(config.tokenizer)


class Processor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.eos_token_ids = self.find_eos_token_ids()
        self.structured_outputs: StructuredOutputManager | None = None  # made for the first structured request

    def find_eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id} - {None}
        try:
            eos = self.config.model_generation_config().eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
        return ids

    def make_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None) -> Request | ParentRequest:
        """Validate everything about a request and build it."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        arrival_time = time.time() if arrival_time is None else arrival_time  # wall clock, as vLLM users pass
        if params.n > 1:
            return self.make_parent_request(request_id, prompt, params, priority, arrival_time)
        check_number("priority", priority, int)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise field_error("priority", f"priority={priority} needs scheduling_policy='priority' (it is "
                                          f"{self.config.scheduling_policy!r})")
        self.check_params_fit_vocab(params)
        text, token_ids, cache_salt = self.parse_prompt(prompt)
        self.check_prompt_tokens(token_ids)
        room = self.config.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id, text, token_ids, params, arrival_time, priority, cache_salt, max_tokens)
        request.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        if params.structured_outputs is not None:
            request.matcher = self.structured_output_manager().new_matcher(params.structured_outputs,
                                                                          request.stop_token_ids)
        return request

    def render_chat(self, conversation: list[dict], **template_options) -> tuple[str, list[int]]:
        """A conversation through the chat template: its text and token ids (the template holds any special
        tokens, so none are added). ``template_options`` go to ``apply_chat_template``."""
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, **template_options)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def structured_output_manager(self) -> StructuredOutputManager:
        if self.structured_outputs is None:
            self.structured_outputs = StructuredOutputManager(self.tokenizer, self.config.hf_config.vocab_size,
                                                              self.eos_token_ids)
        return self.structured_outputs

    def make_parent_request(self, request_id: str, prompt, params: SamplingParams, priority: int,
                            arrival_time: float) -> ParentRequest:
        """n > 1 fans out, as in vLLM, into n requests "i_<id>" that share the prompt's blocks through the prefix
        cache; child i is seeded with seed + i, so it samples what a separate request with that seed would."""
        children = [self.make_request(f"{i}_{request_id}", prompt, replace(
            params, n=1, seed=None if params.seed is None else params.seed + i), priority, arrival_time)
            for i in range(params.n)]
        return ParentRequest(request_id, params, children)

    def parse_prompt(self, prompt) -> tuple[str | None, list[int], str | None]:
        """A prompt is a str, a list of token ids, or a dict with ``prompt`` or ``prompt_token_ids``."""
        cache_salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise field_error("prompt", f"unknown prompt field(s): {sorted(unknown)}")
            if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
                raise field_error("prompt", "a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
            cache_salt = prompt.get("cache_salt")
            if cache_salt is not None:
                check_text("cache_salt", cache_salt)
            if "prompt" in prompt:
                check_text("prompt", prompt["prompt"])
            elif not isinstance(prompt["prompt_token_ids"], list | tuple):
                raise field_error("prompt_token_ids", f"prompt_token_ids must be a list of ints, got "
                                                      f"{type(prompt['prompt_token_ids']).__name__}", TypeError)
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, list | tuple):
            return None, list(prompt), cache_salt
        check_text("prompt", prompt)
        if not prompt:
            raise field_error("prompt", "prompt is empty")
        return prompt, self.tokenizer.encode(prompt), cache_salt

    def check_in_vocab(self, field: str, token_ids: list[int]) -> None:
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise field_error(field, f"{field} has {len(bad)} id(s) outside the vocabulary [0, {vocab_size}): "
                                     f"{bad[:5]}")

    def check_params_fit_vocab(self, params: SamplingParams) -> None:
        """Ids the sampler indexes with must exist, or the step would fail for the whole batch."""
        for name in ("logprobs", "prompt_logprobs"):
            num_top = getattr(params, name)
            if num_top is not None:
                check_number(name, num_top, int, high=self.config.max_logprobs, why="the engine's max_logprobs")
        self.check_in_vocab("stop_token_ids", params.stop_token_ids)
        self.check_in_vocab("logit_bias", list(params.logit_bias or ()))

    def check_prompt_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise field_error("prompt_token_ids", "prompt_token_ids is empty")
        self.check_in_vocab("prompt_token_ids", token_ids)
        if len(token_ids) >= self.config.max_model_len:
            raise field_error("prompt", f"prompt is {len(token_ids)} tokens, which leaves no room to generate "
                                        f"within max_model_len={self.config.max_model_len}")
