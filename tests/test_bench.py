"""bench.py's helpers and presets, on a tiny model (a smoke test: no timing is checked)."""

import json
import random

import pytest
from conftest import build_tiny_model

import bench
from bench import Hardware, ModelShape, Workload


def test_requests_follow_nano_vllm_recipe():
    workload = Workload(5, (3, 9), (2, 7), 0.6, "float32", 64)
    prompts, params = bench.make_requests(workload)
    random.seed(0)
    expected = [[random.randint(0, 10000) for _ in range(random.randint(3, 9))] for _ in range(5)]
    expected_max_tokens = [random.randint(2, 7) for _ in range(5)]
    assert prompts == expected
    assert [p.max_tokens for p in params] == expected_max_tokens
    assert all(p.ignore_eos and p.temperature == 0.6 for p in params)


SHAPE = ModelShape(num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate=16, vocab=32)


def test_flops_and_bytes_counted_by_hand():
    assert SHAPE.layer_params == 8 * 4 * 4 + 8 * 8 + 3 * 8 * 16
    # 3 prompt + 2 output tokens: 4 fed, 2 sampled; position p attends to p + 1 keys (1 + 2 + 3 + 4 = 10).
    assert SHAPE.request_flops(3, 2) == 2 * 2 * 576 * 4 + 2 * 32 * 8 * 2 + 4 * 2 * 2 * 4 * 10
    # bf16: weights read on each of 2 steps; the one decoded token reads 4 keys of 2 layers' K and V.
    weights = (2 * 576 + 32 * 8) * 2 * 2
    assert SHAPE.decode_bytes([3], [2], itemsize=2) == weights + 4 * (2 * 2 * 1 * 4) * 2


def test_roofline_takes_the_larger_bound():
    flops = SHAPE.request_flops(3, 2)
    compute_only = bench.roofline(SHAPE, [3], [2], 4, Hardware(matmul_flops=flops, copy_bytes=None))
    assert compute_only.floor_s == pytest.approx(1.0) and compute_only.bound == "compute"
    slow_memory = bench.roofline(SHAPE, [3], [2], 2, Hardware(matmul_flops=flops, copy_bytes=1.0))
    assert slow_memory.bound == "memory" and slow_memory.floor_s == SHAPE.decode_bytes([3], [2], 2)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_dir) -> str:
    folder = tmp_path_factory.mktemp("bench-tiny-qwen3")
    build_tiny_model("qwen3", folder, smollm2_dir)
    return str(folder)


def test_throughput_against_transformers_prints_a_table(tiny_qwen3, capsys):
    workload = Workload(4, (8, 24), (2, 6), 0.0, "float32", 128)
    report = bench.run_throughput("cpu", workload, tiny_qwen3, with_hf=True)
    names = [run["name"] for run in report["runs"]]
    assert names[:2] == ["nanoengine", "transformers generate"]
    _, params = bench.make_requests(workload)
    assert report["runs"][0]["output_tokens"] == sum(p.max_tokens for p in params)
    assert all(run["output_tokens"] == report["runs"][0]["output_tokens"] for run in report["runs"])
    assert report["ours_percent_of_roofline"] > 0 and report["roofline_bound"] == "compute"
    bench.print_table(report)
    table = capsys.readouterr().out
    assert all(name in table for name in names) and "% of the roofline" in table
    json.dumps(report)


def test_prefix_and_chunked_presets_report_their_figures(tiny_qwen3):
    prefix = bench.run_prefix(tiny_qwen3, num_requests=4, shared_len=48, suffix_len=8)
    assert prefix["hit_rate_caching_on"] > 0 and prefix["hit_rate_caching_off"] == 0
    assert prefix["mean_ttft_ms_caching_on"] > 0
    chunked = bench.run_chunked(tiny_qwen3, num_decoders=2, long_len=64, threshold=16)
    for key in ("itl_p50_ms_threshold_off", "itl_p99_ms_threshold_on", "long_prompt_ttft_ms_threshold_on"):
        assert chunked[key] > 0
    json.dumps([prefix, chunked])


def test_structured_preset_constrains_every_request_without_ending_any_early(tiny_qwen3):
    workload = Workload(3, (8, 24), (2, 6), 0.0, "float32", 128)
    report = bench.run_structured(workload, tiny_qwen3)
    _, params = bench.make_requests(workload)
    assert report["output_tokens_each"] == sum(p.max_tokens for p in params)
    assert report["compile_ms_per_schema"] > 0 and report["json_schema_tok_s"] > 0
    json.dumps(report)
