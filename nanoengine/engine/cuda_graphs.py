"""CUDA graphs for decode-only steps.

A decode step runs a few hundred small kernels over a handful of tokens, so on a GPU launching them
costs more than running them. For each batch size of a ladder (1, 2, 4, 8, then every 16 up to
``max_num_seqs``) the model's forward pass is captured once into a CUDA graph that reads fixed input
buffers. A step whose requests all compute exactly one token copies its inputs into those buffers,
pads them to the next captured size and replays that graph. Padding rows store no KV (slot -1) and
attend to one key (seq_len 1) through whatever block ids an earlier, larger batch left in their table
rows: stale but valid ids, read and then dropped from the output.

Backends plan their launch grids from the metadata's host values, which a graph freezes at capture;
so graphs are captured with every context at ``max_model_len`` (the worst case), and the kernels
read the real lengths from the device buffers at replay.
"""

import bisect
from dataclasses import dataclass

import torch
from torch import nn

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.config import EngineConfig


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    small = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` requests, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """The inputs every graph reads, sized for the largest batch; a smaller graph reads their heads."""

    input_ids: torch.Tensor      # [max_batch] int64
    positions: torch.Tensor      # [max_batch] int64
    slot_mapping: torch.Tensor   # [max_batch] int64, -1 on padding rows
    query_start_loc: torch.Tensor  # [max_batch + 1] int32: 0, 1, 2, ... (one query token per request)
    seq_lens: torch.Tensor       # [max_batch] int32, 1 on padding rows
    block_tables: torch.Tensor   # [max_batch, max_blocks_per_seq] int32

    @classmethod
    def allocate(cls, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> "DecodeBuffers":
        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(input_ids=zeros(max_batch, dtype=torch.int64), positions=zeros(max_batch, dtype=torch.int64),
                   slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
                   query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
                   seq_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
                   block_tables=zeros(max_batch, max_blocks_per_seq, dtype=torch.int32))

    def inputs(self, batch_size: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of a padded batch, as views of the buffers; the host values
        say that every request is ``max_seq_len`` tokens long."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size], query_start_loc=self.query_start_loc[:batch_size + 1],
            seq_lens=self.seq_lens[:batch_size], block_tables=self.block_tables[:batch_size],
            max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(batch_size + 1)), seq_lens_cpu=[max_seq_len] * batch_size)
        return self.input_ids[:batch_size], self.positions[:batch_size], meta

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             batch_size: int) -> None:
        """Copy one decode step's inputs in; rows past its requests up to ``batch_size`` become padding."""
        n = meta.num_seqs
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:batch_size].fill_(-1)  # stale slots of an earlier, larger batch would overwrite KV
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:batch_size].fill_(1)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)


class DecodeGraphs:
    """One captured forward pass per batch size of the ladder, all reading the same buffers."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], -(-max_model_len // block_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # the largest first: the smaller graphs reuse its memory pool
            inputs = self.buffers.inputs(size, self.max_model_len)
            self.model(*inputs)  # outside the capture: compiles this size's kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*inputs)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return meta.max_query_len == 1 and meta.num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states of a decode step, [num_seqs, hidden_size]."""
        size = padded_batch_size(meta.num_seqs, self.sizes)
        self.buffers.load(input_ids, positions, meta, size)
        self.graphs[size].replay()
        return self.outputs[size][:meta.num_seqs]


def capture_decode_graphs(model: nn.Module, config: EngineConfig, device: torch.device) -> DecodeGraphs | None:
    """Graphs for a CUDA run of the Triton backend, unless ``enforce_eager``; None otherwise.

    The torch and cpu backends loop over requests on the host, which a graph cannot replay.
    """
    if device.type != "cuda" or config.enforce_eager or config.attention_backend != "triton":
        return None
    graphs = DecodeGraphs(model, config.max_num_seqs, config.max_model_len, config.kvcache_block_size, device)
    graphs.capture()
    return graphs
