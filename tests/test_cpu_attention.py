"""The CPU attention backend against the plain torch oracle, on fresh random steps."""

import pytest
import torch
from attention_cases import BLOCK_SIZE, make_step

from nanoengine import LLM, SamplingParams
from nanoengine.attention import torch_backend
from nanoengine.config import resolve_backend
from nanoengine.layers.attention import Attention
from nanoengine.platforms.cpu import attention as cpu_backend
from nanoengine.platforms.cpu import build, load_backend

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
CASES = {
    "mixed": [(37, 1), (32, 20), (0, 23), (47, 1), (0, 32), (0, 1)],
    # Decodes of spread lengths (partial and full last blocks, a single token) and one prompt.
    "many-decodes": [(n, 1) for n in (3, 90, 17, 200, 64, 5, 33, 129, 48, 1, 250)] + [(0, 40)],
    # Decodes with speculative drafts (2 to 8 query rows, each row a decode of its own), a short prompt chunk,
    # and a drafted decode past the kernel's limit.
    "drafts": [(37, 5), (15, 2), (60, 8), (9, 3), (31, 1), (20, 9)],
    # Prompts longer than one of prefill_attention's query tiles (at most 192 tokens) and, with their cached
    # prefix, than one of its key blocks (256): a whole one and a chunk after 280 cached tokens.
    "long-prompts": [(0, 200), (280, 200), (5, 1)],
}
NUM_DRAFTS = {"drafts": [4, 1, 7, 0, 0, 8]}  # per request of the case: how many of its query rows are drafts


