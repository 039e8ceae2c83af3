"""The quantization preset: our engine in the model's bfloat16, with int8 weights, with an int8 KV cache, with
both, and with int4 weights, on one request (200 prompt tokens, 128 generated: decoding at the memory's speed)
and on the cpu preset's 32 requests, each engine built once per round, the rounds alternated (the fastest of each
counts).

    python bench.py --preset quantization [--model DIR | --model random:llama-3.2-1b] [--rounds N]
"""

import sys
from dataclasses import replace

from benchmarks.common import Throughput, Workload, device_name, make_requests, model_for, preset_workload, run_ours
from nanoengine import LLM

VARIANTS = {
    "bfloat16": {},
    "int8 weights": {"quantization": "int8"},
    "int8 KV cache": {"kv_cache_dtype": "int8"},
    "int8 weights + KV cache": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "int4 weights": {"quantization": "int4"},
}
ONE_REQUEST = Workload(1, (200, 200), (128, 128), 0.0, "bfloat16", 2048)


def quantization_preset(args) -> dict:
    model = model_for(args)
    many = replace(preset_workload("cpu", "bfloat16"), num_seqs=32 if args.num_prompts is None else args.num_prompts)
    workloads = {"1 request": ONE_REQUEST} | ({f"{many.num_seqs} requests": many} if many.num_seqs else {})
    fastest: dict[tuple[str, str], Throughput] = {}
    facts = {}
    for _ in range(args.rounds):
        for variant, options in VARIANTS.items():
            with LLM(model, dtype="bfloat16", max_model_len=2048, **options) as llm:
                facts[variant] = engine_facts(llm)
                for load, workload in workloads.items():
                    prompts, params = make_requests(workload)
                    llm.reset_prefix_cache()
                    run = run_ours(llm, prompts, params)[0]
                    print(f"bench: {variant}, {load}: {run.tokens_per_s:,.1f} tok/s", file=sys.stderr, flush=True)
                    best = fastest.get((variant, load))
                    fastest[(variant, load)] = run if best is None or run.seconds < best.seconds else best
    return {"preset": "quantization", "model": model, "device": device_name("cpu"), "rounds": args.rounds,
            "runs": [{"variant": variant, "load": load, "tokens_per_s": run.tokens_per_s,
                      "over_bfloat16": run.tokens_per_s / fastest[("bfloat16", load)].tokens_per_s, **facts[variant]}
                     for (variant, load), run in fastest.items()]}


def engine_facts(llm: LLM) -> dict:
    """The engine's weight bytes (scales included) and how many tokens its KV cache holds."""
    runner = llm.llm_engine.model_executor.runner
    return {"weight_mb": llm.stats().weight_bytes / 1e6,
            "kv_cache_tokens": runner.num_kvcache_blocks * runner.block_size}


def print_quantization_table(report: dict) -> None:
    print(f"\nquantization preset on {report['device']} ({report['model']}), fastest of {report['rounds']} round(s)")
    print(f"{'variant':<26}{'load':<13}{'tok/s':>10}{'vs bf16':>9}{'weights MB':>12}{'KV tokens':>11}")
    for run in report["runs"]:
        print(f"{run['variant']:<26}{run['load']:<13}{run['tokens_per_s']:>10,.1f}{run['over_bfloat16']:>8.2f}x"
              f"{run['weight_mb']:>12,.0f}{run['kv_cache_tokens']:>11,}")
