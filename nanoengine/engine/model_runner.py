"""The model runner: owns the model and the KV cache, turns a scheduled step into one forward pass.

Every scheduled token of every request goes into one flat batch; the
attention metadata says which rows belong to which request and where each
request's blocks are. Logits are computed only for the rows that sample (a
request with k drafts samples at its last k + 1 rows, see spec_decode.py),
and for the prompt rows of requests that ask for prompt logprobs.
"""

import logging
import time
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.config import EngineConfig
from nanoengine.distributed import min_over_ranks, rank_device
from nanoengine.engine.cuda_graphs import capture_decode_graphs
from nanoengine.engine.request import Request
from nanoengine.engine.scheduler import SchedulerOutput
from nanoengine.engine.spec_decode import accepted_run
from nanoengine.engine.structured_output import GrammarBitmask, apply_bitmask
from nanoengine.layers.attention import Attention
from nanoengine.layers.sampler import SamplingTensors, apply_logit_bias, apply_penalties, sample, top_logprobs
from nanoengine.models import model_class_for
from nanoengine.platforms import platform_for

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step sampled: one entry per scheduled request that sampled, in schedule order."""

    requests: list[Request]
    token_ids: list[list[int]]  # the tokens each emits: its accepted drafts, then one sampled token
    num_drafts: list[int]  # how many drafts each carried
    # With logprobs requested: per request, per emitted token (logprob, rank, top ids, top logprobs).
    logprobs: list[list[tuple[float, int, list[int], list[float]]]] | None = None
    # Per request that asked for prompt logprobs and computed prompt rows: (request, rows as above).
    prompt_logprobs: list[tuple[Request, list[tuple[float, int, list[int], list[float]]]]] = field(
        default_factory=list)


@dataclass
class StepInputs:
    """One step as plain lists, one entry per scheduled request: all that any rank needs to run the model."""

    request_ids: list[str]
    token_ids: list[list[int]]  # the tokens computed this step
    starts: list[int]  # the position of each request's first new token
    block_tables: list[list[int]]
    samples: list[bool]  # True when the request's whole context is in after this step: it samples
    # (first position, count) of the rows whose logits give prompt logprobs; (0, 0) for none.
    prompt_rows: list[tuple[int, int]]
    num_drafts: list[int]  # the last num_drafts token_ids are drafts: a sampling request samples at 1 + that

    @classmethod
    def of(cls, step: SchedulerOutput) -> "StepInputs":
        inputs = cls([], [], [], [], step.samples(), [], [len(d) for d in step.drafts])
        for request, num_new, drafts in zip(step.requests, step.num_new_tokens, step.drafts):
            start = request.num_computed_tokens
            inputs.request_ids.append(request.request_id)
            inputs.token_ids.append(request.all_token_ids[start:start + num_new - len(drafts)] + drafts)
            inputs.starts.append(start)
            inputs.block_tables.append(request.block_ids)
            inputs.prompt_rows.append(prompt_rows(request, start, num_new))
        return inputs


def prompt_rows(request: Request, start: int, num_new: int) -> tuple[int, int]:
    """The rows of this chunk that predict a prompt token whose logprobs are not recorded yet.

    The row at position q predicts token q + 1. Rows already recorded (before a preemption) are skipped."""
    if request.prompt_logprobs is None:
        return 0, 0
    first = max(start, len(request.prompt_logprobs) - 1)
    return first, max(0, min(start + num_new, request.num_prompt_tokens - 1) - first)


class ModelRunner:
    """One rank's shard of the model and of the KV cache; rank 0's runner also samples."""

    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.device = rank_device(config.device, rank, config.tensor_parallel_size, config.ranks_per_node)
        self.block_size = config.kvcache_block_size
        self.kv_cache_dtype = torch.int8 if config.kv_cache_dtype == "int8" else config.torch_dtype
        # What the device adds to the plain model: on the CPU, its C++ kernels (platforms/cpu/).
        self.platform = platform_for(self.device, config.attention_backend, config.quantization)
        self.backend = self.platform.attention_backend(config.attention_backend)
        self.model = self.build_model()
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.platform.warm_up(self)
        self.fast_path = self.capture_fast_path()

    def capture_fast_path(self):
        """What runs the steps it can faster than the model's forward (``can_run(meta)``, ``run(...)``): CUDA
        graphs for decode steps on a GPU, the decoder layers in one C++ call on the CPU; or None."""
        if self.device.type == "cuda":
            return capture_decode_graphs(self.model, self.config, self.device)
        return self.platform.fast_path(self.model)

    def build_model(self) -> torch.nn.Module:
        hf_config = self.config.hf_config
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.config.torch_dtype)
        try:
            with torch.device(self.device):
                model = model_class_for(hf_config)(hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        self.platform.load_weights(model, self.config)
        self.platform.prepare_model(model)
        self.weight_bytes = weight_bytes(model)
        logger.info("model weights: %.1f MiB (%s)", self.weight_bytes / 2**20, self.config.model)
        return model.eval()

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def allocate_kv_cache(self) -> int:
        layers = self.attention_layers()
        first = layers[0]
        bytes_per_block = self.bytes_per_block(self.kv_cache_dtype)
        num_blocks = self.config.num_kvcache_blocks or self.blocks_that_fit(bytes_per_block)
        num_blocks = min_over_ranks(num_blocks, self.device)  # every rank's cache holds the same block ids
        if num_blocks < 1:
            raise ValueError("no memory is left for the KV cache: lower max_num_batched_tokens, "
                             "raise gpu_memory_utilization, or set num_kvcache_blocks")
        shape = (2, len(layers), num_blocks, self.block_size, first.num_kv_heads, first.head_dim)
        quantized = self.kv_cache_dtype == torch.int8
        # zeros(), not empty(), on the CPU too (as vLLM does): every page of the cache is faulted in now, at
        # start, not on its first write in the middle of a step (a page fault costs microseconds on a VM), and a
        # cache larger than the free memory shows at start.
        start = time.perf_counter()
        self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
        self.kv_scales = torch.zeros(shape[:-1] if quantized else (2, len(layers), 0), dtype=torch.float32,
                                     device=self.device)
        details = f", zeroed in {time.perf_counter() - start:.2f} s" if self.device.type == "cpu" else ""
        if quantized:
            gain = self.bytes_per_block(self.config.torch_dtype) / bytes_per_block
            details += (f"; int8 with float32 scales: {gain:.2f}x the blocks of {self.config.torch_dtype} "
                        "in the same memory")
        gib = (self.kv_cache.nbytes + self.kv_scales.nbytes) / 2**30
        logger.info("KV cache: %d blocks, %.2f GiB%s", num_blocks, gib, details)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            layer.k_scale, layer.v_scale, layer.backend = self.kv_scales[0, i], self.kv_scales[1, i], self.backend
        return num_blocks

    def bytes_per_block(self, cache_dtype: torch.dtype) -> int:
        """A block's bytes over every layer, K and V; an int8 cache also holds a float32 scale per token and KV
        head."""
        layers = self.attention_layers()
        bytes_per_head = layers[0].head_dim * cache_dtype.itemsize + (4 if cache_dtype == torch.int8 else 0)
        return 2 * len(layers) * self.block_size * layers[0].num_kv_heads * bytes_per_head

    def blocks_that_fit(self, bytes_per_block: int) -> int:
        # Never more than every sequence at full length could use.
        useful = self.config.max_num_seqs * -(-self.config.max_model_len // self.block_size)
        if self.device.type == "cpu":
            return min(useful, int(self.config.cpu_kvcache_space_gib * 2**30) // bytes_per_block)
        return min(useful, self.gpu_bytes_left() // bytes_per_block)

    def gpu_bytes_left(self) -> int:
        """Memory that the KV cache may take: the budget minus the weights and a full step's peak activations."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_dummy_step(self.config.max_num_batched_tokens)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - used_by_others
        return int(budget - torch.cuda.max_memory_allocated(self.device))

    @torch.inference_mode()
    def run_dummy_step(self, num_tokens: int, forward=None) -> None:
        """One forward pass over ``num_tokens`` tokens of fresh sequences (through ``forward``, the model's by
        default), then the logits of ``max_num_seqs`` rows (a token each), with writes to the cache discarded:
        its peak memory is a step's."""
        input_ids, positions, meta = self.dummy_inputs(num_tokens)
        hidden = (forward or self.model)(input_ids, positions, meta)
        logits = self.model.compute_logits(hidden[:min(num_tokens, self.config.max_num_seqs)])
        if logits is not None:  # on rank 0
            logits.float()  # as sample_step takes them

    def dummy_inputs(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``num_tokens`` tokens of fresh sequences whose block tables point at block 0, read and never written
        (every slot is -1); without a cache yet, each layer gets one block of zeros."""
        seq_len = min(num_tokens, self.config.max_model_len)
        num_seqs = -(-num_tokens // seq_len)
        lens = [seq_len] * (num_seqs - 1) + [num_tokens - seq_len * (num_seqs - 1)]
        starts = [0, *accumulate(lens)]
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros((num_seqs, -(-seq_len // self.block_size)), dtype=torch.int32,
                                     device=self.device),
            max_query_len=max(lens), max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=lens)
        for layer in self.attention_layers():
            if not layer.k_cache.numel():
                layer.k_cache = layer.v_cache = torch.zeros(1, self.block_size, layer.num_kv_heads, layer.head_dim,
                                                            dtype=self.kv_cache_dtype, device=self.device)
                layer.k_scale = layer.v_scale = torch.zeros(
                    (1, self.block_size, layer.num_kv_heads) if self.kv_cache_dtype == torch.int8 else (0,),
                    dtype=torch.float32, device=self.device)
                layer.backend = self.backend
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        return input_ids, torch.zeros_like(input_ids), meta

    def close(self) -> None:
        for layer in self.attention_layers():
            layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = torch.empty(0)
        self.kv_cache = self.kv_scales = torch.empty(0)
        self.fast_path = None

    # One step ------------------------------------------------------------------------------------

    def sample_step(self, step: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor,
                    grammar_bitmask: GrammarBitmask | None = None) -> StepResult:
        """Sample the step from the logits ``forward`` gave for ``inputs``; ``grammar_bitmask`` constrains the
        structured requests' rows."""
        sampling = [(r, d) for r, d, samples in zip(step.requests, step.drafts, inputs.samples) if samples]
        num_rows = sum(1 + len(d) for _, d in sampling)
        logits = logits.float()
        result = self.sample(logits[:num_rows], [r for r, _ in sampling], [d for _, d in sampling],
                             grammar_bitmask)
        result.prompt_logprobs = self.prompt_logprobs(logits[num_rows:], step.requests, inputs)
        return result

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of the rows that sample, then of the prompt rows; None on tensor-parallel workers."""
        input_ids, positions, meta, logit_rows = self.prepare_inputs(inputs)
        if self.fast_path is not None and self.fast_path.can_run(meta):
            hidden = self.fast_path.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden[logit_rows])

    def prepare_inputs(self, inputs: StepInputs):
        input_ids, seq_lens, query_start_loc, logit_rows = [], [], [0], []
        for token_ids, start, samples, num_drafts in zip(inputs.token_ids, inputs.starts, inputs.samples,
                                                         inputs.num_drafts):
            input_ids.extend(token_ids)
            seq_lens.append(start + len(token_ids))
            query_start_loc.append(query_start_loc[-1] + len(token_ids))
            if samples:
                logit_rows.extend(range(query_start_loc[-1] - 1 - num_drafts, query_start_loc[-1]))
        max_blocks = max(len(b) for b in inputs.block_tables)
        block_table = torch.tensor([b + [-1] * (max_blocks - len(b)) for b in inputs.block_tables],
                                   dtype=torch.int32)
        query_lens = [len(t) for t in inputs.token_ids]
        row_owner = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
        positions = (torch.arange(len(input_ids)) - torch.tensor(query_start_loc[:-1])[row_owner]
                     + torch.tensor(inputs.starts)[row_owner])
        slot_mapping = (block_table[row_owner, positions // self.block_size].long() * self.block_size
                        + positions % self.block_size)
        meta = AttentionMetadata(
            slot_mapping=self.to_device(slot_mapping),
            query_start_loc=self.to_device(torch.tensor(query_start_loc, dtype=torch.int32)),
            seq_lens=self.to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=self.to_device(block_table),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens, num_drafts=inputs.num_drafts)
        for (first, count), start, row0 in zip(inputs.prompt_rows, inputs.starts, query_start_loc):
            logit_rows.extend(range(row0 + first - start, row0 + first - start + count))
        return (self.to_device(torch.tensor(input_ids)), self.to_device(positions), meta,
                self.to_device(torch.tensor(logit_rows, dtype=torch.int64)))

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def sample(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
               grammar_bitmask: GrammarBitmask | None = None) -> StepResult:
        """Sample every row as plain decoding would (a request's row j sees its drafts before j as output),
        then keep each request's accepted run."""
        rows = [(r, j, d[:j]) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
        params = [r.params for r, _, _ in rows]
        tensors = SamplingTensors(
            temperatures=self.to_device(torch.tensor([p.temperature for p in params], dtype=torch.float32)),
            top_ks=self.to_device(torch.tensor([p.top_k for p in params], dtype=torch.int64)),
            top_ps=self.to_device(torch.tensor([p.top_p for p in params], dtype=torch.float32)),
            min_ps=self.to_device(torch.tensor([p.min_p for p in params], dtype=torch.float32)),
            generators=[r.generator_at(r.num_output_tokens + j) for r, j, _ in rows],
            all_greedy=all(p.greedy for p in params),
            any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
            any_min_p=any(p.min_p > 0 for p in params))
        processed = apply_logit_bias(ban_stop_tokens_before_min_tokens(logits, rows), [p.logit_bias for p in params])
        if any(p.has_penalties for p in params):
            processed = apply_penalties(
                processed, [r.prompt_token_ids for r, _, _ in rows], [r.output_token_ids + d for r, _, d in rows],
                *(self.to_device(torch.tensor([getattr(p, name) for p in params], dtype=torch.float32))
                  for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")))
        if grammar_bitmask is not None:
            if processed is logits and any(p.logprobs is not None for p in params):
                processed = processed.clone()  # logprobs stay the raw model's
            apply_bitmask(processed, grammar_bitmask)
        tokens = sample(processed, tensors, self.generator, self.platform.argmax)
        sampled, starts = tokens.tolist(), list(accumulate((1 + len(d) for d in drafts), initial=0))
        runs = [accepted_run(d, sampled[start:start + len(d) + 1]) for d, start in zip(drafts, starts)]
        result = StepResult(requests, runs, [len(d) for d in drafts])
        num_top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if num_top is not None:
            # Raw model logprobs, as vLLM reports them: before min_tokens' ban, the grammar and the temperature.
            chosen, ranks, top_values, top_ids = top_logprobs(logits, tokens, num_top)
            per_row = list(zip(chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist()))
            result.logprobs = [per_row[start:start + len(run)] for start, run in zip(starts, runs)]
        return result

    def prompt_logprobs(self, logits: torch.Tensor, requests: list[Request], inputs: StepInputs) -> list:
        """Raw logprobs of the prompt rows (the logits after the sampling rows), per request that has some."""
        results, row = [], 0
        for request, (first, count) in zip(requests, inputs.prompt_rows):
            if count:
                targets = torch.tensor(request.prompt_token_ids[first + 1:first + 1 + count], device=logits.device)
                chosen, ranks, top_values, top_ids = top_logprobs(logits[row:row + count], targets,
                                                                  request.params.prompt_logprobs)
                results.append((request, list(zip(chosen.tolist(), ranks.tolist(), top_ids.tolist(),
                                                  top_values.tolist()))))
                row += count
        return results


def ban_stop_tokens_before_min_tokens(logits: torch.Tensor, rows: list[tuple[Request, int, list[int]]]
                                      ) -> torch.Tensor:
    """The logits with the stop tokens of rows still short of min_tokens masked (a copy, if any are); row
    (request, j, drafts) samples the request's output token num_output_tokens + j.

    A structured request whose output already matches its whole grammar is not held back: the grammar may
    allow nothing but a stop token, and a row must never be all -inf. (Such a request drafts nothing while
    short of min_tokens, so its matcher's state is that of its only row.)
    """
    bans = [(row, list(r.stop_token_ids)) for row, (r, j, _) in enumerate(rows)
            if r.num_output_tokens + j < r.params.min_tokens and r.stop_token_ids
            and not (r.matcher is not None and r.matcher.is_completed())]
    if not bans:
        return logits
    logits = logits.clone()
    for row, stop_token_ids in bans:
        logits[row, stop_token_ids] = float("-inf")
    return logits


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes the model's weights hold, quantized weights' scales (and minimums) included, each tensor once (a
    tied LM head is its embeddings)."""
    tensors = {t.data_ptr(): t for module in model.modules()
               for t in (*module.parameters(recurse=False), getattr(module, "weight_scale", None),
                         getattr(module, "weight_min", None)) if t is not None}
    return sum(t.nbytes for t in tensors.values())
