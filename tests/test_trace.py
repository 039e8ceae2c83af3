"""The step trace says what the scheduler decided each step; the step history draws as a PNG."""

import logging

import pytest

from nanoengine import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHARED = list(range(100, 132))  # two full blocks


def trace_blocks(caplog) -> list[list[str]]:
    return [r.getMessage().splitlines() for r in caplog.records if r.name == "nanoengine.trace"]


@pytest.fixture(scope="module")
def folder(sharp_tiny_model):
    return sharp_tiny_model[0]


def test_trace_shows_chunks_decodes_cache_hits_and_preemptions(folder, caplog, one_torch_thread):
    caplog.set_level(logging.INFO, logger="nanoengine.trace")
    # 6 blocks of 16 tokens; a 40-token budget chunks the third prompt beside two decodes.
    with LLM(folder, trace=True, num_kvcache_blocks=6, max_num_batched_tokens=40, max_model_len=96) as llm:
        llm.generate([SHARED + [1, 2], SHARED + [3], list(range(200, 240))], PARAMS, use_tqdm=False)
        num_preemptions = llm.stats().num_preemptions
    steps = trace_blocks(caplog)
    assert [s[0].split(":")[0] for s in steps] == [f"step {i}" for i in range(1, len(steps) + 1)]
    assert steps[0][0] == "step 1: 3 scheduled, 40 tokens | free blocks 1 (0 cached) | running [0, 1, 2] | waiting []"
    assert steps[0][1] == "  prefill 0  0+34/34  new blocks [0, 1, 2]"
    # The second prompt takes the first's two blocks, named in this very step, and computes one token;
    # the third gets what is left of the 40-token budget: a 5-token chunk.
    assert steps[0][2].startswith("  prefill 1  32+1/33  new blocks [3]  cache hit 2 block(s) (32 tokens): 0#")
    assert steps[0][3] == "  prefill 2  0+5/40  new blocks [4]"
    # Its next chunk needs two more blocks and one is free: FCFS preempts the newest request, itself.
    assert steps[1] == ["step 2: 2 scheduled, 2 tokens | free blocks 2 (0 cached) | running [0, 1] | waiting [2]",
                        "  decode  0  34+1/35", "  decode  1  33+1/34", "  preempted 2"]
    preemptions = [line for s in steps for line in s if line.startswith("  preempted")]
    assert num_preemptions == len(preemptions) == 1
    # Once the first two finish it is admitted again and recomputes its whole prompt in one step.
    assert any(line.startswith("  prefill 2  0+40/40  new blocks [") for s in steps for line in s)


def test_no_trace_by_default(folder, caplog):
    caplog.set_level(logging.INFO, logger="nanoengine.trace")
    with LLM(folder, num_kvcache_blocks=8, max_model_len=128) as llm:
        llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)
        assert llm.llm_engine.trace is None
    assert trace_blocks(caplog) == []


def test_trace_must_be_a_bool(folder):
    with pytest.raises(TypeError, match="trace"):
        LLM(folder, trace="yes")


def test_step_history_plots_as_a_png(folder, tmp_path):
    pytest.importorskip("matplotlib")
    with LLM(folder, num_kvcache_blocks=8, max_model_len=128) as llm:
        llm.generate([[1, 2, 3], [4, 5]], PARAMS, use_tqdm=False)
        stats = llm.stats()
    path = tmp_path / "steps.png"
    stats.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(stats.step_history) == 12
