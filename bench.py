"""Benchmarks for nanoengine: offline throughput, prefix-cache TTFT and chunked-prefill latency.

    python bench.py --preset gpu [--model DIR] [--compare hf] [--json]
    python bench.py --preset cpu [--compare hf,vllm] [--dtype bfloat16]
    python bench.py --preset prefix [--small]
    python bench.py --preset chunked [--small]
    python bench.py --preset structured
    python bench.py --preset serve [--num-prompts N] [--request-rate R] [--max-concurrency C]

``gpu`` is nano-vllm's published benchmark (256 random-token requests, random prompt and output
lengths, ``random.seed(0)``) on a Qwen3-0.6B-shaped model; without ``--model`` the model has random
weights, which is enough for a throughput figure. ``cpu`` is the same kind of workload sized for a
small CPU, on the default model (SmolLM2-135M-Instruct), in bfloat16 where the CPU has native bfloat16
(else float32; ``--dtype`` overrides). ``--compare hf`` then runs transformers on
the same model and the same prompts in the same process; ``--compare vllm`` runs vLLM's ``LLM.generate``
on them in vLLM's own interpreter (``make bench-vllm`` builds it), at float32 and at bfloat16. Each
throughput run also prints the machine and a roofline: per step the larger of its FLOPs over a matmul
rate and its bytes (all weights, every live token's K and V) over a read bandwidth, both measured at
start, summed over the steps our engine ran. ``structured`` runs the cpu preset's requests unconstrained
and with a JSON schema each. ``serve`` starts ``nanoengine serve`` and measures it as ``vllm bench serve``
does.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PretrainedConfig

from nanoengine import LLM, SamplingParams, StructuredOutputsParams
from nanoengine.engine.model_runner import StepInputs
from nanoengine.layers.linear import can_pack_for_onednn, linear, pack_for_onednn
from nanoengine.models.llama import head_dim_of
from nanoengine.utils.cpu_info import cpu_flags, cpu_model
from nanoengine.utils.default_model import cache_dir, default_model_path

QWEN3_0_6B_SHAPE = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_theta=1000000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
RANDOM_MODEL_NAME = "bench-qwen3-0.6b-random"


@dataclass
class Workload:
    num_seqs: int
    prompt_lens: tuple[int, int]  # inclusive range, drawn uniformly
    output_lens: tuple[int, int]
    temperature: float
    dtype: str
    max_model_len: int


WORKLOADS = {
    "gpu": Workload(256, (100, 1024), (100, 1024), 0.6, "bfloat16", 4096),
    "cpu": Workload(32, (64, 512), (32, 256), 0.0, "bfloat16", 2048),  # float32 where bfloat16 is not native
}


def on_gpu() -> bool:
    return torch.cuda.is_available()


# The workload ---------------------------------------------------------------------------------------


def make_requests(w: Workload) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py recipe: token ids uniform in [0, 10000], the same draws in the same order."""
    random.seed(0)
    randint = random.randint
    prompts = [[randint(0, 10000) for _ in range(randint(*w.prompt_lens))] for _ in range(w.num_seqs)]
    params = [SamplingParams(temperature=w.temperature, ignore_eos=True, max_tokens=randint(*w.output_lens))
              for _ in range(w.num_seqs)]
    return prompts, params


def random_qwen3_model(folder: Path | None = None) -> str:
    """A Qwen3-0.6B-shaped checkpoint with random weights (bf16), built once and cached."""
    folder = folder or cache_dir() / RANDOM_MODEL_NAME
    if (folder / "model.safetensors").is_file():
        return str(folder)
    from transformers import AutoModelForCausalLM, Qwen3Config

    print(f"bench: building a random Qwen3-0.6B-shaped model in {folder} (once)", file=sys.stderr)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        torch.manual_seed(0)
        config = Qwen3Config(**QWEN3_0_6B_SHAPE, dtype="bfloat16")
        with torch.device("cuda" if on_gpu() else "cpu"):  # random init of 0.6B weights is slow on a CPU
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(temp)
        byte_level_tokenizer().save_pretrained(temp)
        temp.rename(folder)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return str(folder)


