"""The serve preset's overload: Poisson arrivals at a multiple of the capacity that the saturated load
measured, with a small canary request every few seconds. What an operator wants to know: how many requests
still finished within a deadline (goodput), how many were refused at once (429), how many failed otherwise,
and how long the canary waited for its first token."""

import asyncio
import dataclasses
import random
import statistics
import time

from benchmarks.common import Workload, make_requests, percentile, stream_one

OVERLOAD_FACTOR = 4  # arrivals per second, as a multiple of the saturated load's finished requests per second
OVERLOAD_SECONDS = 30  # of arrivals
GOOD_WITHIN_S = 20.0  # a request that finished later than this after it was sent does not count as goodput
CANARY_PERIOD_S = 2.0


async def run_overload(url: str, workload: Workload, capacity_rps: float, seed: int) -> dict:
    """The overload on the server at ``url``; ``workload.num_seqs`` is ignored (the rate and the seconds
    decide how many)."""
    from openai import APIError, AsyncOpenAI, RateLimitError


    rate = OVERLOAD_FACTOR * capacity_rps
    count = max(1, round(rate * OVERLOAD_SECONDS))
    prompts, params = make_requests(dataclasses.replace(workload, num_seqs=count), seed)
    outcomes, canary_ttfts, stop = [], [], asyncio.Event()
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id

        async def one(prompt, max_tokens):
            start = time.perf_counter()
            try:
                await stream_one(client, model, prompt, max_tokens)
                outcomes.append(("finished", time.perf_counter() - start))
            except RateLimitError:
                outcomes.append(("429", time.perf_counter() - start))
            except APIError:
                outcomes.append(("failed", time.perf_counter() - start))

        async def canary():
            while not stop.is_set():
                try:
                    canary_ttfts.append((await stream_one(client, model, [seed + 7] * 8, 1))[0])
                except APIError:
                    canary_ttfts.append(float("nan"))  # refused or failed: it got no first token
                await asyncio.sleep(CANARY_PERIOD_S)

        canary_task = asyncio.create_task(canary())
        arrivals, tasks, start = random.Random(seed), [], time.perf_counter()
        for prompt, p in zip(prompts, params):
            tasks.append(asyncio.create_task(one(prompt, p.max_tokens)))
            await asyncio.sleep(arrivals.expovariate(rate))
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        stop.set()
        await canary_task
    good = [s for kind, s in outcomes if kind == "finished" and s <= GOOD_WITHIN_S]
    served = [t for t in canary_ttfts if t == t]
    return {"request_rate": rate, "num_requests": count, "seconds": seconds, "good_within_s": GOOD_WITHIN_S,
            "goodput_rps": len(good) / seconds, "num_good": len(good),
            "num_finished": sum(kind == "finished" for kind, _ in outcomes),
            "num_429": sum(kind == "429" for kind, _ in outcomes),
            "num_failed": sum(kind == "failed" for kind, _ in outcomes),
            "canary_count": len(canary_ttfts), "canary_refused": len(canary_ttfts) - len(served),
            "canary_ttft_p50_ms": 1e3 * statistics.median(served) if served else None,
            "canary_ttft_max_ms": 1e3 * max(served) if served else None,
            "canary_ttft_p99_ms": 1e3 * percentile(served, 99) if served else None}


def print_overload_lines(runs: list[dict]) -> None:
    for run in runs:
        canary = ("no canary served" if run["canary_ttft_p50_ms"] is None else
                  f"canary TTFT p50 {run['canary_ttft_p50_ms']:.0f} ms, max {run['canary_ttft_max_ms']:.0f} ms")
        print(f"{run['engine']} {run['dtype']} overload ({run['request_rate']:.2f}/s = {OVERLOAD_FACTOR}x capacity, "
              f"{run['num_requests']} requests): goodput {run['goodput_rps']:.2f} req/s ({run['num_good']} finished "
              f"within {run['good_within_s']:.0f} s, {run['num_finished']} in all), {run['num_429']} refused (429), "
              f"{run['num_failed']} failed; {canary} ({run['canary_refused']} of {run['canary_count']} refused)")
