"""The peers: transformers in this process, and vLLM's CPU backend (or CUDA) in its own interpreter."""

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import Throughput, Workload, on_gpu, sync
from benchmarks.roofline import time_best


def load_hf_model(model: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


def hf_generation_config(temperature: float, max_new_tokens: int):
    from transformers import GenerationConfig

    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else {}
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, eos_token_id=None,
                            pad_token_id=0, **sampling)


@torch.inference_mode()
def run_hf_generate(model, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> Throughput:
    """transformers' generate over the whole batch, left-padded; every row runs to the longest request,
    so only each request's own tokens count as useful. Its static cache is the faster one here."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    warm_up, config = (hf_generation_config(temperature, n) for n in (8, max(max_tokens)))
    warm_up.cache_implementation = config.cache_implementation = "static"
    model.generate(input_ids[:1, -16:], attention_mask=mask[:1, -16:], generation_config=warm_up)
    sync()
    start = time.perf_counter()
    model.generate(input_ids, attention_mask=mask, generation_config=config)
    sync()
    return Throughput("transformers generate", sum(max_tokens), time.perf_counter() - start)


@torch.inference_mode()
def run_hf_continuous_batching(model, prompts: list[list[int]], max_tokens: list[int],
                               temperature: float) -> Throughput:
    """transformers' continuous batching (the manager behind ``generate_batch``), each request with its own
    max_new_tokens."""
    config = hf_generation_config(temperature, max(max_tokens))
    config.min_new_tokens = None
    config.eos_token_id = -1  # never stop early: the requests run to their own max_new_tokens
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   continuous_batching_config=hf_cache_config(prompts, max_tokens),
                                                   warmup=on_gpu()) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, max_tokens)]
        generated = 0
        for _ in ids:
            result = wait_finished(manager)
            generated += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    return Throughput("transformers generate_batch", generated, seconds)


def hf_cache_config(prompts: list[list[int]], max_tokens: list[int]):
    """On a GPU transformers sizes its cache from free memory; on the CPU it would take most of the RAM,
    so it gets what the requests need (all at once)."""
    from transformers import ContinuousBatchingConfig

    if on_gpu():
        return None
    page = ContinuousBatchingConfig().page_size
    return ContinuousBatchingConfig(num_blocks=sum(-(-(len(p) + n) // page) for p, n in zip(prompts, max_tokens)))


def wait_finished(manager):
    while True:
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("transformers' continuous batching stopped without a result")
        if result.is_finished():
            return result


def hf_dtype(dtype: torch.dtype, device: str) -> torch.dtype:
    """transformers at its faster dtype: on a CPU without bfloat16 instructions torch multiplies bfloat16
    slower than float32, so on the CPU the faster of the two, by timing torch's own matmul."""
    if device == "cuda" or dtype != torch.bfloat16:
        return dtype
    a = torch.randn(1024, 1024)
    return min((dtype, torch.float32), key=lambda d: time_best(functools.partial(torch.mm, a.to(d), a.to(d)), 5))


def compare_hf(model_dir: str, dtype: torch.dtype, device: str, prompts, max_tokens, temperature) -> list:
    peer_dtype = hf_dtype(dtype, device)
    model = load_hf_model(model_dir, peer_dtype, device)
    suffix = "" if peer_dtype == dtype else f", {str(peer_dtype).removeprefix('torch.')}"

    def named(run: Throughput) -> Throughput:
        return replace(run, name=run.name + suffix)

    peers = [named(run_hf_generate(model, prompts, max_tokens, temperature)).announce()]
    try:
        peers.append(named(run_hf_continuous_batching(model, prompts, max_tokens, temperature)).announce())
    except (ImportError, TypeError, AttributeError, RuntimeError) as error:  # its API moves between versions
        print(f"bench: transformers' continuous batching left out: {error!r}", file=sys.stderr)
    return peers


# vLLM's own interpreter: vLLM pins its own dependency set, which must not touch ours (`make bench-vllm`).
VLLM_PYTHON = Path(__file__).parent.parent / ".venv-vllm" / "bin" / "python"
VLLM_RUNNER = Path(__file__).parent.parent / "scripts" / "bench_vllm_peer.py"
VLLM_RESULT_PREFIX = "bench_vllm_peer result: "  # the runner's result line; vLLM's own logs share its stdout


def vllm_env() -> dict[str, str]:
    """vLLM at its best on this CPU: without a binding it keeps one core for its scheduler process and
    gives the model one thread less."""
    if not VLLM_PYTHON.is_file():
        raise FileNotFoundError(f"the vLLM peer needs vLLM in {VLLM_PYTHON.parent.parent}: run `make bench-vllm`")
    cores = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_KVCACHE_SPACE="4",
               OMP_NUM_THREADS=str(len(cores)))
    intel_openmp = VLLM_PYTHON.parent.parent / "lib" / "libiomp5.so"
    if intel_openmp.is_file():  # vLLM's CPU guide preloads it (speculative decoding warns without it)
        env["LD_PRELOAD"] = " ".join(filter(None, [str(intel_openmp), env.get("LD_PRELOAD")]))
    return env


def compare_vllm(model: str, workload: Workload, prompts, max_tokens) -> list[Throughput]:
    """vLLM's CPU backend (or CUDA) on the same requests, at float32 and at bfloat16: both runs are kept,
    and the ratio that counts is the one against the faster."""
    dtypes = [workload.dtype] if on_gpu() else ["float32", "bfloat16"]
    return [run_vllm(model, dtype, workload, prompts, max_tokens)[0].announce() for dtype in dtypes]


def run_vllm(model: str, dtype: str, workload: Workload, prompts, max_tokens, batches: list[int] | None = None,
             speculative_config: dict | None = None) -> list[Throughput]:
    """One timed generate per batch: ``batches`` cuts the prompts into consecutive runs (default: one)."""
    work = dict(model=model, dtype=dtype, max_model_len=workload.max_model_len, prompts=prompts,
                max_tokens=max_tokens, temperature=workload.temperature, batches=batches or [len(prompts)],
                speculative_config=speculative_config)
    done = subprocess.run([str(VLLM_PYTHON), str(VLLM_RUNNER)], input=json.dumps(work), env=vllm_env(), text=True,
                          stdout=subprocess.PIPE, check=True)
    results = json.loads(next(line for line in done.stdout.splitlines() if line.startswith(VLLM_RESULT_PREFIX))
                         .removeprefix(VLLM_RESULT_PREFIX))
    name = f"vLLM {dtype}" + (" + ngram" if speculative_config else "")
    return [Throughput(name, r["output_tokens"], r["seconds"]) for r in results]
