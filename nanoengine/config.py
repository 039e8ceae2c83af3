"""EngineConfig: every engine knob in one place, validated once."""

import os
from dataclasses import dataclass, field, fields

import torch
from gguf import GGUFReader
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from nanoengine.distributed import ENV_VARIABLES, divide, env_rank
from nanoengine.sampling_params import check_number, check_text
from nanoengine.utils.gguf_file import gguf_config, is_gguf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The linear layers' and LM head's weights in int8, or 4-bit in groups, on the CPU (docs/quantization.md)
QUANTIZATIONS = ("int8", "int4")
POLICIES = ("fcfs", "priority")
HASH_ALGOS = ("xxhash", "sha256")  # the prefix cache's block hash (engine/block_manager.py)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
KV_CACHE_DTYPES = ("auto", "int8")
NODE_LOCAL_OPTIONS = {"model", "tokenizer", "node_rank", "master_addr", "master_port", "trace"}
CACHE_SIZE_OPTIONS = {"num_kvcache_blocks", "gpu_memory_utilization", "cpu_kvcache_space_gib"}
DEFAULT_MAX_NUM_SEQS = 256
# A step's token budget when none is given: vLLM's for its LLM class. On the CPU its smaller steps are also the
# faster (the matmul kernels lose speed at 8192 rows; docs/cpu.md has the figures).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 4096}
# The generation_config.json fields that become a request's defaults when it passes no SamplingParams (as vLLM).
GENERATION_DEFAULTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                       "top_p", "min_p", "max_new_tokens")


