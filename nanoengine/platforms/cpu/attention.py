"""Paged attention tuned for the CPU: the contract of ``attention/torch_backend.py``, faster.

- Decodes (one query row per request) go to a small C++ kernel, ``csrc/cpu_decode.cpp``, that reads each K and
  V byte of the paged cache once, in float32 arithmetic whatever the cache's dtype. So do decodes with
  speculative drafts (up to 8 query rows): each row is a decode of its own, over the context up to its
  position, computed as the decode without drafts would compute it.
- Other requests (prompts and prompt chunks) go to ``prefill_attention`` (``csrc/cpu_prefill.cpp``): flash
  attention over the paged cache, the query heads of each KV head stacked as the rows of one small GEMM, scores
  and softmax in float32; in bfloat16 on a CPU with AVX512-BF16 it multiplies in bfloat16 pairs (SDPA's flash
  kernel multiplies bfloat16 far below a bfloat16 GEMM's rate there: docs/cpu.md has the figures).
- New K and V rows go into the cache through the extension's ``store_kv`` (one pass, no index_put and no
  padding check in torch ops).
- An int8 cache (docs/kv-cache-quantization.md): ``store_kv`` quantizes each token's head vector as the oracle
  does, to the same bytes; both kernels read 8 bits and widen them in registers.
- Without the extension (no C++ compiler) every request takes one SDPA call: correct, but several times slower,
  and torch_backend's store_kv.

Each ``CpuBackend`` plans a step's decode rows and prompts once (every layer gets the same metadata object),
so two engines in one process share nothing. Tested against the oracle in tests/test_cpu_attention.py.
"""

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from nanoengine.attention import load_backend as load_plain_backend
from nanoengine.attention import torch_backend
from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.attention.torch_backend import gather_context
from nanoengine.platforms.cpu.build import load_cpu_kernels

KERNEL_MAX_QUERY_ROWS = 8  # a decode with up to this many rows (itself and its drafts) goes to the kernel


def load_backend(name: str):
    """The attention backend ``name`` for a CPU run: a fresh ``CpuBackend`` for "cpu" (it plans per step, so
    engines share none), else the plain backend's module."""
    return CpuBackend(load_cpu_kernels()) if name == "cpu" else load_plain_backend(name)


@dataclass
class DecodePlan:
    rows: torch.Tensor          # [num_rows] int64: the query rows the kernel attends
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32: each row's request's block table
    seq_lens: torch.Tensor      # [num_rows] int32: the context each row sees (up to its own position)
    by_request: list[bool]      # per request: are its rows in the kernel's

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """What decode_attention takes after q and the caches."""
        return self.block_tables, self.seq_lens, self.rows


@dataclass
class PrefillPlan:  # the other requests, for prefill_attention: int32, one entry per request
    block_tables: torch.Tensor  # [num_prompts, max_blocks]
    first_rows: torch.Tensor    # each prompt's first query row
    query_lens: torch.Tensor
    seq_lens: torch.Tensor

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """What prefill_attention takes after q and the caches."""
        return self.block_tables, self.first_rows, self.query_lens, self.seq_lens


class CpuBackend:
    def __init__(self, kernels: ModuleType | None):
        self.kernels = kernels  # the C++ extension (decode_attention, prefill_attention, the layers' ops), or None
        self.planned: tuple[AttentionMetadata | None, DecodePlan | None, PrefillPlan | None] = (None, None, None)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        (self.kernels or torch_backend).store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
        """Causal attention of every query row ([num_tokens, num_heads, head_dim]) over its own context."""
        out = torch.empty(q.shape, dtype=q.dtype)
        if self.kernels is None:
            starts = meta.query_start_loc_cpu
            for i, seq_len in enumerate(meta.seq_lens_cpu):
                rows = slice(starts[i], starts[i + 1])
                # An int8 cache's context comes back dequantized to float32; SDPA takes q's dtype.
                k = gather_context(k_cache, meta.block_tables[i], seq_len, k_scale).to(q.dtype)
                v = gather_context(v_cache, meta.block_tables[i], seq_len, v_scale).to(q.dtype)
                out[rows] = flash_attend(q[rows], k, v, seq_len - (starts[i + 1] - starts[i]), scale)
            return out
        decodes, prompts = self.decode_plan(meta), self.prefill_plan(meta)
        caches = (k_cache, v_cache, k_scale, v_scale)
        if decodes is not None:
            self.kernels.decode_attention(q, *caches, *decodes.kernel_args(), scale, out)
        if prompts is not None:
            self.kernels.prefill_attention(q, *caches, *prompts.kernel_args(), scale, out)
        return out

    def decode_plan(self, meta: AttentionMetadata) -> DecodePlan | None:
        """The query rows of requests with few of them, each with its request and the context it sees, for the
        kernel; None where there are none or no kernel."""
        self.plan(meta)
        return self.planned[1]

    def prefill_plan(self, meta: AttentionMetadata) -> PrefillPlan | None:
        """The other requests, for prefill_attention; None where there are none or no kernel."""
        self.plan(meta)
        return self.planned[2]

    def plan(self, meta: AttentionMetadata) -> None:
        if self.planned[0] is not meta:
            starts = meta.query_start_loc_cpu
            rows, owners, rows_after = [], [], []  # rows_after: the owner's query rows after this one
            by_request = [starts[i + 1] - starts[i] == 1 + (meta.num_drafts[i] if meta.num_drafts else 0)
                          <= KERNEL_MAX_QUERY_ROWS for i in range(meta.num_seqs)]
            for i in range(meta.num_seqs):
                query_len = starts[i + 1] - starts[i]
                if by_request[i]:
                    rows += range(starts[i], starts[i + 1])
                    owners += [i] * query_len
                    rows_after += range(query_len - 1, -1, -1)
            plan = prompts = None
            if rows and self.kernels is not None:
                # The device lengths, not the host ones: a CUDA-graph-style padded step sets only the former.
                index = torch.tensor(owners)
                plan = DecodePlan(torch.tensor(rows), meta.block_tables[index].contiguous(),
                                  meta.seq_lens[index] - torch.tensor(rows_after, dtype=torch.int32), by_request)
            others = [i for i in range(meta.num_seqs) if not by_request[i]]
            if others and self.kernels is not None:
                index = torch.tensor(others)
                prompts = PrefillPlan(meta.block_tables[index].contiguous(), meta.query_start_loc[index],
                                      meta.query_start_loc[index + 1] - meta.query_start_loc[index],
                                      meta.seq_lens[index])
            self.planned = (meta, plan, prompts)


def flash_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """Query rows at positions first_pos.. over keys 0..; each KV head serves its group of query heads."""
    # [1, heads, tokens, head_dim]: with a batch dimension the CPU takes its flash kernel, not the math path.
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if first_pos == 0:  # a whole prompt: the plain causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = first_pos + torch.arange(q.shape[2], device=q.device)
        visible = torch.arange(k.shape[2], device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
