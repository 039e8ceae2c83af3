"""Token ids to text, a few tokens at a time, without ever splitting a multi-byte character."""

from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 6  # prompt tokens decoded alongside, so the first output token gets its leading space right


class IncrementalDetokenizer:
    """Decodes only a short window per call: the text of ``ids[prefix:]`` minus that of ``ids[prefix:read]``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Take one more token; return the text it completes (empty while a character is still partial)."""
        self.token_ids.append(token_id)
        before = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        after = self.decode(self.token_ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new_text = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += new_text
        return new_text
