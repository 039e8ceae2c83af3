"""Decode CUDA graphs: the batch-size ladder and the padded input buffers (on the CPU), and graphs
against eager execution token for token (on CUDA)."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from benchmarks.common import byte_level_tokenizer
from nanoengine import LLM, SamplingParams
from nanoengine.engine.cuda_graphs import DecodeBuffers, graph_batch_sizes, padded_batch_size
from nanoengine.engine.model_runner import StepInputs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_ladder_covers_every_batch_up_to_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [240, 256] and len(sizes) == 20
    for n in range(1, 257):
        size = padded_batch_size(n, sizes)
        assert size >= n and (size == 1 or sizes[sizes.index(size) - 1] < n)
    assert padded_batch_size(257, sizes) is None


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    """A tiny random Qwen3 with a tokenizer built in place (no download, so it also runs on a bare GPU box)."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-graphs")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         initializer_range=0.5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return str(folder)


def prefill_then_decode_step(runner, context_lens: list[int]) -> StepInputs:
    """Write each request's context into the cache (request i owns blocks 4i..4i+3), and return the
    decode step that follows."""
    rng = random.Random(0)
    contexts = [[rng.randrange(512) for _ in range(n)] for n in context_lens]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(contexts))]
    ids = [str(i) for i in range(len(contexts))]
    runner.forward(StepInputs(ids, contexts, [0] * len(contexts), tables, [True] * len(contexts),
                              [(0, 0)] * len(contexts), [0] * len(contexts)))
    return StepInputs(ids, [[rng.randrange(512)] for _ in contexts], context_lens, tables, [True] * len(contexts),
                      [(0, 0)] * len(contexts), [0] * len(contexts))


@torch.inference_mode()
def test_padded_buffers_give_the_same_hidden_states_and_store_no_padding(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", max_model_len=64, num_kvcache_blocks=32) as llm:
        runner = llm.llm_engine.model_executor.runner
        step = prefill_then_decode_step(runner, [5, 17, 33])
        input_ids, positions, meta, _ = runner.prepare_inputs(step)
        eager = runner.model(input_ids, positions, meta)
        kv_after_eager = runner.kv_cache.clone()

        buffers = DecodeBuffers.allocate(8, 4, runner.device)
        stale = prefill_then_decode_step(runner, [9, 2, 40, 11, 3, 7, 20])  # a larger batch leaves stale rows
        buffers.load(*runner.prepare_inputs(stale)[:3], batch_size=8)
        runner.kv_cache.copy_(kv_after_eager)
        buffers.load(input_ids, positions, meta, batch_size=8)
        assert buffers.slot_mapping[3:].tolist() == [-1] * 5 and buffers.seq_lens[3:].tolist() == [1] * 5
        padded = runner.model(*buffers.inputs(8, max_seq_len=64))
        torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
        slots = runner.kv_cache.flatten(2, 3)  # [k/v, layer, slot, kv_head, head_dim]
        expected = kv_after_eager.flatten(2, 3)
        real = torch.zeros(slots.shape[2], dtype=torch.bool)
        real[meta.slot_mapping] = True
        torch.testing.assert_close(slots[:, :, real], expected[:, :, real], rtol=1e-5, atol=1e-5)
        # Anywhere else the cache is untouched (bit for bit; the CPU cache starts uninitialized, NaNs included).
        torch.testing.assert_close(slots[:, :, ~real], expected[:, :, ~real], rtol=0, atol=0, equal_nan=True)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_match_eager_token_for_token(tiny_qwen3, dtype):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 60))] for _ in range(37)]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(1, 40)) for _ in prompts]
    outputs = {}
    for eager in (True, False):
        with LLM(tiny_qwen3, dtype=dtype, max_model_len=256, max_num_seqs=40, enforce_eager=eager) as llm:
            graphs = llm.llm_engine.model_executor.runner.fast_path
            assert (graphs is None) == eager
            replays = count_replays(graphs) if graphs else None
            outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert eager or replays["n"] > 0
    if dtype == "float32":
        assert outputs[False] == outputs[True]
    else:  # a padded batch may pick another bf16 matmul kernel; a near-tie can then flip a later token
        assert [t[:8] for t in outputs[False]] == [t[:8] for t in outputs[True]]


def count_replays(graphs) -> dict:
    replays = {"n": 0}
    run = graphs.run

    def counting_run(*args):
        replays["n"] += 1
        return run(*args)

    graphs.run = counting_run
    return replays
