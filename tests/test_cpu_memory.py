"""The CPU path keeps freed activation memory: large temporaries reuse pages instead of faulting in new ones."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

# Allocate and free a 256 MB tensor three times to reach a steady state (the heap's first growth may land
# elsewhere), then six more times; print the page faults of those last six.
SCRIPT = """
import resource, sys, torch
from nanoengine.utils.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
for _ in range(3):
    torch.ones(1 << 26)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    torch.ones(1 << 26)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
TENSOR_PAGES = (1 << 28) // 4096
PAGES = 6 * TENSOR_PAGES


def steady_state_faults(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).parents[1])
    return int(result.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="only glibc's allocator can be asked")
def test_large_tensors_reuse_freed_pages():
    assert steady_state_faults("default") > PAGES // 2  # glibc maps fresh pages each time: a fault per page
    # Kept memory is not always reused at once. In some processes the first of the measured tensors still
    # faults (all three processes of one CI run). In about one process in six, every tensor faults: each new
    # block lands 256 MB + 128 bytes above the last one, as if a small allocation after each block kept the
    # freed block below from joining the heap's top. So the setting is judged on the best of five processes,
    # and it must spare at least four of the six tensors their faults.
    assert min(steady_state_faults("keep") for _ in range(5)) <= 2 * TENSOR_PAGES


def test_a_cpu_engine_runs_a_full_step_at_start_and_writes_no_cache(folder, monkeypatch):
    """A step of the full token budget runs once at start, through one decoder layer (whose temporaries the
    others reuse), so that its memory faults into the heap then and not in the first request's step. It writes
    nothing to the cache, and every layer is back in the model afterwards."""
    from nanoengine import LLM
    from nanoengine.engine.model_runner import ModelRunner

    sizes = []
    run_dummy_step = ModelRunner.run_dummy_step
    monkeypatch.setattr(ModelRunner, "run_dummy_step",
                        lambda runner, num_tokens, num_layers=None: sizes.append((num_tokens, num_layers))
                        or run_dummy_step(runner, num_tokens, num_layers))
    with LLM(folder, max_model_len=128, num_kvcache_blocks=16, max_num_batched_tokens=300) as llm:
        runner = llm.llm_engine.model_executor.runner
        assert sizes == [(300, 1)]
        assert runner.kv_cache.count_nonzero() == 0
        assert len(runner.model.model.layers) == runner.config.hf_config.num_hidden_layers > 1
