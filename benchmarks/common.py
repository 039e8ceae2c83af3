"""What the presets share: the random-token workload, the models it runs on, and our engine's timed run."""

import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nanoengine import LLM, SamplingParams
from nanoengine.engine.model_runner import StepInputs
from nanoengine.platforms.cpu.build import cpu_arch, isa_of
from nanoengine.utils.cpu_info import cpu_model
from nanoengine.utils.default_model import cache_dir, default_model_path

QWEN3_0_6B_SHAPE = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_theta=1000000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA_3_2_1B_SHAPE = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_theta=500000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# ``--model random:NAME``: a model body of a real shape with random weights and SmolLM2's vocabulary size (the CPU
# runs, where a 128k-151k vocabulary's LM head would weigh as much as the body). The gpu preset keeps Qwen3's own.
RANDOM_SHAPES = {"qwen3-0.6b": ("Qwen3Config", QWEN3_0_6B_SHAPE), "llama-3.2-1b": ("LlamaConfig", LLAMA_3_2_1B_SHAPE)}
SMOLLM2_VOCAB = 49152

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

def make_requests(w: Workload, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py recipe: token ids uniform in [0, 10000], the same draws in the same order."""
    random.seed(seed)
    randint = random.randint
    prompts = [[randint(0, 10000) for _ in range(randint(*w.prompt_lens))] for _ in range(w.num_seqs)]
    params = [SamplingParams(temperature=w.temperature, ignore_eos=True, max_tokens=randint(*w.output_lens))
              for _ in range(w.num_seqs)]
    return prompts, params


def random_model(name: str = "qwen3-0.6b", vocab_size: int | None = None) -> str:
    """A checkpoint of RANDOM_SHAPES[name] with random weights (bf16), built once and cached."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name not in RANDOM_SHAPES:
        raise ValueError(f"no random model shape {name!r}: choose one of {sorted(RANDOM_SHAPES)}")
    config_class, shape = RANDOM_SHAPES[name]
    folder = cache_dir() / (f"bench-{name}-random" + ("" if vocab_size is None else f"-vocab{vocab_size}"))
    if (folder / "model.safetensors").is_file():
        return str(folder)
    print(f"bench: building a random {name}-shaped model in {folder} (once)", file=sys.stderr)
    folder.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**dict(shape, vocab_size=vocab_size or shape["vocab_size"]),
                                                     dtype="bfloat16")
        with torch.device("cuda" if on_gpu() else "cpu"):  # random init of 0.6B weights is slow on a CPU
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(temp)
        # SmolLM2's own where its vocabulary is the model's: llama.cpp's converter reads only tokenizers it knows
        tokenizer = (AutoTokenizer.from_pretrained(default_model_path()) if vocab_size == SMOLLM2_VOCAB
                     else byte_level_tokenizer())
        tokenizer.save_pretrained(temp)
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
    """The model a preset runs: ``--model`` (a folder, or random:NAME, see RANDOM_SHAPES), else the random
    Qwen3-0.6B shape on a GPU and SmolLM2 on the CPU."""
    if args.model and args.model.startswith("random:"):
        return random_model(args.model.removeprefix("random:"), SMOLLM2_VOCAB)
    if args.model:
        return args.model
    if args.preset == "gpu" or (args.preset != "cpu" and on_gpu()):
        return random_model()
    return default_model_path()

def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()

# One forward pass as the roofline sees it: per scheduled request (new tokens, context length after the
# step, whether it samples).
Step = list[tuple[int, int, bool]]

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
    del llm.llm_engine.model_executor.execute_model  # the recording wrapper: back to the class's method
    return Throughput("nanoengine", sum(len(o.outputs[0].token_ids) for o in outputs), seconds), steps


def record_steps(llm: LLM) -> list[Step]:
    """From now on, note the shape of each step the executor runs (for the roofline)."""
    executor = llm.llm_engine.model_executor
    execute, steps = executor.execute_model, []

    def recording_execute(scheduled, *args):
        inputs = StepInputs.of(scheduled)
        steps.append([(len(ids), start + len(ids), samples)
                      for ids, start, samples in zip(inputs.token_ids, inputs.starts, inputs.samples)])
        return execute(scheduled, *args)

    executor.execute_model = recording_execute
    return steps

def preset_workload(preset: str, dtype: str | None) -> Workload:
    """The preset's workload in ``dtype``; by default the cpu preset runs in bfloat16 where the CPU has AVX-512
    (our kernels multiply bfloat16 there, natively or widened to float32 in registers) or AMX, else in
    float32."""
    if dtype is None and preset == "cpu" and not set(isa_of(cpu_arch())) & {"avx512f", "amx_bf16"}:
        dtype = "float32"
    return replace(WORKLOADS[preset], dtype=dtype) if dtype else WORKLOADS[preset]

def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return (f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, our kernels for "
            f"-march={cpu_arch()}")

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def text_tokens(tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text's token ids without special tokens, and the BOS id if this tokenizer adds one."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with_specials = tokenizer("a", add_special_tokens=True).input_ids
    bos = tokenizer.bos_token_id
    return ids, bos if bos is not None and with_specials[0] == bos else None


async def stream_one(client, model: str | None, prompt: list[int] | str, max_tokens: int,
                     cache_salt: str | None = None) -> tuple[float, list[float], float, int]:
    """One streamed greedy completion: (TTFT, inter-chunk gaps, latency, output tokens)."""
    start = time.perf_counter()
    chunk_times, num_tokens = [], 0
    salt = {"cache_salt": cache_salt} if cache_salt else {}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True} | salt)
    async for chunk in stream:
        if chunk.choices:
            chunk_times.append(time.perf_counter())
        if chunk.usage:
            num_tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return chunk_times[0] - start, gaps, chunk_times[-1] - start, num_tokens
