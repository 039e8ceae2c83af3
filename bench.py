"""Benchmarks for nanoengine: offline throughput, prefix-cache TTFT, chunked-prefill latency, speculation.

    python bench.py --preset gpu [--model DIR] [--compare hf] [--json]
    python bench.py --preset cpu [--compare hf,vllm] [--dtype bfloat16] [--quantization int8] [--rounds N]
    python bench.py --preset prefix [--small]
    python bench.py --preset chunked [--small]
    python bench.py --preset structured
    python bench.py --preset spec [--compare vllm]
    python bench.py --preset serve [--compare vllm] [--num-prompts N] [--request-rate R] [--max-concurrency C]
    python bench.py --preset serve-dp [--num-prompts N] [--request-rate R]
    python bench.py --compare llamacpp [--cpu-arch x86-64-v3] [--model random:llama-3.2-1b] [--quantization Q]
    python bench.py --preset quality [--n-ctx N]
    python bench.py --preset quantization [--model DIR | --model random:llama-3.2-1b] [--rounds N] [--num-prompts N]
    python bench.py --preset profile [--num-prompts N] [--prompt-len L] [--dtype D]

``gpu`` is nano-vllm's published benchmark (256 random-token requests, random prompt and output
lengths, ``random.seed(0)``) on a Qwen3-0.6B-shaped model; without ``--model`` the model has random
weights, which is enough for a throughput figure. ``cpu`` is the same kind of workload sized for a
small CPU, on the default model (SmolLM2-135M-Instruct), in bfloat16 where the CPU has AVX-512 or AMX
(else float32; ``--dtype`` overrides). ``--compare hf`` then runs transformers on
the same model and the same prompts in the same process; ``--compare vllm`` runs vLLM's ``LLM.generate``
on them in vLLM's own interpreter (``make bench-vllm`` builds it), at float32 and at bfloat16. Each
throughput run also prints the machine and a roofline: per step the larger of its FLOPs over a matmul
rate and its bytes (all weights, every live token's K and V) over a read bandwidth, both measured at
start, summed over the steps our engine ran; ``--rounds 2`` runs every engine twice, alternated, and
keeps each one's faster run. ``structured`` runs the cpu preset's requests unconstrained
and with a JSON schema each. ``serve`` starts ``nanoengine serve`` and measures it as ``vllm bench serve``
does, at a light Poisson load and a saturating one, then overloaded at 4x the capacity the saturating load
measured (goodput, 429s, a canary's TTFT; benchmarks/overload.py); with ``--compare vllm`` it measures ``vllm serve``
on the same requests too, at float32 and at bfloat16;
``serve-dp`` runs a multi-tenant workload on one engine core and on two, under each routing rule.
``--compare llamacpp`` runs llama-batched-bench's workload on llama.cpp's bf16, Q8_0 and 4-bit files and on our
engine in bfloat16, with int8 weights and on the same 4-bit file (``make bench-llamacpp`` builds llama.cpp and
its files; benchmarks/llamacpp.py); ``quality`` prints the perplexity of our bfloat16, float32 and quantized
variants and, file by file, of llama.cpp and ours reading it, on a fixed text (benchmarks/quality.py says how it
is scored). ``profile`` prints where one step's time goes (benchmarks/profile.py). ``quantization`` runs our engine
in bfloat16, with int8 weights, with an int8 KV cache, with both and with int4 weights, on one request and on 32
(benchmarks/quantization.py).
``--model random:NAME`` (qwen3-0.6b, llama-3.2-1b) is a model of that shape with random weights and SmolLM2's
vocabulary size.

The presets' shared parts and peers live in benchmarks/ (common, roofline, peers, latency, serve, serve_dp, spec,
llamacpp, quality, quantization);
this file runs the throughput and structured presets and is the entry point for all.
"""


import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch

