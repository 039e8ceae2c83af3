"""nanoengine prefix-report: its cached tokens are the engine's own, and it shows where a template breaks reuse."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.cli import main

ROOT = Path(__file__).parents[1]
SYSTEM = "You answer questions about the ACME support desk, politely and in one short paragraph. " * 3
QUESTIONS = ["How do I reset my password?", "Where is my order?", "Can I change my plan?", "Who do I call?"]
NUM_BLOCKS = 12  # 192 tokens: the mixed file below evicts
CAPITALS = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."


def chat(question: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


MIXED = [
    {"messages": chat(QUESTIONS[0])},
    {"messages": chat(QUESTIONS[1]), "model": "any", "max_tokens": 5},  # fields that change nothing cached
    {"prompt": CAPITALS, "cache_salt": "tenant-a"},
    {"prompt": CAPITALS, "cache_salt": "tenant-b"},
    {"prompt": CAPITALS + " And", "cache_salt": "tenant-a"},
    {"messages": chat(QUESTIONS[2]), "cache_salt": "tenant-a"},
    {"prompt_token_ids": list(range(1000, 1100))},  # 100 tokens: evicts most of what came before
    {"messages": chat(QUESTIONS[3])},
    {"prompt_token_ids": list(range(1000, 1040)) + [7]},
    {"messages": chat(QUESTIONS[0])},
]


def write_lines(path: Path, bodies: list, extra_lines: tuple[str, ...] = ()) -> str:
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies) + "".join(line + "\n" for line in extra_lines))
    return str(path)


def run_report(capsys, *args: str) -> tuple[int, dict]:
    code = main(["prefix-report", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def engine_cached_tokens(folder: str, bodies: list[dict]) -> list[int]:
    """num_cached_tokens when each request runs alone, in order, with max_tokens=1, on a fresh engine."""
    params = SamplingParams(max_tokens=1)
    cached = []
    with LLM(folder, num_kvcache_blocks=NUM_BLOCKS, max_model_len=NUM_BLOCKS * 16) as llm:
        for body in bodies:
            if "messages" in body and body.get("cache_salt") is None:
                output = llm.chat(body["messages"], params, use_tqdm=False)[0]
            else:
                prompt = {key: body[key] for key in ("prompt", "prompt_token_ids", "cache_salt") if key in body}
                if "messages" in body:
                    prompt["prompt_token_ids"] = llm.llm_engine.processor.render_chat(body["messages"],
                                                                            add_generation_prompt=True)[1]
                output = llm.generate(prompt, params, use_tqdm=False)[0]
            cached.append(output.num_cached_tokens)
    return cached


def test_cached_tokens_equal_the_engines_on_a_mixed_file(folder, tmp_path, capsys, one_torch_thread):
    too_long = {"prompt_token_ids": list(range(2000, 2000 + NUM_BLOCKS * 16))}
    path = write_lines(tmp_path / "requests.jsonl", MIXED[:5], ("{not json",))
    with open(path, "a") as lines:
        lines.write(json.dumps(too_long) + "\n" + "".join(json.dumps(b) + "\n" for b in MIXED[5:]))
    code, small = run_report(capsys, path, "--model", folder, "--num-blocks", str(NUM_BLOCKS))
    assert code == 1
    assert [e["line"] for e in small["errors"]] == [6, 7]
    assert "max_model_len" in small["errors"][1]["error"]
    assert [r["line"] for r in small["requests"]] == [1, 2, 3, 4, 5, 8, 9, 10, 11, 12]
    cached = [r["cached_tokens"] for r in small["requests"]]
    assert cached == engine_cached_tokens(folder, MIXED)
    assert cached[1] > 0 and cached[3] == 0 and cached[4] > 0  # the salts: b shares nothing with a
    _, unbounded = run_report(capsys, path, "--model", folder)
    assert cached[-1] < unbounded["requests"][-1]["cached_tokens"]  # line 12 repeats line 1, evicted meanwhile
    summary = small["summary"]
    assert summary["cached_tokens"] == sum(cached)
    assert summary["hit_rate"] == pytest.approx(sum(cached) / summary["prompt_tokens"])


def test_a_date_before_the_shared_system_prompt_is_where_reuse_breaks(folder, tmp_path, capsys):
    dated = [{"messages": chat(q, f"Today is 2026-12-{day:02}. " + SYSTEM)} for day, q in enumerate(QUESTIONS, 11)]
    code, report = run_report(capsys, write_lines(tmp_path / "dated.jsonl", dated), "--model", folder)
    assert code == 0
    first, *later = report["requests"]
    assert first["diverges_at"] is None and first["closest_line"] is None
    for row, day in zip(later, range(12, 15)):
        assert row["cached_tokens"] == 0 and row["diverges_in_block"] == 0
        assert (row["message_index"], row["message_role"]) == (0, "system")
        before, after = row["divergence_text"].split("|")
        assert f"-12-{day}." in before + after and after.startswith(str(day)[-1])
    assert report["summary"]["divergence_messages"][0] == {"message": "messages[0] (system)", "requests": 3}
    assert report["summary"]["shared_prefix_groups"] == []  # not even one block in common
    # The date moved after the shared part: every later request reuses the system prompt's blocks.
    moved = [{"messages": chat(f"Today is 2026-12-{day:02}. {q}")} for day, q in enumerate(QUESTIONS, 11)]
    _, fixed = run_report(capsys, write_lines(tmp_path / "moved.jsonl", moved), "--model", folder)
    assert all(row["message_index"] == 1 for row in fixed["requests"][1:])
    assert all(row["cached_tokens"] == 16 * (row["diverges_at"] // 16) > 0 for row in fixed["requests"][1:])
    assert fixed["summary"]["shared_prefix_groups"][0]["requests"] == len(QUESTIONS)


def test_module_prints_a_table_and_plots_the_hit_rate(folder, tmp_path):
    path = write_lines(tmp_path / "requests.jsonl", MIXED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "nanoengine.tools.prefix_report", path, "--model", folder, "--plot",
                           str(tmp_path / "rate.png")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prompt tokens cached" in done.stdout and "lies most often in messages[1] (user)" in done.stdout
    assert (tmp_path / "rate.png").read_bytes().startswith(b"\x89PNG")


def test_the_ttft_example_reuses_the_shared_prefix_offline_and_served(smollm2_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "prefix_caching_ttft.py"), "--model", smollm2_dir],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^(offline|server) +(first|same again|id first) +TTFT +[\d.]+ ms +cached +(\d+) of (\d+)",
                      done.stdout, re.M)
    cached = {(where, name): (int(hit), int(total)) for where, name, hit, total in rows}
    assert len(cached) == 6
    for where in ("offline", "server"):
        hit, total = cached[where, "same again"]
        assert cached[where, "first"] == (0, total) and hit == 16 * ((total - 1) // 16) > 0
        assert cached[where, "id first"][0] == 0