def byte_level_tokenizer():
    """256 byte tokens and an end-of-text token: prompts here are token ids, so any tokenizer will do,
    and one built in place needs no download (ids past its vocabulary decode to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


def model_for(args) -> str:
    """The model a preset runs: the random Qwen3-0.6B shape on a GPU, SmolLM2 on the CPU."""
    if args.model:
        return args.model
    if args.preset == "gpu" or (args.preset != "cpu" and on_gpu()):
        return random_qwen3_model()
    return default_model_path()


# Measured hardware rates ---------------------------------------------------------------------------------


def time_best(fn, reps: int) -> float:
    """Best wall time of ``reps`` calls after one warm-up (synchronizing the GPU around each)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def matmul_flops_per_s(device: str, dtype: torch.dtype) -> float:
    """The faster of torch's matmul and, on the CPU, the oneDNN kernel our linears can use (torch's goes
    through MKL, which can leave half of an AMD CPU's vector width unused)."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    seconds = time_best(lambda: a @ b, reps=10)
    if can_pack_for_onednn(b):
        packed = pack_for_onednn(b)
        seconds = min(seconds, time_best(lambda: linear(a, b, packed_weight=packed), reps=10))
    return 2 * n**3 / seconds


def read_bytes_per_s(device: str) -> float:
    """Memory read bandwidth: a sum over a tensor far larger than any cache reads each byte once."""
    data = torch.ones((1 << 30 if device == "cuda" else 1 << 28) // 4, device=device)
    return data.numel() * 4 / time_best(data.sum, reps=10)


@dataclass
class Hardware:
    matmul_flops: float
    read_bytes: float

    @classmethod
    def measure(cls, device: str, dtype: torch.dtype) -> "Hardware":
        return cls(matmul_flops_per_s(device, dtype), read_bytes_per_s(device))


def machine(device: str, hw: Hardware) -> dict:
    """What a reader needs to place the figures: the processor, the ISA that picks its kernels, its rates."""
    rates = {"matmul_tflops": hw.matmul_flops / 1e12, "read_gb_per_s": hw.read_bytes / 1e9}
    if device == "cuda":
        return {"name": torch.cuda.get_device_name(), **rates}
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in cpu_flags()]
    return {"name": cpu_model(), "isa": " ".join(flags) or "none of avx2/avx512/amx", "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), **rates}


# Roofline -----------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: PretrainedConfig) -> "ModelShape":
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim_of(config), config.intermediate_size, config.vocab_size)

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matmuls: q, k, v, o, and gate, up, down."""
        qkv = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return qkv + self.num_heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        return self.num_layers * self.layer_params + self.vocab * self.hidden  # with the LM head

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def step_flops(self, step: "Step") -> int:
        """Every new token goes through every layer; each sampling request needs the LM head once; a token
        at position p attends to p + 1 keys (QK^T and PV: 4 FLOPs per key and head dim)."""
        tokens = sum(new for new, _, _ in step)
        linear = 2 * self.num_layers * self.layer_params * tokens + 2 * self.vocab * self.hidden * sum(
            samples for _, _, samples in step)
        # New tokens at positions context - new .. context - 1 see context - new + 1 .. context keys.
        keys = sum(new * context - new * (new - 1) // 2 for new, context, _ in step)
        return linear + 4 * self.num_layers * self.num_heads * self.head_dim * keys

    def step_bytes(self, step: "Step", itemsize: int) -> int:
        """The least a step must read: every weight once, and the K and V of every live token once."""
        live_tokens = sum(context for _, context, _ in step)
        return (self.matmul_params + live_tokens * self.kv_bytes_per_token) * itemsize


# One forward pass as the roofline sees it: per scheduled request (new tokens, context length after the
# step, whether it samples).
Step = list[tuple[int, int, bool]]


@dataclass
class Roofline:
    compute_s: float  # the steps' FLOPs over the matmul rate
    memory_s: float  # the steps' bytes over the read bandwidth
    floor_s: float  # per step the larger of the two, summed over the steps

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s > self.compute_s else "compute"


def roofline(shape: ModelShape, steps: list[Step], itemsize: int, hw: Hardware) -> Roofline:
    compute = [shape.step_flops(step) / hw.matmul_flops for step in steps]
    memory = [shape.step_bytes(step, itemsize) / hw.read_bytes for step in steps]
    return Roofline(sum(compute), sum(memory), sum(map(max, compute, memory)))


# Throughput runs ------------------------------------------------------------------------------------


@dataclass
class Throughput:
    name: str
    useful_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds

    def announce(self) -> "Throughput":
        """Each figure as soon as it is measured, so a run cut short still leaves it in the log."""
        print(f"bench: {self.name}: {self.useful_tokens} tokens in {self.seconds:.2f} s = "
              f"{self.tokens_per_s:,.1f} tok/s", file=sys.stderr, flush=True)
        return self


def run_ours(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[Throughput, list[Step]]:
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    steps = record_steps(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    del llm.llm_engine.model_runner.execute  # the recording wrapper: back to the class's method
    return Throughput("nanoengine", sum(len(o.outputs[0].token_ids) for o in outputs), seconds), steps


def record_steps(llm: LLM) -> list[Step]:
    """From now on, note the shape of each step the model runner executes (for the roofline)."""
    runner = llm.llm_engine.model_runner
    execute, steps = runner.execute, []

    def recording_execute(scheduled, *args):
        inputs = StepInputs.of(scheduled)
        steps.append([(len(ids), start + len(ids), samples)
                      for ids, start, samples in zip(inputs.token_ids, inputs.starts, inputs.samples)])
        return execute(scheduled, *args)

    runner.execute = recording_execute
    return steps


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


def preset_workload(preset: str, dtype: str | None) -> Workload:
    """The preset's workload in ``dtype``; by default the cpu preset runs in bfloat16 where the CPU multiplies
    it natively (AVX-512 BF16 or AMX), else in float32."""
    if dtype is None and preset == "cpu" and not cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        dtype = "float32"
    return replace(WORKLOADS[preset], dtype=dtype) if dtype else WORKLOADS[preset]


def throughput_preset(args) -> dict:
    workload = preset_workload(args.preset, args.dtype)
    return run_throughput(args.preset, workload, model_for(args), args.compare, enforce_eager=args.enforce_eager)


def run_throughput(preset: str, workload: Workload, model: str, peers: set[str], **llm_options) -> dict:
    device = "cuda" if on_gpu() else "cpu"
    dtype = getattr(torch, workload.dtype)
    hw = Hardware.measure(device, dtype)
    prompts, params = make_requests(workload)
    with LLM(model, dtype=workload.dtype, max_model_len=workload.max_model_len, **llm_options) as llm:
        ours, steps = run_ours(llm, prompts, params)
        ours.announce()
        shape = ModelShape.of(llm.config.hf_config)
    max_tokens = [p.max_tokens for p in params]
    results = [ours]
    if "hf" in peers:
        results += compare_hf(model, dtype, device, prompts, max_tokens, workload.temperature)
    if "vllm" in peers:
        results += compare_vllm(model, workload, prompts, max_tokens)
    floor = roofline(shape, steps, dtype.itemsize, hw)
    return throughput_report(preset, model, device, workload, hw, floor, results)


def compare_hf(model_dir: str, dtype: torch.dtype, device: str, prompts, max_tokens, temperature) -> list:
    model = load_hf_model(model_dir, dtype, device)
    peers = [run_hf_generate(model, prompts, max_tokens, temperature).announce()]
    try:
        peers.append(run_hf_continuous_batching(model, prompts, max_tokens, temperature).announce())
    except (ImportError, TypeError, AttributeError, RuntimeError) as error:  # its API moves between versions
        print(f"bench: transformers' continuous batching left out: {error!r}", file=sys.stderr)
    return peers


# vLLM's own interpreter: vLLM pins its own dependency set, which must not touch ours (`make bench-vllm`).
VLLM_PYTHON = Path(__file__).parent / ".venv-vllm" / "bin" / "python"
VLLM_RUNNER = Path(__file__).parent / "scripts" / "bench_vllm_peer.py"
VLLM_RESULT_PREFIX = "bench_vllm_peer result: "  # the runner's result line; vLLM's own logs share its stdout


def compare_vllm(model: str, workload: Workload, prompts, max_tokens) -> list[Throughput]:
    """vLLM's CPU backend (or CUDA) on the same requests, at float32 and at bfloat16: both runs are kept,
    and the ratio that counts is the one against the faster."""
    if not VLLM_PYTHON.is_file():
        raise FileNotFoundError(f"--compare vllm needs vLLM in {VLLM_PYTHON.parent.parent}: run `make bench-vllm`")
    dtypes = [workload.dtype] if on_gpu() else ["float32", "bfloat16"]
    return [run_vllm(model, dtype, workload, prompts, max_tokens).announce() for dtype in dtypes]


def run_vllm(model: str, dtype: str, workload: Workload, prompts, max_tokens) -> Throughput:
    work = dict(model=model, dtype=dtype, max_model_len=workload.max_model_len, prompts=prompts,
                max_tokens=max_tokens, temperature=workload.temperature)
    # Without a binding vLLM keeps one core for its scheduler process and gives the model one thread.
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_KVCACHE_SPACE="4",
               OMP_NUM_THREADS=str(len(os.sched_getaffinity(0))))
    done = subprocess.run([str(VLLM_PYTHON), str(VLLM_RUNNER)], input=json.dumps(work), env=env, text=True,
                          stdout=subprocess.PIPE, check=True)
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith(VLLM_RESULT_PREFIX))
                        .removeprefix(VLLM_RESULT_PREFIX))
    return Throughput(f"vLLM {dtype}", result["output_tokens"], result["seconds"])


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


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