from benchmarks.common import (
    Throughput,
    Workload,
    device_name,
    make_requests,
    model_for,
    on_gpu,
    preset_workload,
    run_ours,
)
from benchmarks.latency import chunked_preset, prefix_preset
from benchmarks.llamacpp import compare_llamacpp, print_llamacpp_table
from benchmarks.peers import compare_hf, compare_vllm
from benchmarks.profile import print_profile, profile_preset
from benchmarks.quality import print_quality_table, quality_preset
from benchmarks.quantization import print_quantization_table, quantization_preset
from benchmarks.roofline import Hardware, ModelShape, Roofline, machine, roofline
from benchmarks.serve import print_serve_table, serve_preset
from benchmarks.serve_dp import print_serve_dp_table, serve_dp_preset
from benchmarks.spec import print_spec_table, spec_preset
from nanoengine import LLM, StructuredOutputsParams


def throughput_preset(args) -> dict:
    workload = preset_workload(args.preset, args.dtype)
    if "llamacpp" in args.compare:  # llama.cpp runs its own workload: llama-batched-bench's
        return compare_llamacpp(model_for(args), workload.dtype, args.quantization)
    return run_throughput(args.preset, workload, model_for(args), args.compare, args.rounds,
                          enforce_eager=args.enforce_eager, quantization=args.quantization,
                          kv_cache_dtype=args.kv_cache_dtype)


def run_throughput(preset: str, workload: Workload, model: str, peers: set[str], rounds: int = 1,
                   **llm_options) -> dict:
    """Ours and the peers on the same requests, one after another, ``rounds`` times over (each engine's
    fastest round counts: alternating them spreads the machine's drift over all of them)."""
    device = "cuda" if on_gpu() else "cpu"
    dtype = getattr(torch, workload.dtype)
    hw = Hardware.measure(device, dtype)
    prompts, params = make_requests(workload)
    max_tokens = [p.max_tokens for p in params]
    fastest: dict[str, Throughput] = {}
    for _ in range(rounds):
        with LLM(model, dtype=workload.dtype, max_model_len=workload.max_model_len, **llm_options) as llm:
            ours, steps = run_ours(llm, prompts, params)
            shape = ModelShape.of(llm.config.hf_config)
        if "nanoengine" not in fastest or ours.seconds < fastest["nanoengine"].seconds:
            ours_steps = steps  # the roofline of our fastest round
        runs = [ours.announce()]
        if "hf" in peers:
            runs += compare_hf(model, dtype, device, prompts, max_tokens, workload.temperature)
        if "vllm" in peers:
            runs += compare_vllm(model, workload, prompts, max_tokens)
        for run in runs:
            fastest[run.name] = min(run, fastest.get(run.name, run), key=lambda r: r.seconds)
    itemsize, kv_itemsize = shape.itemsizes(dtype, llm_options.get("quantization"),
                                            llm_options.get("kv_cache_dtype", "auto"))
    floor = roofline(shape, ours_steps, itemsize, hw, kv_itemsize)
    return throughput_report(preset, model, device, workload, hw, floor, list(fastest.values()))


def throughput_report(preset, model, device, workload, hw, floor: Roofline, results: list[Throughput]) -> dict:
    ours = results[0]
    peers = results[1:]
    best_peer = max(peers, key=lambda r: r.tokens_per_s, default=None)
    return {
        "preset": preset, "model": model, "device": device_name(device), "dtype": workload.dtype,
        "machine": machine(device, hw),
        "runs": [{"name": r.name, "output_tokens": r.useful_tokens, "seconds": r.seconds,
                  "tokens_per_s": r.tokens_per_s, "ours_over_this": ours.tokens_per_s / r.tokens_per_s}
                 for r in results],
        "ours_over_best_peer": ours.tokens_per_s / best_peer.tokens_per_s if best_peer else None,
        "roofline_compute_s": floor.compute_s, "roofline_memory_s": floor.memory_s,
        "roofline_floor_s": floor.floor_s, "roofline_bound": floor.bound,
        "ours_percent_of_roofline": 100 * floor.floor_s / ours.seconds,
    }


