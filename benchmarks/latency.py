"""Latency presets: TTFT with prefix caching on and off, and decoders' inter-token gaps around a long prompt."""

import random
import statistics
import time

from benchmarks.common import device_name, model_for, on_gpu, percentile
from nanoengine import LLM, SamplingParams


def prefix_preset(args) -> dict:
    sizes = (16, 512, 32) if args.small or not on_gpu() else (64, 1024, 32)
    return run_prefix(model_for(args), *sizes, enforce_eager=args.enforce_eager)


def run_prefix(model: str, num_requests: int, shared_len: int, suffix_len: int, **llm_options) -> dict:
    """Requests that share a long system prompt: mean TTFT with prefix caching on and off."""
    random.seed(0)
    shared = [random.randint(0, 10000) for _ in range(shared_len)]
    prompts = [shared + [random.randint(0, 10000) for _ in range(suffix_len)] for _ in range(num_requests)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    report = {"preset": "prefix", "model": model, "device": device_name("cuda" if on_gpu() else "cpu"),
              "num_requests": num_requests, "shared_prompt_tokens": shared_len, "suffix_tokens": suffix_len}
    for caching in (True, False):
        with LLM(model, enable_prefix_caching=caching, **llm_options) as llm:
            llm.generate([shared], params, use_tqdm=False)  # warm-up; with caching on, the prompt is now cached
            outputs = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.stats()
        key = "on" if caching else "off"
        report[f"mean_ttft_ms_caching_{key}"] = 1e3 * statistics.mean(o.metrics.time_to_first_token for o in outputs)
        report[f"hit_rate_caching_{key}"] = stats.prefix_cache_hit_rate
    report["ttft_off_over_on"] = report["mean_ttft_ms_caching_off"] / report["mean_ttft_ms_caching_on"]
    return report


# Chunked prefill -------------------------------------------------------------------------------------


def chunked_preset(args) -> dict:
    sizes = (8, 2048, 256) if args.small or not on_gpu() else (16, 8000, 512)
    return run_chunked(model_for(args), *sizes, enforce_eager=args.enforce_eager)


def run_chunked(model: str, num_decoders: int, long_len: int, threshold: int, **llm_options) -> dict:
    """Decoders' inter-token latency while one long prompt arrives, with the long-prefill cap off and on."""
    report = {"preset": "chunked", "model": model, "device": device_name("cuda" if on_gpu() else "cpu"),
              "num_decoders": num_decoders, "long_prompt_tokens": long_len, "threshold": threshold}
    for cap in (0, threshold):
        with LLM(model, long_prefill_token_threshold=cap, max_model_len=long_len + 256, **llm_options) as llm:
            gaps, long_ttft = decoder_gaps_around_long_prompt(llm, num_decoders, long_len)
        key = "on" if cap else "off"
        report[f"itl_p50_ms_threshold_{key}"] = 1e3 * percentile(gaps, 50)
        report[f"itl_p99_ms_threshold_{key}"] = 1e3 * percentile(gaps, 99)
        report[f"long_prompt_ttft_ms_threshold_{key}"] = 1e3 * long_ttft
    return report


def decoder_gaps_around_long_prompt(llm: LLM, num_decoders: int, long_len: int,
                                    steps_after: int = 32) -> tuple[list[float], float]:
    """Start the decoders, let them settle, add one long prompt; return the decoders' inter-token gaps
    from its arrival until it has produced ``steps_after`` tokens, and the long prompt's TTFT."""
    engine = llm.llm_engine
    random.seed(0)
    decoders = [f"decoder-{i}" for i in range(num_decoders)]
    for rid in decoders:
        engine.add_request(rid, [random.randint(0, 10000) for _ in range(64)],
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=long_len))
    token_counts: dict[str, int] = {}
    last_token_at: dict[str, float] = {}
    for _ in range(4):  # every decoder has its prompt in and decodes
        record_new_tokens(engine.step(), token_counts, last_token_at, gaps=[])
    engine.add_request("long", [random.randint(0, 10000) for _ in range(long_len)],
                       SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps_after))
    arrival = time.perf_counter()
    gaps: list[float] = []
    long_ttft = None
    while token_counts.get("long", 0) < steps_after:
        record_new_tokens(engine.step(), token_counts, last_token_at, gaps)
        if long_ttft is None and "long" in token_counts:
            long_ttft = time.perf_counter() - arrival
    engine.abort_request(decoders)
    return gaps, long_ttft


def record_new_tokens(outputs, token_counts: dict[str, int], last_token_at: dict[str, float],
                      gaps: list[float]) -> None:
    """Note which requests got tokens in this step; a decoder's gap is the time since its previous tokens."""
    now = time.perf_counter()
    for output in outputs:
        rid, count = output.request_id, len(output.outputs[0].token_ids)
        if count > token_counts.get(rid, 0):
            if rid in last_token_at and rid != "long":
                gaps.append(now - last_token_at[rid])
            token_counts[rid], last_token_at[rid] = count, now
