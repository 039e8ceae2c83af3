"""The Triton attention backend against the torch oracle: on CPU under the Triton interpreter, and on CUDA.

Triton 3.9 reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function. That happens for
triton.language's own helpers (``tl.cdiv``, ``tl.max``, ...) when triton is first imported, and an
interpreted kernel cannot call compiled helpers. So the variable only works if it is set before the
first ``import triton`` of the process. Without CUDA this module sets it when it gets there first;
if triton was already imported without it (another test module got there first), or CUDA is present
and must stay compiled, the CPU cases run once in a child pytest process and each CPU test reports
its own outcome from there.
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from attention_cases import BLOCK_SIZE, NUM_KV_HEADS, make_step  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from nanoengine.attention import torch_backend, triton_backend  # noqa: E402

# Both triton.language and the backend must have been decorated in interpreter mode.
INTERPRETER_IN_PROCESS = all(isinstance(fn, InterpretedFunction)
                             for fn in (tl.standard.cdiv, triton_backend._paged_attention_kernel))

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# Requests as (cached_len, query_len): a decode, a chunk on a cached prefix, a fresh prompt, a
# decode and a prompt whose contexts end exactly on a block boundary, and a one-token prompt.
MIXED_BATCH = [(37, 1), (32, 20), (0, 23), (47, 1), (0, 32), (0, 1)]
LONG_DECODES = [(700, 1), (515, 1)]
# One request, so the tile search has nothing to search, and a chunk spanning two query tiles.
SINGLE_CHUNK = [(19, 70)]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
no_interpreted_bf16_dot = pytest.mark.skip(
    reason="the Triton 3.9 interpreter's tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584)")


def device_dtypes(cpu_bf16_marks=()):
    return [
        pytest.param("cpu", torch.float32, id="cpu-fp32"),
        pytest.param("cpu", torch.float16, id="cpu-fp16"),
        pytest.param("cpu", torch.bfloat16, id="cpu-bf16", marks=cpu_bf16_marks),
        pytest.param("cuda", torch.float32, id="cuda-fp32", marks=needs_cuda),
        pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=needs_cuda),
    ]


@pytest.fixture(scope="module")
def child_outcomes(tmp_path_factory) -> dict[str, str]:
    """Run this module's CPU cases in a fresh interpreter-mode process; test name -> outcome."""
    report = tmp_path_factory.mktemp("interpreter") / "report.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-k", "cpu", "-p", "no:cacheprovider",
                            f"--junitxml={report}"], env=env, cwd=Path(__file__).parents[1], capture_output=True,
                           text=True, check=False)
    if not report.exists():
        pytest.fail(f"the interpreter child run left no report:\n{run.stdout[-4000:]}{run.stderr[-4000:]}")
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        problems = [f"{child.tag}: {child.get('message')}" for child in case
                    if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = "; ".join(problems) or "passed"
    return outcomes


def run_on(device: str, request: pytest.FixtureRequest, check) -> None:
    """Run ``check`` here, or look up the child process's outcome for a CPU case that cannot run here."""
    if device == "cpu" and not INTERPRETER_IN_PROCESS:
        outcome = request.getfixturevalue("child_outcomes").get(request.node.name, "missing from child run")
        assert outcome == "passed", outcome
    elif device == "cuda" and INTERPRETER_IN_PROCESS:
        pytest.skip("TRITON_INTERPRET=1 is set for this process: the CUDA cases need compiled kernels")
    else:
        check()


def check_attention(device, dtype, requests, group, head_dim, num_kv_splits, seed=0, int8=False):
    """One step through the Triton backend (store this step's K/V, then attend) against the oracle in fp32; an
    int8 cache must hold the oracle's bytes and scales after both stores."""
    step = make_step(requests, group, head_dim, dtype, device, seed, cache_dtype=torch.int8 if int8 else None)
    scale = head_dim ** -0.5
    cache = [step.k_cache, step.v_cache, step.k_scale, step.v_scale]
    expected_cache = [t.clone() if int8 else t.float() for t in cache]
    torch_backend.store_kv(step.k.float(), step.v.float(), *expected_cache[:2], step.meta.slot_mapping,
                           *expected_cache[2:])
    expected = torch_backend.paged_attention(step.q.float(), *expected_cache[:2], step.meta, scale,
                                             *expected_cache[2:])

    triton_backend.store_kv(step.k, step.v, *cache[:2], step.meta.slot_mapping, *cache[2:])
    out = torch.full_like(step.q, float("nan"))  # any element the kernel fails to write stays NaN
    result = triton_backend.paged_attention(step.q, *cache[:2], step.meta, scale, *cache[2:], out=out,
                                            num_kv_splits=num_kv_splits)
    assert result is out
    if int8:
        for stored, expected_part in zip(cache, expected_cache):
            torch.testing.assert_close(stored, expected_part, atol=0, rtol=0)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def check_store_kv(device, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks = 4
    slot_mapping = torch.tensor([17, -1, 3, 60, -1, 32, 0], dtype=torch.int64, device=device)
    # A strided view, as when K and V are slices of one fused projection.
    kv = torch.randn(len(slot_mapping), NUM_KV_HEADS, 2 * head_dim, generator=gen).to(device, dtype)
    k, v = kv[..., :head_dim], kv[..., head_dim:]
    poisoned = torch.full((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype, device=device)
    k_cache, v_cache = poisoned.clone(), poisoned.clone()
    expected_k, expected_v = poisoned.clone(), poisoned.clone()

    no_scales = torch.empty(0, device=device)
    triton_backend.store_kv(k, v, k_cache, v_cache, slot_mapping, no_scales, no_scales)
    torch_backend.store_kv(k, v, expected_k, expected_v, slot_mapping, no_scales, no_scales)
    # Written slots match exactly; the slots nobody wrote are still NaN.
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device, dtype", device_dtypes(no_interpreted_bf16_dot))
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_kv_splits", [1, 3], ids=["split-off", "split-3"])
def test_mixed_batch(device, dtype, group, num_kv_splits, request):
    run_on(device, request, lambda: check_attention(device, dtype, MIXED_BATCH, group, 64, num_kv_splits, seed=group))


@pytest.mark.parametrize("device, dtype", device_dtypes(no_interpreted_bf16_dot))
@pytest.mark.parametrize("num_kv_splits", [1, None], ids=["split-off", "split-auto"])
def test_long_decodes_head_dim_128(device, dtype, num_kv_splits, request):
    run_on(device, request, lambda: check_attention(device, dtype, LONG_DECODES, 2, 128, num_kv_splits))


@pytest.mark.parametrize("device, dtype", device_dtypes(no_interpreted_bf16_dot))
@pytest.mark.parametrize("num_kv_splits", [1, 2], ids=["split-off", "split-2"])
def test_single_chunk(device, dtype, num_kv_splits, request):
    run_on(device, request, lambda: check_attention(device, dtype, SINGLE_CHUNK, 1, 128, num_kv_splits))


@pytest.mark.parametrize("device, dtype", [pytest.param("cpu", torch.float16, id="cpu-fp16"),
                                           pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=needs_cuda)])
@pytest.mark.parametrize("num_kv_splits", [1, 3], ids=["split-off", "split-3"])
def test_an_int8_cache_is_stored_as_the_oracle_stores_it_and_attended(device, dtype, num_kv_splits, request):
    run_on(device, request, lambda: check_attention(device, dtype, MIXED_BATCH, 2, 64, num_kv_splits, int8=True))


@pytest.mark.parametrize("device, dtype", device_dtypes())
@pytest.mark.parametrize("head_dim", [64, 128])
def test_store_kv_skips_padding(device, dtype, head_dim, request):
    run_on(device, request, lambda: check_store_kv(device, dtype, head_dim))


def test_auto_split_only_for_underfilled_long_decodes():
    def splits(requests):
        meta = make_step(requests, 2, 64, torch.float32, "cpu", 0).meta
        return triton_backend.choose_num_kv_splits(meta, NUM_KV_HEADS, torch.device("cpu"))

    assert splits(LONG_DECODES) > 1
    assert splits([(40, 1), (9, 1)]) == 1
    assert splits(MIXED_BATCH) == 1
    assert splits([(700, 1)] * 64) == 1
