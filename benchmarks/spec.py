"""The spec preset: n-gram speculative decoding on a grounded chat workload, and on random tokens.

Grounded: chat requests that repeat, quote or copy an excerpt of their prompt (600 characters of the
Python reference manual's text, which ships with Python in pydoc_data), 200 greedy tokens each (EOS
ignored, so every engine emits the same count), at 1, 4 and 16 requests at once, each level with fresh
excerpts (each engine runs in an LLM or process of its own, so no run finds another's prompts cached).
Ours runs without and with speculation, vLLM (``--compare vllm``) without and with its n-gram method,
all in the workload's dtype. Then the cpu preset's random-token workload runs without and with
speculation: what adaptation costs where nothing matches.
"""

import time

from transformers import AutoTokenizer

from benchmarks import common
from benchmarks.common import Throughput, Workload
from benchmarks.peers import run_vllm
from nanoengine import LLM, EngineStats, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CONCURRENCY = (1, 4, 16)
TASKS = ("Repeat the following text exactly:", "Quote the following text word for word:",
         "Copy out the following passage without changing a word:")
EXCERPT_CHARS = 600
OUTPUT_TOKENS = 200
MAX_MODEL_LEN = 512  # a 600-character excerpt is about 150 tokens


def grounded_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` chat prompts (as token ids), each asking to repeat a different excerpt."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topics[name].split()) for name in sorted(topics))
    prompts = []
    for i in range(count):
        excerpt = text[i * EXCERPT_CHARS:(i + 1) * EXCERPT_CHARS]
        messages = [{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{excerpt}"}]
        chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


def spec_preset(args) -> dict:
    return run_spec(common.model_for(args), common.preset_workload("cpu", args.dtype).dtype, "vllm" in args.compare)


def run_spec(model: str, dtype: str, with_vllm: bool, concurrency=CONCURRENCY, output_tokens=OUTPUT_TOKENS,
             random_workload: Workload | None = None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    prompts = grounded_prompts(AutoTokenizer.from_pretrained(model), sum(concurrency))
    starts = [sum(concurrency[:i]) for i in range(len(concurrency))]
    batches = [prompts[start:start + level] for start, level in zip(starts, concurrency)]
    rows = [{"concurrency": level} for level in concurrency]
    for name, spec in (("nanoengine", None), ("nanoengine + ngram", NGRAM)):
        with LLM(model, dtype=dtype, max_model_len=MAX_MODEL_LEN, speculative_config=spec) as llm:
            llm.generate([prompts[0][:32]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
            for row, batch in zip(rows, batches):
                before = llm.stats()
                row[name] = timed(llm, batch, params, name, row["concurrency"]).tokens_per_s
                if spec:
                    row.update(acceptance(before, llm.stats()))
    if with_vllm:
        workload = Workload(0, (0, 0), (0, 0), 0.0, dtype, MAX_MODEL_LEN)
        for name, spec in (("vLLM", None), ("vLLM + ngram", NGRAM)):
            runs = run_vllm(model, dtype, workload, prompts, [output_tokens] * len(prompts), list(concurrency), spec)
            for row, run in zip(rows, runs):
                row[name] = run.announce().tokens_per_s
                if spec:
                    row["ours_over_vllm_ngram"] = row["nanoengine + ngram"] / row[name]
    for row in rows:
        row["spec_speedup"] = row["nanoengine + ngram"] / row["nanoengine"]
    device = common.device_name("cuda" if common.on_gpu() else "cpu")
    return {"preset": "spec", "model": model, "device": device, "dtype": dtype, "speculative_config": NGRAM,
            "grounded": rows, "random": random_tokens(model, dtype, random_workload)}


def acceptance(before: EngineStats, after: EngineStats) -> dict:
    drafts = after.spec_num_drafts - before.spec_num_drafts
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {"ours_acceptance_rate": accepted / max(drafted, 1),
            "ours_mean_acceptance_length": 1 + accepted / max(drafts, 1)}


def timed(llm: LLM, prompts, params, name: str, level: int) -> Throughput:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return Throughput(f"{name}, {level} at once", tokens, time.perf_counter() - start).announce()


def random_tokens(model: str, dtype: str, workload: Workload | None = None) -> dict:
    """The cpu preset's requests without and with speculation, alternated twice (the best of each counts)."""
    workload = workload or common.preset_workload("cpu", dtype)
    prompts, params = common.make_requests(workload)
    best = {}
    with LLM(model, dtype=dtype, max_model_len=workload.max_model_len) as plain, \
            LLM(model, dtype=dtype, max_model_len=workload.max_model_len, speculative_config=NGRAM) as spec:
        for _ in range(2):
            for name, llm in (("nanoengine", plain), ("nanoengine + ngram", spec)):
                llm.reset_prefix_cache()
                run = common.run_ours(llm, prompts, params)[0]
                print(f"bench: random tokens, {name}: {run.tokens_per_s:,.1f} tok/s", flush=True)
                best[name] = max(best.get(name, 0.0), run.tokens_per_s)
        stats = spec.stats()
    return {"plain_tok_s": best["nanoengine"], "spec_tok_s": best["nanoengine + ngram"],
            "slowdown_percent": 100 * (best["nanoengine"] / best["nanoengine + ngram"] - 1),
            "draft_tokens": stats.spec_num_draft_tokens, "accepted_tokens": stats.spec_num_accepted_tokens}


def print_spec_table(report: dict) -> None:
    print(f"\nspec preset on {report['device']} ({report['model']}, {report['dtype']}), {report['speculative_config']}")
    names = [n for n in ("nanoengine", "nanoengine + ngram", "vLLM", "vLLM + ngram") if n in report["grounded"][0]]
    print(f"{'at once':>8}" + "".join(f"{n + ' tok/s':>26}" for n in names) + f"{'speedup':>9}{'accepted':>10}"
          f"{'mean len':>10}" + (f"{'ours/vLLM+ngram':>17}" if "vLLM + ngram" in names else ""))
    for row in report["grounded"]:
        line = f"{row['concurrency']:>8}" + "".join(f"{row[n]:>26,.1f}" for n in names)
        line += (f"{row['spec_speedup']:>8.2f}x{row['ours_acceptance_rate']:>10.0%}"
                 f"{row['ours_mean_acceptance_length']:>10.2f}")
        if "ours_over_vllm_ngram" in row:
            line += f"{row['ours_over_vllm_ngram']:>16.2f}x"
        print(line)
    r = report["random"]
    print(f"random tokens (cpu preset): {r['plain_tok_s']:,.1f} tok/s without, {r['spec_tok_s']:,.1f} with "
          f"speculation (time {r['slowdown_percent']:+.1f}%); {r['draft_tokens']} tokens drafted, "
          f"{r['accepted_tokens']} accepted")