OWN_TABLES = {"spec": print_spec_table, "serve": print_serve_table, "serve-dp": print_serve_dp_table,
              "llamacpp": print_llamacpp_table, "quality": print_quality_table, "profile": print_profile,
              "quantization": print_quantization_table}


def print_table(report: dict) -> None:
    if report["preset"] in OWN_TABLES:
        return OWN_TABLES[report["preset"]](report)
    print(f"\n{report['preset']} preset on {report['device']} ({report['model']})")
    if "machine" in report:
        print(f"machine: {machine_line(report['machine'])}; dtype {report['dtype']}")
    if "runs" in report:
        print(f"{'engine':<30}{'output tokens':>15}{'seconds':>10}{'tok/s':>12}{'ours / it':>12}")
        for run in report["runs"]:
            print(f"{run['name']:<30}{run['output_tokens']:>15,}{run['seconds']:>10.2f}{run['tokens_per_s']:>12,.1f}"
                  f"{run['ours_over_this']:>11.2f}x")
        print(roofline_line(report))
        return
    width = max(len(k) for k in report)
    for key, value in report.items():
        if key not in ("preset", "device", "model"):
            print(f"{key:<{width}}  {value:,.3f}" if isinstance(value, float) else f"{key:<{width}}  {value}")


def roofline_line(report: dict) -> str:
    machine = report["machine"]
    rates = f"matmul {machine['matmul_tflops']:.2f} TFLOP/s, read {machine['read_gb_per_s']:,.1f} GB/s"
    return (f"roofline ({rates}): per step the larger of compute and memory: floor {report['roofline_floor_s']:.2f} s "
            f"(compute {report['roofline_compute_s']:.2f} s, memory {report['roofline_memory_s']:.2f} s in all); "
            f"ours {report['runs'][0]['seconds']:.2f} s = {report['ours_percent_of_roofline']:.0f}% of the roofline")


def structured_preset(args) -> dict:
    return run_structured(preset_workload("cpu", args.dtype), model_for(args), enforce_eager=args.enforce_eager)


def run_structured(workload: Workload, model: str, **llm_options) -> dict:
    """The cpu preset's requests unconstrained and with a JSON schema of its own each, alternated twice in one
    run (the best of each counts: a shared machine's speed drifts between runs).

    Each schema asks for more list items than max_tokens allows, so no grammar ends a request early and
    both runs produce the same tokens' worth of work.
    """
    prompts, params = make_requests(workload)
    schemas = [{"type": "object", "required": [f"words{i}"], "properties": {f"words{i}": {
        "type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": workload.output_lens[1] + 1}}}
        for i in range(len(prompts))]
    with LLM(model, dtype=workload.dtype, max_model_len=workload.max_model_len, **llm_options) as llm:
        compiler = llm.llm_engine.processor.structured_output_manager()
        start = time.perf_counter()
        constraints = [StructuredOutputsParams(json=s) for s in schemas]
        for constraint in constraints:  # each schema is new; the compiler's cache serves the run below
            compiler.compile(constraint)
        compile_s = (time.perf_counter() - start) / len(schemas)
        structured_params = [replace(p, structured_outputs=c) for p, c in zip(params, constraints)]
        runs = {"nanoengine": [], "nanoengine, JSON schema": []}
        for _ in range(2):
            for name, run_params in zip(runs, (params, structured_params)):
                llm.reset_prefix_cache()
                runs[name].append(replace(run_ours(llm, prompts, run_params)[0], name=name).announce())
        free, constrained = (max(r, key=lambda run: run.tokens_per_s) for r in runs.values())
    return {"preset": "structured", "model": model, "device": device_name("cuda" if on_gpu() else "cpu"),
            "unconstrained_tok_s": free.tokens_per_s, "json_schema_tok_s": constrained.tokens_per_s,
            "output_tokens_each": constrained.useful_tokens,
            "slowdown_percent": 100 * (free.tokens_per_s / constrained.tokens_per_s - 1),
            "compile_ms_per_schema": 1000 * compile_s}


