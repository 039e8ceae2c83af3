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
from nanoengine.platforms.cpu.memory import keep_freed_memory
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
    from nanoengine.models.llama import DecoderLayer

    sizes = []  # the rows of each decoder layer's call while the engine starts
    layer_forward = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward", lambda layer, rotation, hidden, *args: sizes.append(hidden.shape[0])
                        or layer_forward(layer, rotation, hidden, *args))
    with LLM(folder, max_model_len=128, num_kvcache_blocks=16, max_num_batched_tokens=300) as llm:
        runner = llm.llm_engine.model_executor.runner
        assert sizes == [300]
        assert runner.kv_cache.count_nonzero() == 0
        assert len(runner.model.model.layers) == runner.config.hf_config.num_hidden_layers > 1
