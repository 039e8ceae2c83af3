"""The serve-dp preset: a multi-tenant workload on one engine core, and on two under each routing rule.

Each of ``TENANTS`` tenants has a long system prompt of its own and its own cache salt; each request is one
tenant's system prompt and a fresh question (random token ids, seeded), arriving in a Poisson stream. The
KV cache is the same in all: ``BLOCKS_PER_CORE`` blocks per core with two cores, twice that with one, so one
core of two holds about half the tenants' prompts. Reported per run: the prefix-cache hit rate (tokens
found over tokens looked up, summed over the cores), TTFT p50/p99 and throughput.
"""

import asyncio
import random
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import device_name, model_for, on_gpu, percentile, stream_one
from benchmarks.serve import running_server

TENANTS, SYSTEM_TOKENS, QUESTION_TOKENS, OUTPUT_TOKENS = 8, 256, 16, 8
BLOCKS_PER_CORE = 80  # 16 blocks per system prompt: five tenants' prompts, or four and the running requests' own
DEFAULT_RATE, DEFAULT_NUM_REQUESTS = 1.5, 40  # without --request-rate and --num-prompts
RUNS = (("DP=1 (2 threads)", 1, "prefix"), ("DP=2 prefix-aware", 2, "prefix"),
        ("DP=2 least-loaded", 2, "least-loaded"), ("DP=2 round-robin", 2, "round-robin"))


def tenant_requests(num_requests: int) -> list[tuple[str, list[int]]]:
    """(salt, prompt token ids) per request: a tenant drawn uniformly, its system prompt and a fresh question."""
    rng = random.Random(0)
    systems = [[rng.randint(1000, 40000) for _ in range(SYSTEM_TOKENS)] for _ in range(TENANTS)]
    requests = []
    for _ in range(num_requests):
        tenant = rng.randrange(TENANTS)
        requests.append((f"tenant-{tenant}", systems[tenant] + [rng.randint(1000, 40000)
                                                               for _ in range(QUESTION_TOKENS)]))
    return requests


def serve_dp_preset(args) -> dict:
    model = model_for(args)
    rate = args.request_rate or DEFAULT_RATE
    requests = tenant_requests(args.num_prompts or DEFAULT_NUM_REQUESTS)
    runs = []
    for name, size, routing in RUNS:
        flags = ("--max-model-len", "512", "--num-kvcache-blocks", str(BLOCKS_PER_CORE * 2 // size),
                 "--data-parallel-size", str(size), "--data-parallel-routing", routing)
        with running_server(model, *flags, log=sys.stderr) as (_, url):  # stdout holds only the report
            runs.append({"name": name} | asyncio.run(run_tenants(url, requests, rate)))
    prefix, round_robin = runs[1], runs[3]
    return {"preset": "serve-dp", "device": device_name("cuda" if on_gpu() else "cpu"), "model": model,
            "num_requests": len(requests), "request_rate": rate, "tenants": TENANTS, "system_tokens": SYSTEM_TOKENS,
            "runs": runs,
            "hit_rate_prefix_over_round_robin": prefix["hit_rate"] / max(round_robin["hit_rate"], 1e-9),
            "ttft_p50_prefix_over_round_robin": prefix["ttft_p50_ms"] / round_robin["ttft_p50_ms"]}


async def run_tenants(url: str, requests: list[tuple[str, list[int]]], rate: float) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    await stream_one(client, None, [7] * 8, 2)  # warm-up, sharing no block with the tenants
    before = prefix_counts(url)
    arrivals = random.Random(1)
    start = time.perf_counter()
    tasks = []
    for salt, prompt in requests:
        tasks.append(asyncio.create_task(stream_one(client, None, prompt, OUTPUT_TOKENS, salt)))
        await asyncio.sleep(arrivals.expovariate(rate))
    results = await asyncio.gather(*tasks)
    seconds = time.perf_counter() - start
    await client.close()  # in this event loop, which closes after the run
    queries, hits = (after - earlier for after, earlier in zip(prefix_counts(url), before))
    ttfts = [r[0] for r in results]
    return {"hit_rate": hits / queries, "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 99), "request_throughput": len(results) / seconds,
            "output_token_throughput": sum(r[3] for r in results) / seconds}


def prefix_counts(url: str) -> tuple[float, float]:
    """Prompt tokens looked up in the prefix cache and found there, summed over the engine cores."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    samples = [s for family in families for s in family.samples]
    return tuple(sum(s.value for s in samples if s.name == f"nanoengine:prefix_cache_{kind}_total")
                 for kind in ("queries", "hits"))


def print_serve_dp_table(report: dict) -> None:
    print(f"\nserve-dp preset on {report['device']} ({report['model']}): {report['num_requests']} requests at "
          f"{report['request_rate']}/s, {report['tenants']} tenants with {report['system_tokens']}-token system "
          f"prompts, {BLOCKS_PER_CORE * 2} KV blocks in all")
    print(f"{'run':<22}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'req/s':>8}{'out tok/s':>11}")
    for run in report["runs"]:
        print(f"{run['name']:<22}{run['hit_rate']:>10.1%}{run['ttft_p50_ms']:>13,.0f}{run['ttft_p99_ms']:>13,.0f}"
              f"{run['request_throughput']:>8.2f}{run['output_token_throughput']:>11.1f}")
    print(f"prefix-aware over round-robin: hit rate {report['hit_rate_prefix_over_round_robin']:.2f}x, "
          f"TTFT p50 {report['ttft_p50_prefix_over_round_robin']:.2f}x")