def poison_unowned_slots(step) -> None:
    """NaN in every cache slot outside the requests' contexts (in an int8 cache, in its scales): a backend that
    reads one fails."""
    block_size = step.k_cache.shape[1]
    owned = torch.zeros(step.k_cache.shape[:2], dtype=torch.bool).flatten()
    for i, seq_len in enumerate(step.meta.seq_lens_cpu):
        for pos in range(seq_len):
            owned[int(step.meta.block_tables[i, pos // block_size]) * block_size + pos % block_size] = True
    for cache in (step.k_scale, step.v_scale) if step.k_cache.dtype == torch.int8 else (step.k_cache, step.v_cache):
        cache.flatten(0, 1)[~owned] = float("nan")


@pytest.fixture(scope="module")
def decode_kernel():
    kernel = build.load_cpu_kernels()
    assert kernel is not None, "the C++ decode kernel did not build: see the warning logged above"
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
# 64 and 128 are compiled for their size; 32 and 320 take the general case.
@pytest.mark.parametrize("head_dim", [64, 128, 32, 320])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_backend_matches_the_oracle(case, group, head_dim, dtype, decode_kernel):
    check_against_oracle(CASES[case], group, head_dim, dtype, decode_kernel, NUM_DRAFTS.get(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_without_a_compiler_decodes_take_sdpa_and_match_the_oracle(case, dtype):
    check_against_oracle(CASES[case], 3, 64, dtype, decode_kernel=None, num_drafts=NUM_DRAFTS.get(case))


@pytest.mark.parametrize("int8", [False, True], ids=["plain", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 24, 32])  # the kernels' runs of 16 keys must stop at each block's end
@pytest.mark.parametrize("case", ["many-decodes", "long-prompts"])
def test_other_block_sizes_match_the_oracle(case, block_size, dtype, int8, decode_kernel):
    check_against_oracle(CASES[case], 3, 64, dtype, decode_kernel, block_size=block_size, int8=int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_int8_cache_matches_the_oracle_on_the_same_bytes(case, group, head_dim, dtype, decode_kernel):
    check_against_oracle(CASES[case], group, head_dim, dtype, decode_kernel, NUM_DRAFTS.get(case), int8=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_int8_cache_without_a_compiler_is_dequantized_for_sdpa(case):
    check_against_oracle(CASES[case], 3, 64, torch.bfloat16, None, NUM_DRAFTS.get(case), int8=True)


def check_against_oracle(requests, group, head_dim, dtype, decode_kernel, num_drafts=None, block_size=BLOCK_SIZE,
                         int8=False):
    """The backend's store_kv and paged_attention against the oracle's, from the same cache; an int8 cache must
    hold the oracle's bytes and scales after both stores, and the oracle attends in float32 over it."""
    step = make_step(requests, group, head_dim, dtype, "cpu", seed=group + head_dim, block_size=block_size,
                     cache_dtype=torch.int8 if int8 else None)
    step.meta.num_drafts = num_drafts
    poison_unowned_slots(step)
    scale = 64 ** -0.5
    cache = [step.k_cache, step.v_cache, step.k_scale, step.v_scale]
    expected_cache = [t.clone() if int8 else t.float() for t in cache]
    torch_backend.store_kv(step.k.float(), step.v.float(), *expected_cache[:2], step.meta.slot_mapping,
                           *expected_cache[2:])
    expected = torch_backend.paged_attention(step.q.float(), *expected_cache[:2], step.meta, scale,
                                             *expected_cache[2:])

    backend = cpu_backend.CpuBackend(decode_kernel)
    backend.store_kv(step.k, step.v, *cache[:2], step.meta.slot_mapping, *cache[2:])
    out = backend.paged_attention(step.q, *cache[:2], step.meta, scale, *cache[2:])
    if int8:
        for stored, expected_part in zip(cache, expected_cache):
            torch.testing.assert_close(stored, expected_part, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_cpu_is_the_auto_backend_on_the_cpu_and_each_load_is_fresh():
    assert isinstance(load_backend("cpu"), cpu_backend.CpuBackend)
    assert load_backend("cpu") is not load_backend("cpu")


def test_two_engines_in_one_process_share_no_attention_backend(sharp_tiny_model):
    folder, _ = sharp_tiny_model
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llms = [LLM(folder, num_kvcache_blocks=16, max_model_len=128) for _ in range(2)]
    try:
        for llm in llms:
            llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)  # two decodes: one kernel call
        backends = [next(m for m in llm.llm_engine.model_executor.runner.model.modules()
                         if isinstance(m, Attention)).backend for llm in llms]
    finally:
        for llm in llms:
            llm.close()
    first, second = backends
    assert isinstance(first, cpu_backend.CpuBackend) and first is not second
    assert first.planned[1] is not None and second.planned[1] is not None


def test_the_decode_kernel_writes_exactly_the_decode_rows(decode_kernel):
    step = make_step(CASES["mixed"], 3, 64, torch.float32, "cpu", seed=7)
    poison_unowned_slots(step)
    no_scales = torch.empty(0)
    torch_backend.store_kv(step.k, step.v, step.k_cache, step.v_cache, step.meta.slot_mapping, no_scales, no_scales)
    backend = cpu_backend.CpuBackend(decode_kernel)
    plan = backend.decode_plan(step.meta)
    out = torch.full_like(step.q, float("nan")).contiguous()
    decode_kernel.decode_attention(step.q.contiguous(), step.k_cache, step.v_cache, no_scales, no_scales,
                                   plan.block_tables, plan.seq_lens, plan.rows, 0.125, out)
    expected = torch_backend.paged_attention(step.q, step.k_cache, step.v_cache, step.meta, 0.125, no_scales,
                                             no_scales)
    written = torch.zeros(len(out), dtype=torch.bool)
    written[plan.rows] = True
    assert plan.rows.tolist() == [0, 44, 77]  # the three requests of "mixed" with one query row
    torch.testing.assert_close(out[written], expected[written], atol=2e-5, rtol=2e-5)
    assert out[~written].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_stores_kv_as_torch_does_skipping_padding_rows(dtype, decode_kernel):
    """From strided views of a QKV projection's rows, as the models pass them, into NaN caches."""
    torch.manual_seed(5)
    num_kv_heads, head_dim, num_tokens = 2, 64, 9
    qkv = torch.randn(num_tokens, (3 + 2 * num_kv_heads) * head_dim, dtype=dtype)
    _, k, v = qkv.split([3 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    k, v = (x.view(num_tokens, num_kv_heads, head_dim) for x in (k, v))
    slots = torch.tensor([5, -1, 0, 63, 17, -1, 18, 40, 2])
    caches = [torch.full((4, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
    no_scales = torch.empty(0)
    torch_backend.store_kv(k, v, caches[0], caches[1], slots, no_scales, no_scales)
    decode_kernel.store_kv(k, v, caches[2], caches[3], slots, no_scales, no_scales)
    for expected, stored in ((caches[0], caches[2]), (caches[1], caches[3])):
        torch.testing.assert_close(stored, expected, atol=0, rtol=0, equal_nan=True)
    assert caches[2].flatten(0, 1)[slots[slots >= 0]].isfinite().all()
    with pytest.raises(RuntimeError, match="slot 64 is outside the cache"):
        decode_kernel.store_kv(k, v, caches[2], caches[3], torch.full((num_tokens,), 64), no_scales, no_scales)


def test_the_kernel_refuses_mismatched_inputs(decode_kernel):
    step = make_step(CASES["mixed"], 3, 64, torch.float32, "cpu", seed=3)
    plan = cpu_backend.CpuBackend(decode_kernel).decode_plan(step.meta)
    q, out, none = step.q.contiguous(), torch.empty_like(step.q.contiguous()), torch.empty(0)
    with pytest.raises(RuntimeError, match="share one dtype"):
        decode_kernel.decode_attention(q, step.k_cache.bfloat16(), step.v_cache.bfloat16(), none, none,
                                       plan.block_tables, plan.seq_lens, plan.rows, 0.125, out)
    with pytest.raises(RuntimeError, match="int32 block tables"):
        decode_kernel.decode_attention(q, step.k_cache, step.v_cache, none, none, plan.block_tables.long(),
                                       plan.seq_lens, plan.rows, 0.125, out)
    with pytest.raises(RuntimeError, match="an int8 cache takes float32 scales"):
        decode_kernel.decode_attention(q, step.k_cache.to(torch.int8), step.v_cache.to(torch.int8), none, none,
                                       plan.block_tables, plan.seq_lens, plan.rows, 0.125, out)


def test_the_cpu_backend_is_refused_on_cuda():
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend("cpu", "cuda")
