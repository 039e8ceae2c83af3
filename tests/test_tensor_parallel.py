"""Tensor parallelism over gloo on the CPU: two processes give the same tokens as one."""

import gc
import itertools
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from conftest import build_tiny_model
from transformers import LlamaConfig

from nanoengine import LLM, SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.engine.model_runner import StepInputs
from nanoengine.engine.worker import StepDecoder, StepEncoder

# Top logprobs too: the tiny Qwen3 (tied random embeddings) repeats one token, so its tokens alone prove little.
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
SHARED_PREFIX = list(range(1000, 1040))  # 2.5 blocks
PROMPTS = [SHARED_PREFIX + list(range(2000 + 10 * i, 2003 + 11 * i)) for i in range(4)]
# Chunked prefill (32-token steps), a prefix cache, and so few blocks that requests get preempted.
SMALL_ENGINE = dict(max_num_batched_tokens=32, num_kvcache_blocks=8, max_model_len=128, dtype="float32")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smollm2_dir) -> dict[str, str]:
    dirs = {}
    for arch in ("qwen3", "llama"):
        dirs[arch] = str(tmp_path_factory.mktemp(f"tp-{arch}"))
        build_tiny_model(arch, dirs[arch], smollm2_dir)
    return dirs


def generate_twice(llm: LLM) -> tuple[list[list[int]], list[float]]:
    """Tokens and top logprobs of the same prompts run twice: the second run finds them in the prefix cache."""
    runs = []
    for _ in range(2):
        completions = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        logprobs = [lp.logprob for c in completions for entry in c.logprobs for lp in entry.values()]
        runs.append(([c.token_ids for c in completions], logprobs))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == pytest.approx(runs[1][1], abs=1e-4)
    return runs[0]


def workers_of(llm: LLM) -> list:
    return list(llm.llm_engine.model_executor.workers.health.processes.values())


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_two_ranks_give_the_same_tokens_as_one(tiny_dirs, arch):
    with LLM(tiny_dirs[arch], **SMALL_ENGINE) as llm:
        expected_tokens, expected_logprobs = generate_twice(llm)
    with LLM(tiny_dirs[arch], tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        tokens, logprobs = generate_twice(llm)
        assert tokens == expected_tokens
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
        stats = llm.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        workers = workers_of(llm)
    assert [p.exitcode for p in workers] == [0]  # asked to stop, not killed
    assert not dist.is_initialized()


def test_two_ranks_with_an_int8_cache_give_the_same_tokens_as_one(tiny_dirs):
    """Each rank holds its KV heads' int8 cache and scales."""
    with LLM(tiny_dirs["llama"], kv_cache_dtype="int8", **SMALL_ENGINE) as llm:
        expected_tokens, expected_logprobs = generate_twice(llm)
    with LLM(tiny_dirs["llama"], tensor_parallel_size=2, kv_cache_dtype="int8", **SMALL_ENGINE) as llm:
        tokens, logprobs = generate_twice(llm)
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_collected_engine_stops_its_workers_and_a_new_one_starts(tiny_dirs):
    llm = LLM(tiny_dirs["qwen3"], tensor_parallel_size=2, **SMALL_ENGINE)
    workers = workers_of(llm)
    with pytest.raises(RuntimeError, match="close it before creating another LLM"):
        LLM(tiny_dirs["qwen3"], **SMALL_ENGINE)  # its layers would shard themselves over the open group
    del llm
    gc.collect()
    assert [p.exitcode for p in workers] == [0]
    with LLM(tiny_dirs["qwen3"], tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 20


def test_killed_worker_raises_instead_of_hanging(tiny_dirs, monkeypatch):
    with LLM(tiny_dirs["llama"], tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        worker, engine = workers_of(llm)[0], llm.llm_engine
        step, steps_run = engine.step, itertools.count()

        def step_killing_the_worker_before_the_third():
            if next(steps_run) == 2:
                os.kill(worker.pid, signal.SIGKILL)  # not waited for: the step may meet it dying mid-collective
            return step()

        monkeypatch.setattr(engine, "step", step_killing_the_worker_before_the_third)
        error = raised_within(lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False), timeout_s=60)
        assert isinstance(error, RuntimeError) and "rank 1" in str(error)
        with pytest.raises(RuntimeError, match="broken"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert not dist.is_initialized()


def raised_within(body, timeout_s: float) -> BaseException | None:
    """What ``body`` raised, run in a thread so that a hang fails the test instead of blocking it."""
    errors = []

    def target():
        try:
            body()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still running after {timeout_s} s: it hangs"
    return errors[0] if errors else None


EXIT_WITHOUT_CLOSE = """
import sys
from nanoengine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kvcache_blocks=8)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
print(llm.llm_engine.model_executor.workers.health.processes[1].pid, flush=True)
"""


def test_workers_exit_with_the_calling_process(tiny_dirs):
    done = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, tiny_dirs["qwen3"]], capture_output=True,
                          text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    worker_pid = int(done.stdout.split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)


@pytest.mark.parametrize(("overrides", "size", "field"), [
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, 4, "num_attention_heads"),
    ({}, 4, "num_key_value_heads"),
    ({"intermediate_size": 129}, 2, "intermediate_size"),
    ({"vocab_size": 49153}, 2, "vocab_size"),
])
def test_sizes_that_do_not_divide_fail_before_any_process_starts(tmp_path, overrides, size, field):
    options = dict(vocab_size=49152, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    LlamaConfig(**(options | overrides)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{field} .* not divisible by tensor_parallel_size \\({size}\\)"):
        LLM(str(tmp_path), tensor_parallel_size=size)
    assert not torch.multiprocessing.active_children()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(str(tmp_path), tensor_parallel_size=0)


def step(*rows) -> StepInputs:
    """rows of (request id, block table): one token each, starting at 0."""
    return StepInputs([r for r, _ in rows], [[7] for _ in rows], [0] * len(rows), [list(b) for _, b in rows],
                      [True] * len(rows), [(0, 0)] * len(rows), [0] * len(rows))


def test_step_messages_carry_only_changes_and_rebuild_the_tables():
    encoder, decoder = StepEncoder(), StepDecoder()
    steps = [
        step(("a", [1, 2]), ("b", [3])),
        step(("a", [1, 2]), ("b", [3, 4])),  # b grows by one block
        step(("a", [5]), ("b", [3, 4])),  # a was preempted and got a new table
        step(("b", [3, 4, 6])),  # a finished before this step
        step(("a", [7])),  # the id comes back for a new request
    ]
    messages = []
    for i, inputs in enumerate(steps):
        if i == 3:
            encoder.finish_request("a")
        message = encoder.encode(inputs)
        messages.append(message)
        assert decoder.decode(message) == inputs
    assert [d.new_block_ids for d in messages[1].requests] == [[], [4]]
    assert [(d.num_kept_blocks, d.new_block_ids) for d in messages[2].requests] == [(0, [5]), (2, [])]
    assert messages[3].finished_ids == ["a"]
    assert (messages[4].requests[0].num_kept_blocks, messages[4].requests[0].new_block_ids) == (0, [7])
    assert decoder.tables == {"b": [3, 4, 6], "a": [7]}
