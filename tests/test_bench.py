"""bench.py's helpers and presets (benchmarks/), on a tiny model (a smoke test: no timing is checked)."""

import json
import random

import pytest
import torch
from conftest import build_tiny_model

import bench
from benchmarks import common, latency, llamacpp, peers, serve_dp
from benchmarks.common import Workload
from benchmarks.roofline import Hardware, ModelShape, roofline


def test_requests_follow_nano_vllm_recipe():
    workload = Workload(5, (3, 9), (2, 7), 0.6, "float32", 64)
    prompts, params = common.make_requests(workload)
    random.seed(0)
    expected = [[random.randint(0, 10000) for _ in range(random.randint(3, 9))] for _ in range(5)]
    expected_max_tokens = [random.randint(2, 7) for _ in range(5)]
    assert prompts == expected
    assert [p.max_tokens for p in params] == expected_max_tokens
    assert all(p.ignore_eos and p.temperature == 0.6 for p in params)


SHAPE = ModelShape(num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate=16, vocab=32)


def test_flops_and_bytes_counted_by_hand():
    assert SHAPE.layer_params == 8 * 4 * 4 + 8 * 8 + 3 * 8 * 16
    # A 3-token prompt that samples (positions 0-2 see 1 + 2 + 3 keys) and one decode at position 4 (5 keys).
    step = [(3, 3, True), (1, 5, True)]
    assert SHAPE.step_flops(step) == 2 * 2 * 576 * 4 + 2 * 32 * 8 * 2 + 4 * 2 * 2 * 4 * (6 + 5)
    # bf16: all weights once, and the K and V of 3 + 5 live tokens in 2 layers.
    assert SHAPE.step_bytes(step, itemsize=2) == (2 * 576 + 32 * 8) * 2 + 8 * (2 * 2 * 1 * 4) * 2
    # int8 weights (a byte each) and an int8 cache (a byte a value, and a float32 scale per head vector of 4).
    weight, kv = SHAPE.itemsizes(torch.bfloat16, quantization="int8", kv_cache_dtype="int8")
    assert (weight, kv) == (1, 2) and SHAPE.itemsizes(torch.bfloat16) == (2, 2)
    assert SHAPE.step_bytes(step, weight, kv) == (2 * 576 + 32 * 8) + 8 * (2 * 2 * 1 * 4) * 2


def test_roofline_takes_the_larger_bound_per_step():
    prefill, decode = [(3, 3, True)], [(1, 4, True)]
    hw = Hardware(matmul_flops=SHAPE.step_flops(prefill), read_bytes=SHAPE.step_bytes(decode, 4))
    floor = roofline(SHAPE, [prefill, decode], 4, hw)
    # The prefill step takes 1 s of compute; the decode step 1 s of memory; neither sum alone is the floor.
    assert floor.floor_s == pytest.approx(2.0)
    assert floor.compute_s < 2.0 and floor.memory_s < 2.0 and floor.compute_s > 1.0 and floor.memory_s > 1.0


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_dir) -> str:
    folder = tmp_path_factory.mktemp("bench-tiny-qwen3")
    build_tiny_model("qwen3", folder, smollm2_dir)
    return str(folder)


def test_throughput_against_transformers_prints_a_table(tiny_qwen3, capsys, monkeypatch):
    workload = Workload(4, (8, 24), (2, 6), 0.0, "float32", 128)
    announced = []
    monkeypatch.setattr(common.Throughput, "announce", lambda run: announced.append(run) or run)
    report = bench.run_throughput("cpu", workload, tiny_qwen3, peers={"hf"}, rounds=2)
    names = [run["name"] for run in report["runs"]]
    assert names[:2] == ["nanoengine", "transformers generate"] and len(set(names)) == len(names)
    for run in report["runs"]:  # two rounds each, alternated; the faster counts
        rounds = [r.seconds for r in announced if r.name == run["name"]]
        assert len(rounds) == 2 and run["seconds"] == min(rounds)
    assert [r.name for r in announced[:len(names)]] == [r.name for r in announced[len(names):]]
    _, params = common.make_requests(workload)
    assert report["runs"][0]["output_tokens"] == sum(p.max_tokens for p in params)
    assert all(run["output_tokens"] == report["runs"][0]["output_tokens"] for run in report["runs"])
    assert 0 < report["ours_percent_of_roofline"] < 100
    assert report["machine"]["read_gb_per_s"] > 0 and report["machine"]["cores"] >= 1
    bench.print_table(report)
    table = capsys.readouterr().out
    assert all(name in table for name in names) and "% of the roofline" in table
    json.dumps(report)


