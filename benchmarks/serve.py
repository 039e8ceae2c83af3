"""The serve preset: ``nanoengine serve`` measured as ``vllm bench serve`` does."""

import asyncio
import contextlib
import random
import socket
import statistics
import subprocess
import sys
import time

from benchmarks.common import Workload, device_name, make_requests, model_for, on_gpu, percentile


@contextlib.contextmanager
def running_server(model: str, *flags: str, log=None):
    """``nanoengine serve`` as a subprocess on a free port; yields (process, base URL) once /health answers.
    On exit it gets SIGTERM (SIGKILL if it has not stopped within a minute)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "nanoengine.serve", model, "--port", str(port), *flags],
                               stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url)
        yield process, url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until_healthy(process: subprocess.Popen, url: str, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} while starting")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


def serve_preset(args) -> dict:
    workload = Workload(args.num_prompts, (64, 512), (32, 128), 0.0, "float32", 2048)
    # The server's log goes to stderr, so that stdout holds only the report.
    model = model_for(args)
    with running_server(model, "--max-model-len", str(workload.max_model_len), log=sys.stderr) as (_, url):
        return {"model": model} | asyncio.run(run_serve(url, workload, args.request_rate, args.max_concurrency))


async def run_serve(url: str, workload: Workload, rate: float, max_concurrency: int | None) -> dict:
    """``vllm bench serve``'s measurements: streaming requests with Poisson arrivals at ``rate`` per second
    (all at once when inf), at most ``max_concurrency`` in flight; then the shared-system-prompt check."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompts, params = make_requests(workload)
    await stream_one(client, prompts[0][:16], 4)  # warm-up
    limit = asyncio.Semaphore(max_concurrency or len(prompts))

    async def limited(prompt, max_tokens):
        async with limit:
            return await stream_one(client, prompt, max_tokens)

    start = time.perf_counter()
    tasks = []
    for prompt, p in zip(prompts, params):
        tasks.append(asyncio.create_task(limited(prompt, p.max_tokens)))
        await asyncio.sleep(random.expovariate(rate) if rate != float("inf") else 0)
    results = await asyncio.gather(*tasks)
    seconds = time.perf_counter() - start
    ttfts, itls = [r[0] for r in results], [gap for r in results for gap in r[1]]
    tpots = [(r[2] - r[0]) / (r[3] - 1) for r in results if r[3] > 1]
    report = {"preset": "serve", "device": device_name("cuda" if on_gpu() else "cpu"),
              "num_requests": len(prompts), "request_rate": rate, "max_concurrency": max_concurrency,
              "seconds": seconds, "request_throughput": len(prompts) / seconds,
              "output_token_throughput": sum(r[3] for r in results) / seconds}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        report.update({f"{name}_mean_ms": 1e3 * statistics.mean(values),
                       f"{name}_p50_ms": 1e3 * percentile(values, 50), f"{name}_p99_ms": 1e3 * percentile(values, 99)})
    return report | await shared_system_prompt_twice(client, url)


async def stream_one(client, prompt: list[int] | str, max_tokens: int,
                     cache_salt: str | None = None) -> tuple[float, list[float], float, int]:
    """One streamed greedy completion: (TTFT, inter-chunk gaps, latency, output tokens)."""
    start = time.perf_counter()
    chunk_times, num_tokens = [], 0
    stream = await client.completions.create(model=None, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True, "cache_salt": cache_salt})
    async for chunk in stream:
        if chunk.choices:
            chunk_times.append(time.perf_counter())
        if chunk.usage:
            num_tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return chunk_times[0] - start, gaps, chunk_times[-1] - start, num_tokens


async def shared_system_prompt_twice(client, url: str) -> dict:
    """The same request with a long system prompt, sent twice: the second one finds the prompt in the
    prefix cache, so its TTFT should be far shorter."""
    import httpx

    system = " ".join(f"Rule {i}: answer in plain words and cite the rule number." for i in range(120))
    report = {}
    for attempt in ("first", "second"):
        hits_before = prefix_cache_hits(httpx.get(f"{url}/metrics").text)
        ttft, *_ = await stream_one(client, f"{system}\nQuestion: what is rule 7?\nAnswer:", 1)
        report[f"shared_prompt_ttft_ms_{attempt}"] = 1e3 * ttft
        hits = prefix_cache_hits(httpx.get(f"{url}/metrics").text) - hits_before
        report[f"shared_prompt_cache_hit_tokens_{attempt}"] = hits
    report["shared_prompt_ttft_first_over_second"] = (report["shared_prompt_ttft_ms_first"]
                                                      / report["shared_prompt_ttft_ms_second"])
    return report


def prefix_cache_hits(metrics_text: str) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    return next(int(s.value) for family in text_string_to_metric_families(metrics_text)
                for s in family.samples if s.name == "nanoengine:prefix_cache_hits_total")
