"""The structured output manager: the engine core's third part, beside the scheduler and the model runner.

A structured request's output must match a grammar (a JSON schema, a regex, a
list of choices, an EBNF grammar, or any JSON object). The grammar engine is
xgrammar, vLLM's default backend. The manager

- compiles a request's grammar while the request is validated, so a bad one
  raises before anything is queued (an equal grammar compiles once: the
  compiler caches it);
- gives each structured request its own matcher, which tracks where in the
  grammar the output is;
- before sampling, fills one row of a token bitmask per structured request
  that samples in this step: bit j is 1 when token j may come next. The model
  runner applies it to the logits before temperature and top-k/p, so every
  sampled token keeps the output inside the grammar;
- after sampling, lets each matcher accept its token.

With speculative decoding, drafts are cut at the first token the grammar
rejects (``grammar_prefix``), and a drafted request's rows are masked as its
matcher accepts the drafts one by one, then rolls them back.

Once the grammar is complete, the matcher allows only the request's stop
tokens, and the request ends with ``finish_reason="stop"``.
"""

import json
import re
from dataclasses import dataclass

import torch
import xgrammar as xgr

from nanoengine.sampling_params import StructuredOutputsParams, field_error


@dataclass
class GrammarBitmask:
    """One step's mask: ``bitmask[row]`` applies to the logits row ``row`` for each row in ``rows``."""

    bitmask: torch.Tensor  # [sampling rows, ceil(vocab / 32)] int32, on the CPU
    rows: list[int]


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        # The logits' width, not len(tokenizer): a model may pad its vocabulary, and padded ids must be masked too.
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(eos_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2)
        self.eos_token_ids = eos_token_ids

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else {"type": "object"}
                return self.compiler.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                # A JSON string literal is also a valid EBNF string literal, escapes included.
                return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return self.compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            raise field_error("structured_outputs", f"structured_outputs.{kind} could not be compiled: "
                                                    f"{without_source_location(error)}") from None

    def new_matcher(self, params: StructuredOutputsParams, stop_token_ids: set[int]) -> xgr.GrammarMatcher:
        """A matcher that ends the output with one of the request's stop tokens (EOS when it has none)."""
        return xgr.GrammarMatcher(self.compile(params),
                                  override_stop_tokens=sorted(stop_token_ids or self.eos_token_ids))

    def bitmask_for(self, matchers: list[xgr.GrammarMatcher | None], drafts: list[list[int]]) -> GrammarBitmask | None:
        """The mask for one step's sampling rows: per sampling request (a matcher or None, and its drafts) one
        row, plus one per draft, filled as the matcher accepts each draft in turn (then rolls them back).
        None when no request is structured."""
        if all(matcher is None for matcher in matchers):
            return None
        bitmask = xgr.allocate_token_bitmask(sum(1 + len(d) for d in drafts), self.vocab_size)
        rows, row = [], 0
        for matcher, draft_ids in zip(matchers, drafts):
            if matcher is not None:
                for j in range(len(draft_ids) + 1):
                    matcher.fill_next_token_bitmask(bitmask, row + j)
                    rows.append(row + j)
                    if j < len(draft_ids):
                        matcher.accept_token(draft_ids[j])
                matcher.rollback(len(draft_ids))
            row += 1 + len(draft_ids)
        return GrammarBitmask(bitmask, rows)


def grammar_prefix(matcher: xgr.GrammarMatcher, draft_ids: list[int]) -> list[int]:
    """The drafts up to the first one that the grammar rejects or that would end it (its stop token is
    then sampled in a row of its own); the matcher is left as it was."""
    num_accepted = 0
    while num_accepted < len(draft_ids) and not matcher.is_terminated() and matcher.accept_token(
            draft_ids[num_accepted]):
        num_accepted += 1
    num_kept = num_accepted - matcher.is_terminated()
    matcher.rollback(num_accepted)
    return draft_ids[:num_kept]


def without_source_location(error: Exception) -> str:
    """xgrammar's C++ errors start with a time stamp, a source file and the failed check."""
    return re.sub(r"^\[[\d:]+\] \S+: (Check failed: .*? is false: )?", "", str(error)).strip()


def apply_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> None:
    """Set to -inf, in place, every logit that the grammar rules out (xgrammar's CPU kernel or its Triton one)."""
    bitmask = mask.bitmask if logits.device.type == "cpu" else mask.bitmask.pin_memory().to(logits.device,
                                                                                          non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=mask.rows)
