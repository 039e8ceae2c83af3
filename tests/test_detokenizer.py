"""Incremental detokenization with SmolLM2's byte-level BPE, whose tokens often hold part of a character."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from nanoengine.engine.detokenizer import IncrementalDetokenizer

MULTI_BYTE_TEXTS = [
    "Hello 😀 world! 你好，世界。 🎉🎉 naïve café — Ünïcödé",
    "日本語のテキスト🙂👍🏽 and 한국어 text",
    "👨‍👩‍👧‍👦 family, 🇫🇷 flag, e\u0301 combining",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool = True):
    """Feed the output one token at a time; return the pieces of text each token completed."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detokenizer.add(token_id) for token_id in output_ids]
    assert detokenizer.text == "".join(pieces)
    return pieces


def splits_characters(tokenizer, ids: list[int]) -> bool:
    return any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_streamed_pieces_are_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    assert splits_characters(tokenizer, ids)  # the test means something only if tokens split characters
    pieces = stream(tokenizer, tokenizer.encode("Say:"), ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # some token only started a character, and nothing was emitted for it


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet="ab ,.\n語本日你好😀🎉👍🏽éü한국", min_size=1, max_size=40),
       prompt=st.text(alphabet="xy 界🙂", min_size=1, max_size=8))
def test_any_text_streams_back_exactly(tokenizer, text, prompt):
    pieces = stream(tokenizer, tokenizer.encode(prompt), tokenizer.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_first_piece_keeps_its_leading_space(tokenizer):
    assert stream(tokenizer, tokenizer.encode("Hello"), tokenizer.encode(" world"))[0] == " world"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    assert "".join(stream(tokenizer, [1], ids)) == "Hi there"
    assert "".join(stream(tokenizer, [1], ids, skip_special_tokens=False)) == f"Hi{tokenizer.eos_token} there"


def test_partial_character_at_the_end_is_held_back(tokenizer):
    ids = tokenizer.encode("ok 😀")
    first_byte_tokens = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    assert "".join(stream(tokenizer, [1], ids[:first_byte_tokens])) == "ok"
