"""prompt_logprobs against transformers' logits: whole prompts, chunked prefill, a prefix the cache holds,
delta outputs, and a request batched with others that do not ask."""

import random

import pytest
import torch

from nanoengine import LLM, RequestOutputKind, SamplingParams
from nanoengine.engine.model_runner import prompt_rows
from nanoengine.engine.request import Request

rng = random.Random(1)
PROMPT = [rng.randrange(100, 40000) for _ in range(45)]
OTHER = [rng.randrange(100, 40000) for _ in range(30)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def asking(num_top: int, max_tokens: int = 3, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=num_top, **kwargs)


def check_against_transformers(hf_model, prompt: list[int], prompt_logprobs, num_top: int) -> None:
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(dim=-1)
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for row, token_id, entry in zip(reference, prompt[1:], prompt_logprobs[1:]):
        assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=1e-4)
        assert entry[token_id].rank in ranks_within_a_near_tie(row, row[token_id].item())
        top_values, top_ids = row.topk(num_top)
        assert set(entry) == set(top_ids.tolist()) | {token_id}
        for rank, (value, tid) in enumerate(zip(top_values.tolist(), top_ids.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)
            assert entry[tid].rank == rank


def ranks_within_a_near_tie(row: torch.Tensor, logprob: float, tie: float = 1e-5) -> range:
    """The rank transformers gives, or any other that a token of ``row`` closer than ``tie`` to ``logprob`` can
    cause: float32 sums taken in another order (the C++ RMSNorm) move logprobs by about 1e-6, and deep in the
    tail, among 49,152 tokens, one can sit that close to another."""
    return range(int((row > logprob + tie).sum()) + 1, int((row >= logprob - tie).sum()) + 1)


@pytest.fixture(scope="module")
def llm(sharp_tiny_model):
    with LLM(sharp_tiny_model[0], max_model_len=128, num_kvcache_blocks=64) as llm:
        yield llm


def test_prompt_logprobs_match_transformers_alongside_requests_that_do_not_ask(llm, sharp_tiny_model):
    hf_model = sharp_tiny_model[1]
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([OTHER, PROMPT, OTHER[:20]], [plain, asking(3), asking(0)], use_tqdm=False)
    assert outs[0].prompt_logprobs is None
    check_against_transformers(hf_model, PROMPT, outs[1].prompt_logprobs, 3)
    check_against_transformers(hf_model, OTHER[:20], outs[2].prompt_logprobs, 0)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in llm.generate(
        [OTHER, PROMPT, OTHER[:20]], plain, use_tqdm=False)]


def test_chunked_prefill_joins_the_chunks(sharp_tiny_model):
    with LLM(sharp_tiny_model[0], max_model_len=128, num_kvcache_blocks=64, long_prefill_token_threshold=7) as llm:
        [out] = llm.generate([PROMPT], asking(2), use_tqdm=False)
    check_against_transformers(sharp_tiny_model[1], PROMPT, out.prompt_logprobs, 2)


def test_a_request_asking_for_prompt_logprobs_reads_no_prefix_cache(llm, sharp_tiny_model):
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)  # PROMPT's blocks are now cached
    [out] = llm.generate([PROMPT], asking(1), use_tqdm=False)
    assert out.num_cached_tokens == 0
    check_against_transformers(sharp_tiny_model[1], PROMPT, out.prompt_logprobs, 1)
    [again] = llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    assert again.num_cached_tokens == 32  # it still filled the cache for others


def test_delta_outputs_carry_the_prompt_logprobs_once(llm):
    engine = llm.llm_engine
    engine.add_request("delta", PROMPT, asking(1, output_kind=RequestOutputKind.DELTA))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[0].prompt_logprobs) == len(PROMPT)
    assert [o.prompt_logprobs for o in outputs[1:]] == [[], []]


def test_rows_recorded_before_a_preemption_are_not_computed_again():
    request = Request("r", None, PROMPT, asking(1), arrival_time=0.0)
    assert prompt_rows(request, 0, 16) == (0, 16)
    assert prompt_rows(request, 32, 16) == (32, len(PROMPT) - 1 - 32)  # the last prompt row samples instead
    request.prompt_logprobs += [{}] * 20  # positions 1..20 are recorded; recomputing from 0 starts at row 20
    assert prompt_rows(request, 0, 16) == (20, 0)
    assert prompt_rows(request, 16, 16) == (20, 12)


def test_more_prompt_logprobs_than_the_vocabulary_raise_before_queueing(llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([PROMPT], SamplingParams(prompt_logprobs=10**6), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_tokens_zero_computes_the_prompt_and_samples_nothing(llm, sharp_tiny_model):
    """lm-eval's loglikelihood requests: the prompt's logprobs are the whole output (here batched with a
    request that samples)."""
    engine = llm.llm_engine
    sampled_rows = []
    sample = engine.model_executor.runner.sample
    engine.model_executor.runner.sample = lambda logits, *args: sampled_rows.append(len(logits)) or sample(
        logits, *args)
    try:
        outs = llm.generate([PROMPT, OTHER], [asking(2, max_tokens=0), asking(0)], use_tqdm=False)
    finally:
        del engine.model_executor.runner.sample
    scored, other = outs
    assert (scored.outputs[0].token_ids, scored.outputs[0].text, scored.outputs[0].finish_reason) == ([], "", "length")
    assert scored.finished and scored.metrics.first_token_time is None
    check_against_transformers(sharp_tiny_model[1], PROMPT, scored.prompt_logprobs, 2)
    assert len(other.outputs[0].token_ids) == 3 and sum(sampled_rows) == 3  # only the other request sampled
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