# Prefix caching --------------------------------------------------------------------------------------


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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# Serving ---------------------------------------------------------------------------------------------


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


async def stream_one(client, prompt: list[int] | str, max_tokens: int) -> tuple[float, list[float], float, int]:
    """One streamed greedy completion: (TTFT, inter-chunk gaps, latency, output tokens)."""
    start = time.perf_counter()
    chunk_times, num_tokens = [], 0
    stream = await client.completions.create(model=None, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
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


# Output ------------------------------------------------------------------------------------------


def print_table(report: dict) -> None:
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


# Structured outputs ----------------------------------------------------------------------------------


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
        compiler = llm.llm_engine.structured_output_manager()
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
           "structured": structured_preset, "serve": serve_preset}


def peer_set(text: str) -> set[str]:
    peers = set(text.split(","))
    if not peers <= {"hf", "vllm"}:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {sorted(peers - {'hf', 'vllm'})}: choose hf, vllm")
    return peers


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if on_gpu() else "cpu")
    parser.add_argument("--model", help="a Hugging Face model folder (default: per preset)")
    parser.add_argument("--compare", type=peer_set, default=set(),
                        help="hf, vllm or hf,vllm: also run transformers and/or vLLM on the same requests")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the preset's dtype")
    parser.add_argument("--small", action="store_true", help="prefix/chunked: the sizes for a CPU (default there)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--num-prompts", type=int, default=32, help="serve: how many requests")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="serve: Poisson arrivals per second")
    parser.add_argument("--max-concurrency", type=int, help="serve: most requests in flight")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = PRESETS[args.preset](args)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return report


if __name__ == "__main__":
    main()