@dataclass
class EngineConfig:
    model: str  # a Hugging Face folder, or a GGUF file (its quantized weights run on the CPU)
    tokenizer: str | None = None  # defaults to the model folder (or file)
    dtype: str = "auto"  # "auto" = the checkpoint's dtype; a GGUF file's: float32 or float16 if it says so, else bf16
    quantization: str | None = None  # "int8", "int4": the linear layers' and LM head's weights quantized at load (CPU)
    device: str = "auto"  # "auto" = cuda when available, else cpu
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int | None = None  # None = 256, or max_num_batched_tokens when that is lower (as vLLM)
    max_num_batched_tokens: int | None = None  # None = 8192, or 4096 on the CPU (as vLLM's LLM)
    kvcache_block_size: int = 16
    num_kvcache_blocks: int | None = None  # None = sized from memory (see below)
    gpu_memory_utilization: float = 0.9  # on a GPU: the fraction of its memory the engine may use
    cpu_kvcache_space_gib: float = 4.0  # on the CPU: the KV cache's size in GiB
    kv_cache_dtype: str = "auto"  # "auto" = the model's dtype, or "int8" (docs/kv-cache-quantization.md)
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "xxhash"  # the block hash: "xxhash" (64-bit xxh3) or "sha256"
    seed: int = 0
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap below the step budget
    attention_backend: str = "auto"
    enforce_eager: bool = False  # True: no CUDA graphs
    tensor_parallel_size: int = 1
    nnodes: int = 1  # nodes the tensor-parallel ranks span; node 0 (the head) runs the engine
    node_rank: int = 0  # this node's index; nodes 1.. run workers only (`nanoengine serve --headless`)
    master_addr: str = "127.0.0.1"  # where the head listens for the other ranks
    master_port: int = 0  # 0 = a free port (one node only)
    max_logprobs: int = 20  # the most logprobs (or prompt_logprobs) a request may ask for, as in vLLM
    trace: bool = False  # log what the scheduler decided each step (logger "nanoengine.trace")
    generation_config: str = "auto"  # sampling defaults from: "auto" the model, "vllm" none, or a folder
    speculative_config: dict | None = None  # {"method": "ngram", ...}: see SpeculativeConfig
    hf_config: PretrainedConfig = field(init=False, repr=False)
    speculative: "SpeculativeConfig | None" = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False, repr=False)
    gguf_reader: GGUFReader | None = field(init=False, repr=False, compare=False, default=None)

    @classmethod
    def from_options(cls, model: str, options: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) for LLM: {', '.join(unknown)}")
        return cls(model=model, **options)

    def __post_init__(self):
        if not isinstance(self.model, str | os.PathLike):
            raise TypeError(f"model must be a path to a Hugging Face model folder or a GGUF file, got "
                            f"{type(self.model).__name__}")
        self.model = os.fspath(self.model)
        if is_gguf(self.model):
            self.hf_config = gguf_config(self.gguf())
        elif os.path.isfile(os.path.join(self.model, "config.json")):
            self.hf_config = AutoConfig.from_pretrained(self.model)
        else:
            raise FileNotFoundError(f"model: no config.json in {self.model!r} (nor is it a .gguf file)")
        self.tokenizer = self.tokenizer or self.model
        self.device = self.resolved_device()
        self.torch_dtype = self.resolved_dtype()
        self.max_model_len = self.resolved_max_model_len()
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device.split(":")[0]]
        check_number("max_num_batched_tokens", self.max_num_batched_tokens, int, low=1)
        if self.max_num_seqs is None:
            self.max_num_seqs = min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        for name in ("max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "tensor_parallel_size"):
            check_number(name, getattr(self, name), int, low=1)
        check_number("long_prefill_token_threshold", self.long_prefill_token_threshold, int, low=0)
        check_number("seed", self.seed, int)
        check_number("max_logprobs", self.max_logprobs, int, low=0)
        if self.num_kvcache_blocks is not None:
            check_number("num_kvcache_blocks", self.num_kvcache_blocks, int, low=1)
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, (int, float), low=0, high=1)
        check_number("cpu_kvcache_space_gib", self.cpu_kvcache_space_gib, (int, float), low=0)
        for name in ("enable_prefix_caching", "enforce_eager", "trace"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running request needs a token each step")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(str(self.generation_config)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {sorted(HASH_ALGOS)}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        self.attention_backend = resolve_backend(self.attention_backend, self.device)
        check_kv_cache_dtype(self.kv_cache_dtype)
        self.check_tensor_parallel()
        self.speculative = None if self.speculative_config is None else SpeculativeConfig.of(self.speculative_config)
        check_quantization(self.quantization, self.device, self.attention_backend)
        if (is_gguf(self.model) or self.quantization == "int4") and (self.device != "cpu" or
                                                                    self.tensor_parallel_size > 1):
            raise ValueError(f"{'a GGUF file' if is_gguf(self.model) else 'quantization=int4'} runs on the CPU on one "
                             f"rank (its 4-bit and int8 weights are the CPU's), got device={self.device!r}, "
                             f"tensor_parallel_size={self.tensor_parallel_size}")

    def gguf(self) -> GGUFReader:
        """The model's GGUF file, parsed once per process: the config, the tokenizer and the weights all read it."""
        if self.gguf_reader is None:
            self.gguf_reader = GGUFReader(self.model)
        return self.gguf_reader

    def __getstate__(self) -> dict:
        # A pickled reader would carry the whole file (its memory map pickles as bytes): the process that receives
        # this config (a server's engine core) parses the file itself.
        return self.__dict__ | {"gguf_reader": None}

    def default_sampling_params(self) -> dict:
        """The sampling fields that generation_config.json sets, with max_new_tokens named max_tokens."""
        if self.generation_config == "vllm":
            return {}
        folder = self.model if self.generation_config == "auto" else self.generation_config
        try:
            generation = self.model_generation_config() if folder == self.model else GenerationConfig.from_pretrained(
                folder)
        except OSError:  # no generation_config.json: vLLM reads the model's config.json instead
            generation = GenerationConfig.from_model_config(self.hf_config if folder == self.model else {})
        given = generation.to_diff_dict()
        defaults = {name: given[name] for name in GENERATION_DEFAULTS if given.get(name) is not None}
        if "max_new_tokens" in defaults:
            defaults["max_tokens"] = defaults.pop("max_new_tokens")
        return defaults

    def model_generation_config(self) -> GenerationConfig:
        """The model's generation_config.json (OSError where it has none), or what a GGUF file's metadata implies."""
        if is_gguf(self.model):
            return GenerationConfig.from_model_config(self.hf_config)
        return GenerationConfig.from_pretrained(self.model)

    def check_tensor_parallel(self) -> None:
        """Fail here, before any worker process starts, when the model cannot be split evenly."""
        size = self.tensor_parallel_size
        check_number("nnodes", self.nnodes, int, low=1)
        check_number("node_rank", self.node_rank, int, low=0, high=self.nnodes - 1)
        check_number("master_port", self.master_port, int, low=0, high=65535)
        check_text("master_addr", self.master_addr)
        if size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({size}) is not divisible by nnodes ({self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("master_port: with nnodes > 1 every node must be given the head's port")
        if size > 1 and env_rank() is not None:
            if self.nnodes > 1:
                raise ValueError(f"nnodes: the {'/'.join(ENV_VARIABLES)} variables are set (torchrun?), "
                                 "they place the ranks; leave nnodes and node_rank out")
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(f"tensor_parallel_size ({size}) must equal WORLD_SIZE ({os.environ['WORLD_SIZE']})")
        if size == 1:
            return
        hf = self.hf_config
        split_sizes = {"num_attention_heads": hf.num_attention_heads,
                       "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                       "intermediate_size": hf.intermediate_size, "vocab_size": hf.vocab_size}
        for name, value in split_sizes.items():
            divide(value, size, name)
        if self.device.startswith("cuda"):
            if self.device != "cuda":
                raise ValueError(f"with tensor_parallel_size > 1, device must be 'cuda' (a rank runs on the GPU of "
                                 f"its place on its node), got {self.device!r}")
            if torch.cuda.device_count() < self.ranks_per_node:
                raise ValueError(f"tensor_parallel_size={size} over {self.nnodes} node(s) needs "
                                 f"{self.ranks_per_node} GPUs per node, found {torch.cuda.device_count()}")

    def agreed_options(self, group: str) -> dict:
        """What every member of a group must agree on: the model's config.json and every option but where a node
        finds its files, meets its group and logs. The ranks of a "tensor parallel" group hold one KV cache
        between them, so they agree on its size too; the cores of a "data parallel" server each size their own."""
        local = NODE_LOCAL_OPTIONS | (CACHE_SIZE_OPTIONS if group == "data parallel" else set())
        options = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name not in local}
        model = {k: v for k, v in self.hf_config.to_dict().items() if k[0] != "_" and k != "transformers_version"}
        return options | {"config.json": model}

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def node_ranks(self) -> list[int]:
        """The ranks this process starts: its node's (the first in itself), or under torchrun its own."""
        rank = env_rank()
        if rank is not None and self.tensor_parallel_size > 1:
            return [rank]
        return list(range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node))

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
        return self.device

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
            dtype = DTYPES.get(str(dtype).removeprefix("torch."), torch.float32)
            if self.device == "cpu" and dtype == torch.float16:
                return torch.float32  # fp16 matmuls on the CPU are slow and poorly supported
            return dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]

    def resolved_max_model_len(self) -> int:
        limit = self.hf_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        check_number("max_model_len", self.max_model_len, int, low=2)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return self.max_model_len


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's n-gram (prompt lookup) speculation: propose up to ``num_speculative_tokens`` tokens that followed
    the latest ``prompt_lookup_min``..``prompt_lookup_max``-gram earlier in the request's own tokens."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @classmethod
    def of(cls, options) -> "SpeculativeConfig":
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(options).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if options.get("method") != "ngram":
            raise ValueError(f"speculative_config.method must be 'ngram' (the only method here), "
                             f"got {options.get('method')!r}")
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        # As vLLM: with neither bound given both are 5; with one given the other equals it.
        high = options.get("prompt_lookup_max", options.get("prompt_lookup_min", 5))
        low = options.get("prompt_lookup_min", high)
        values = {"num_speculative_tokens": options["num_speculative_tokens"], "prompt_lookup_max": high,
                  "prompt_lookup_min": low}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        return cls(**values)


def check_quantization(name: str | None, device: str, attention_backend: str) -> None:
    """int8 weights are the CPU extension's (whether this CPU can multiply them shows at load)."""
    if name is not None and name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {name!r}")
    if name is not None and (device != "cpu" or attention_backend != "cpu"):
        raise ValueError(f"quantization={name!r} runs on the CPU with attention_backend='cpu' (its C++ kernels "
                         f"multiply the int8 weights), got device={device!r}, attention_backend={attention_backend!r}")


def check_kv_cache_dtype(name: str) -> None:
    if isinstance(name, str) and name.startswith("fp8"):
        raise ValueError(f"kv_cache_dtype={name!r} is not offered: an fp8 cache misses the accuracy target that an "
                         "int8 cache meets (docs/kv-cache-quantization.md has the perplexities); pass "
                         "kv_cache_dtype='int8' (or 'auto', the model's dtype)")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")


def resolve_backend(name: str, device: str) -> str:
    """The attention backend ``name`` ("auto": cpu on the CPU, triton on CUDA), checked against the device."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.startswith("cuda") else "cpu"
    if name == "cpu" and device.startswith("cuda"):
        raise ValueError('attention_backend="cpu" runs on the CPU only; use "triton" or "torch" on CUDA')
    if name == "triton" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError('attention_backend="triton" on the CPU needs TRITON_INTERPRET=1 in the environment')
    return name