def machine_line(machine: dict) -> str:
    if "isa" not in machine:
        return machine["name"]
    return (f"{machine['name']} ({machine['isa']}), {machine['cores']} cores, "
            f"{machine['torch_threads']} torch threads")


PRESETS = {"gpu": throughput_preset, "cpu": throughput_preset, "prefix": prefix_preset, "chunked": chunked_preset,
           "structured": structured_preset, "serve": serve_preset, "spec": spec_preset,
           "serve-dp": serve_dp_preset, "quality": quality_preset, "profile": profile_preset,
           "quantization": quantization_preset}


def peer_set(text: str) -> set[str]:
    peers = set(text.split(","))
    if not peers <= {"hf", "vllm", "llamacpp"}:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {sorted(peers - {'hf', 'vllm', 'llamacpp'})}: "
                                         "choose hf, vllm, llamacpp")
    if "llamacpp" in peers and len(peers) > 1:
        raise argparse.ArgumentTypeError("llamacpp runs llama-batched-bench's workload, not the preset's: "
                                         "compare it alone")
    return peers


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if on_gpu() else "cpu")
    parser.add_argument("--model", help="a Hugging Face model folder, or random:NAME (a random model of a real "
                        "shape: qwen3-0.6b, llama-3.2-1b; default: per preset)")
    parser.add_argument("--compare", type=peer_set, default=set(),
                        help="hf, vllm or hf,vllm: also run transformers and/or vLLM on the same requests; "
                             "llamacpp: llama.cpp and ours on llama-batched-bench's workload")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the preset's dtype")
    parser.add_argument("--quantization", choices=["int8", "int4"],
                        help="gpu/cpu/profile: our engine's weights quantized (docs/quantization.md; the peers' stay "
                             "in dtype); --compare llamacpp: only that pair (int8 against Q8_0, int4: the 4-bit file)")
    parser.add_argument("--small", action="store_true", help="prefix/chunked: the sizes for a CPU (default there)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                        help="gpu/cpu/profile: our KV cache's dtype (docs/kv-cache-quantization.md)")
    parser.add_argument("--num-prompts", type=int, help="serve: how many requests per load (default: per load); "
                        "quantization: the requests of its second load (default 32; 0 leaves it out)")
    parser.add_argument("--request-rate", type=float,
                        help="serve: one load at this Poisson rate (inf: all at once) instead of the preset's two")
    parser.add_argument("--max-concurrency", type=int, help="serve: most requests in flight")
    parser.add_argument("--prompt-len", type=int, default=128, help="profile: each request's prompt tokens")
    parser.add_argument("--rounds", type=int, default=1,
                        help="gpu/cpu: run ours and the peers this many times, alternated; the fastest of each counts")
    parser.add_argument("--n-ctx", type=int, help="quality: the window's length in tokens (default 1024)")
    parser.add_argument("--cpu-arch", help="our CPU kernels built for this -march (NANOENGINE_CPU_ARCH), and at "
                        "x86-64-v3 torch's own ops held to AVX2 too, so that the figures are an AVX2 CPU's; "
                        "--compare llamacpp runs llama.cpp's build for the same level")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


# What torch reads when it loads, to hold its own kernels (ATen's and oneDNN's) to AVX2.
AVX2_TORCH = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run_at_cpu_arch(arch: str) -> None:
    """This process again with NANOENGINE_CPU_ARCH=arch (and torch held to AVX2 at x86-64-v3), unless it is so."""
    wanted = {"NANOENGINE_CPU_ARCH": arch} | (AVX2_TORCH if arch == "x86-64-v3" else {})
    if any(os.environ.get(name) != value for name, value in wanted.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | wanted)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.cpu_arch:
        run_at_cpu_arch(args.cpu_arch)
    report = PRESETS[args.preset](args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return report


if __name__ == "__main__":
    main()