def test_transformers_runs_at_its_faster_dtype(tiny_qwen3, monkeypatch):
    """Where torch multiplies bfloat16 slower than float32, the transformers peer runs in float32 and says so."""
    loaded, load = [], peers.load_hf_model

    def load_recorded(model, dtype, device):
        loaded.append(dtype)
        return load(model, dtype, device)

    monkeypatch.setattr(peers, "hf_dtype", lambda dtype, device: torch.float32)
    monkeypatch.setattr(peers, "load_hf_model", load_recorded)
    workload = Workload(2, (8, 12), (2, 3), 0.0, "bfloat16", 64)
    report = bench.run_throughput("cpu", workload, tiny_qwen3, peers={"hf"}, rounds=1)
    assert loaded == [torch.float32]
    assert [run["name"] for run in report["runs"]][1:] == ["transformers generate, float32",
                                                          "transformers generate_batch, float32"]
    assert peers.hf_dtype(torch.float32, "cpu") is torch.float32


def test_prefix_and_chunked_presets_report_their_figures(tiny_qwen3):
    prefix = latency.run_prefix(tiny_qwen3, num_requests=4, shared_len=48, suffix_len=8)
    assert prefix["hit_rate_caching_on"] > 0 and prefix["hit_rate_caching_off"] == 0
    assert prefix["mean_ttft_ms_caching_on"] > 0
    chunked = latency.run_chunked(tiny_qwen3, num_decoders=2, long_len=64, threshold=16)
    for key in ("itl_p50_ms_threshold_off", "itl_p99_ms_threshold_on", "long_prompt_ttft_ms_threshold_on"):
        assert chunked[key] > 0
    json.dumps([prefix, chunked])


def test_structured_preset_constrains_every_request_without_ending_any_early(tiny_qwen3):
    workload = Workload(3, (8, 24), (2, 6), 0.0, "float32", 128)
    report = bench.run_structured(workload, tiny_qwen3)
    _, params = common.make_requests(workload)
    assert report["output_tokens_each"] == sum(p.max_tokens for p in params)
    assert report["compile_ms_per_schema"] > 0 and report["json_schema_tok_s"] > 0
    json.dumps(report)


def test_compare_takes_a_list_of_known_peers():
    assert bench.parse_args(["--compare", "hf,vllm"]).compare == {"hf", "vllm"}
    assert bench.parse_args([]).compare == set()
    with pytest.raises(SystemExit):
        bench.parse_args(["--compare", "hf,vllmm"])
    assert bench.parse_args(["--compare", "llamacpp"]).compare == {"llamacpp"}
    with pytest.raises(SystemExit):  # llama.cpp runs a workload of its own
        bench.parse_args(["--compare", "hf,llamacpp"])


def fake_tool(folder, name: str, output: str) -> None:
    """A stand-in for a llama.cpp tool that prints ``output`` amid log lines, and fails unless flash attention
    is on."""
    script = folder / name
    script.write_text(f"#!/bin/sh\ncase \"$*\" in *'-fa on'*) ;; *) exit 3;; esac\necho 'llama_model_loader: ...'\n"
                      f"cat <<'EOF'\n{output}\nEOF\necho 'llama_perf_context_print: done'\n")
    script.chmod(0o755)


