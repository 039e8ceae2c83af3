"""The perplexity tool (benchmarks/quality.py) against plain transformers on the same windows and tokens."""

import math

import pytest
import torch
from transformers import AutoTokenizer

from benchmarks.quality import TEXT, engine_perplexity, greedy_agreement, window_starts, windows

N_CTX = 64

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def transformers_perplexity(hf_model, tokens: list[int], n_ctx: int) -> tuple[float, int]:
    """llama-perplexity's rule, written out plainly: whole windows of n_ctx tokens, each run alone, scoring the
    tokens at positions n_ctx // 2 + 1 .. n_ctx - 1 of each."""
    nlls = []
    for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
        window = tokens[start:start + n_ctx]
        with torch.no_grad():
            logprobs = hf_model(torch.tensor([window])).logits[0].float().log_softmax(dim=-1)
        nlls += [-logprobs[pos - 1, window[pos]].item() for pos in range(n_ctx // 2 + 1, n_ctx)]
    return math.exp(sum(nlls) / len(nlls)), len(nlls)


def test_perplexity_matches_transformers_on_the_same_windows(sharp_tiny_model, tmp_path):
    folder, hf_model = sharp_tiny_model
    text = tmp_path / "text.txt"
    text.write_text(TEXT.read_text()[:1500])  # about 400 tokens: 6 windows of 64, and a partial one dropped
    tokens = AutoTokenizer.from_pretrained(folder)(text.read_text(), add_special_tokens=False).input_ids
    assert len(tokens) % N_CTX, "the text should end in a partial window, which both must drop"
    expected, scored = transformers_perplexity(hf_model, tokens, N_CTX)
    ours = engine_perplexity(folder, "float32", N_CTX, text, num_kvcache_blocks=64)
    assert (ours["text_tokens"], ours["scored_tokens"]) == (len(tokens), scored)
    assert ours["perplexity"] == pytest.approx(expected, rel=1e-5)


def test_windows_follow_llama_perplexity():
    assert list(window_starts(200, 64)) == [0, 64, 128]
    with pytest.raises(ValueError, match="n_ctx=64 needs at least 128 tokens"):
        window_starts(127, 64)
    assert windows(list(range(10, 30)), 8, bos=1) == [[1, *range(11, 18)], [1, *range(19, 26)]]


def test_the_fixture_is_4k_to_8k_tokens(smollm2_dir):
    tokens = AutoTokenizer.from_pretrained(smollm2_dir)(TEXT.read_text(), add_special_tokens=False).input_ids
    assert 4000 <= len(tokens) <= 8000


def test_greedy_agreement_counts_identical_answers_and_the_share_before_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    assert greedy_agreement(reference, other) == (1, (1 + 0.5 + 0) / 3)
