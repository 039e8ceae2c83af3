"""The one table of request fields this server does not honour: each with the values that leave it off
and why. A request that sets one to anything else is refused with a 400 naming it (protocol.py); a key in
no table and in no body is logged once and ignored, as vLLM does.
"""

# name -> (the values that leave it off, why): every route's, then each route's own.
NOT_IMPLEMENTED = {
    "use_beam_search": ((False,), "beam search is not implemented"),
    "length_penalty": ((1,), "length_penalty applies to beam search, which is not implemented"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not implemented (structured_outputs or logit_bias can "
                                   "restrict the tokens)"),
    "bad_words": ((None, []), "bad_words is not implemented"),
    "truncate_prompt_tokens": ((None,), "prompt truncation is not implemented"),
    "truncation_side": ((None,), "prompt truncation is not implemented"),
    "prompt_embeds": ((None,), "prompt embeddings are not implemented"),
    "logprob_token_ids": ((None,), "logprob_token_ids is not implemented (use logprobs)"),
    "spaces_between_special_tokens": ((True,), "special tokens are always decoded without added spaces"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not implemented"),
    "return_token_ids": ((None, False), "return_token_ids is not implemented (/tokenize gives the prompt's ids)"),
    "request_id": ((None,), "the server names each request itself"),
    "kv_transfer_params": ((None,), "disaggregated serving is not implemented"),
    "ec_transfer_params": ((None,), "disaggregated serving is not implemented"),
    "vllm_xargs": ((None,), "custom extension arguments are not implemented"),
    "repetition_detection": ((None,), "repetition_detection is not implemented"),
    "thinking_token_budget": ((None, -1), "thinking_token_budget is not implemented"),
    "watermarking": ((None, False), "watermarking is not implemented"),
    "stream_interval": ((None, 1), "every step's tokens are streamed as they come (stream_interval=1)"),
    "routed_experts_prompt_start": ((0,), "expert routing data is not returned"),
    "return_token_offsets": ((None, False), "token offsets are not returned"),
}
CHAT_NOT_IMPLEMENTED = {
    "echo": ((None, False), "echo is served on /v1/completions only"),
    "add_special_tokens": ((None, False), "the chat template adds the special tokens"),
    "chat_template": ((None,), "the server uses the model's chat template (as vLLM does unless started with "
                               "--trust-request-chat-template; LLM.chat takes another)"),
    "mm_processor_kwargs": ((None,), "the served models take text only"),
    "media_io_kwargs": ((None,), "the served models take text only"),
    "audio": ((None,), "the served models give text only"),
    "modalities": ((None, ["text"]), "the served models give text only"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "functions": ((None,), "functions is deprecated by OpenAI: use tools"),
    "function_call": ((None,), "function_call is deprecated by OpenAI: use tool_choice"),
    "web_search_options": ((None,), "web search is not implemented"),
    "reasoning_effort": ((None,), "reasoning_effort is not implemented"),
    "verbosity": ((None,), "verbosity is not implemented"),
    "prompt_logprobs": ((None,), "prompt_logprobs is served on /v1/completions"),
    "store": ((None, False), "completions are not stored"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
}
COMPLETIONS_NOT_IMPLEMENTED = {
    "suffix": ((None,), "suffix is not currently supported"),  # vLLM's words
    "add_special_tokens": ((None, True), "a text prompt is always encoded with the tokenizer's special tokens "
                                         "(send token ids for another encoding)"),
}
NOT_STORED = "not supported by this server (responses are not stored, and there are no hosted tools or reasoning " \
             "settings)"
RESPONSES_NOT_IMPLEMENTED = {
    "store": ((None, False), "this server stores no responses; send store=false"),
    **{name: ((None, False, []), NOT_STORED) for name in ("previous_response_id", "conversation", "prompt",
                                                          "background", "include", "reasoning", "top_logprobs",
                                                          "max_tool_calls")},
}