def test_llamacpp_results_are_found_among_its_log_lines(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(llamacpp, "tools", lambda: tmp_path)
    rows = [{"pl": n, "t": 0.5 * n, "speed": 1.0} for n in (1, 4)]
    fake_tool(tmp_path, "llama-batched-bench", "\n".join(map(json.dumps, rows)))
    fake_tool(tmp_path, "llama-perplexity", "perplexity: calculating perplexity over 5 chunks, n_ctx=1024\n"
                                            "Final estimate: PPL = 18.9731 +/- 0.61")
    assert llamacpp.batched_bench(tmp_path / "model.gguf", (1, 4)) == {1: 0.5, 4: 2.0}
    assert llamacpp.llama_perplexity(tmp_path / "model.gguf", tmp_path / "text.txt", 1024) == (18.9731, 5 * 511)
    bench.print_table({"preset": "llamacpp", "model": "m", "device": "cpu", "threads": 2, "workload": "w",
                       "seconds": {"ours": {"1": 0.25, "4": 1.0}, "llama.cpp Q8_0": {"1": 0.5}},
                       "pairs": [["ours", "llama.cpp Q8_0"]]})
    table = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["1", "0.25", "0.50", "2.00x"] in table and ["4", "1.00", "-", "-"] in table


def test_llamacpp_peer_without_its_build_says_how_to_make_it_for_our_kernels_level(monkeypatch, tmp_path):
    monkeypatch.setattr(llamacpp, "ROOT", tmp_path / "missing")
    monkeypatch.setenv("NANOENGINE_CPU_ARCH", "x86-64-v3")
    with pytest.raises(FileNotFoundError, match="build-x86-64-v3.*make llamacpp LLAMACPP_ARCH=x86-64-v3"):
        llamacpp.batched_bench(tmp_path / "model.gguf")


def test_vllm_peer_without_its_environment_says_how_to_make_it(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "VLLM_PYTHON", tmp_path / "missing" / "bin" / "python")
    with pytest.raises(FileNotFoundError, match="make bench-vllm"):
        peers.compare_vllm("model", common.WORKLOADS["cpu"], [[1, 2]], [3])


def test_vllm_peer_result_is_found_among_vllms_own_log_lines(monkeypatch, tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\ncat > /dev/null\necho 'INFO loading'\n"
                           f"echo '{peers.VLLM_RESULT_PREFIX}[{{\"output_tokens\": 7, \"seconds\": 0.5}}]'\n"
                           "echo 'WARNING [shutdown] force killing'\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(peers, "VLLM_PYTHON", fake_python)
    run, = peers.run_vllm("model", "bfloat16", common.WORKLOADS["cpu"], [[1, 2]], [7])
    assert (run.name, run.useful_tokens, run.seconds) == ("vLLM bfloat16", 7, 0.5)


def test_spec_preset_reports_both_runs_per_level_and_the_random_workload(tiny_qwen3, capsys):
    from benchmarks.spec import run_spec

    report = run_spec(tiny_qwen3, "float32", with_vllm=False, concurrency=(1, 2), output_tokens=12,
                      random_workload=Workload(3, (8, 24), (2, 6), 0.0, "float32", 128))
    assert [row["concurrency"] for row in report["grounded"]] == [1, 2]
    for row in report["grounded"]:
        assert row["nanoengine"] > 0 and row["nanoengine + ngram"] > 0 and row["spec_speedup"] > 0
        assert 0 <= row["ours_acceptance_rate"] <= 1 and row["ours_mean_acceptance_length"] >= 1
    assert report["random"]["plain_tok_s"] > 0 and report["random"]["spec_tok_s"] > 0
    bench.print_table(report)
    assert "random tokens" in capsys.readouterr().out
    json.dumps(report)


def test_serve_table_puts_both_engines_side_by_side_with_higher_is_better_ratios(capsys):
    from benchmarks.serve import SERVE_MEASURES, print_serve_table

    def run(engine, scale):  # vLLM's times are half ours, its throughput twice ours
        times = {key: 10.0 * scale for _, key, higher_better in SERVE_MEASURES if not higher_better}
        return {"engine": engine, "dtype": "float32", "load": "light", "request_rate": 1.0, "num_requests": 8,
                "output_token_throughput": 100.0 / scale} | times

    print_serve_table({"device": "cpu", "model": "m", "runs": [run("nanoengine", 1.0), run("vLLM", 0.5)]})
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("float32")]
    assert len(rows) == len(SERVE_MEASURES)
    assert all(row.split()[-3:] == ["10.0", "5.0", "0.50x"] for row in rows if "ms" in row)
    assert next(row for row in rows if "tok/s" in row).split()[-3:] == ["100.0", "200.0", "0.50x"]


def test_the_serve_table_prints_the_overload_apart_from_the_other_loads(capsys):
    from benchmarks.overload import print_overload_lines
    from benchmarks.serve import print_serve_table

    overload = {"engine": "nanoengine", "dtype": "float32", "load": "overload", "request_rate": 4.0,
                "num_requests": 120, "seconds": 40.0, "good_within_s": 20.0, "goodput_rps": 1.0, "num_good": 40,
                "num_finished": 50, "num_429": 70, "num_failed": 0, "canary_count": 20, "canary_refused": 2,
                "canary_ttft_p50_ms": 900.0, "canary_ttft_max_ms": 4000.0, "canary_ttft_p99_ms": 3900.0}
    print_serve_table({"device": "cpu", "model": "m", "runs": [overload]})
    [line] = [line for line in capsys.readouterr().out.splitlines() if "overload" in line]
    assert "goodput 1.00 req/s (40 finished within 20 s, 50 in all), 70 refused (429), 0 failed" in line
    assert "canary TTFT p50 900 ms, max 4000 ms (2 of 20 refused)" in line
    print_overload_lines([overload | {"canary_ttft_p50_ms": None}])
    assert "no canary served" in capsys.readouterr().out


def test_serve_dp_tenants_share_a_system_prompt_under_their_own_salt_and_the_table_prints(capsys):
    requests = serve_dp.tenant_requests(40)
    prompts_by_salt: dict[str, list[list[int]]] = {}
    for salt, prompt in requests:
        prompts_by_salt.setdefault(salt, []).append(prompt)
    assert len(prompts_by_salt) == serve_dp.TENANTS
    systems = {salt: {tuple(p[:serve_dp.SYSTEM_TOKENS]) for p in prompts} for salt, prompts in prompts_by_salt.items()}
    assert all(len(s) == 1 for s in systems.values()) and len(set().union(*systems.values())) == serve_dp.TENANTS
    assert len({tuple(p) for _, p in requests}) == 40  # every question is fresh
    run = {"hit_rate": 0.5, "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0, "request_throughput": 1.0,
           "output_token_throughput": 8.0}
    serve_dp.print_serve_dp_table({"device": "cpu", "model": "m", "num_requests": 40, "request_rate": 1.5,
                                   "tenants": 4, "system_tokens": 256, "runs": [{"name": "DP=2 round-robin"} | run],
                                   "hit_rate_prefix_over_round_robin": 1.6, "ttft_p50_prefix_over_round_robin": 0.23})
    out = capsys.readouterr().out
    assert "DP=2 round-robin" in out and "50.0%" in out and "hit rate 1.60x" in out
