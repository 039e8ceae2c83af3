"""Paged attention tuned for the CPU: the contract of ``torch_backend``, faster.

- Decodes (one query row per request) go to a small C++ kernel, ``cpu_decode.cpp``, that reads each K and
  V byte of the paged cache once, in float32 arithmetic whatever the cache's dtype. So do decodes with
  speculative drafts (up to 8 query rows): each row is a decode of its own, over the context up to its
  position, computed as the decode without drafts would compute it. It is compiled for this machine on
  first use (about 30 s, then cached), together with the layers' small ops (``layers/cpu_ops.cpp``).
- Other requests (prompts and prompt chunks) go to the same extension's ``prefill_attention``
  (``cpu_prefill.cpp``): flash attention over the paged cache, the query heads of each KV head stacked as the
  rows of one small GEMM, scores and softmax in float32. In bfloat16 on a CPU with AVX512-BF16 it multiplies in
  bfloat16 pairs, about 5x faster than SDPA's flash kernel for a 512-token prompt on a 2-core Zen 5 (SDPA
  multiplies bfloat16 at a tenth of what a bfloat16 GEMM reaches there).
- Without a C++ compiler every request takes one SDPA call: correct, but several times slower.
- New K and V rows go into the cache through the same extension's ``store_kv`` (one pass, no index_put
  and no padding check in torch ops: about 60 us a layer at a decode step), or torch_backend's without it.

Each ``CpuBackend`` plans a step's decode rows and prompts once (every layer gets the same metadata object),
so two engines in one process share nothing. Tested against the oracle in tests/test_cpu_attention.py.
"""

import hashlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from nanoengine.attention import torch_backend
from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.attention.torch_backend import gather_context
from nanoengine.utils.cpu_info import cpu_flags, cpu_model
from nanoengine.utils.default_model import cache_dir

logger = logging.getLogger(__name__)

KERNEL_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_prefill.cpp")] + [
    Path(__file__).parents[1] / "layers" / name for name in ("cpu_ops.cpp", "cpu_linear.cpp", "cpu_decoder.cpp")]
# -march=native: the build is for this CPU only (its folder is named after it). -ffast-math lets the
# compiler vectorize the dot products and exp (glibc's vector exp needs all of it, finite math included).
# -fopenmp: torch's parallel_for splits the (request, KV head) tasks over its threads.
KERNEL_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
KERNEL_MAX_QUERY_ROWS = 8  # a decode with up to this many rows (itself and its drafts) goes to the kernel


def load_cpu_kernels() -> ModuleType | None:
    """The attention kernels and the layers' small ops built for this machine, or None (logged) where they cannot
    be."""
    from torch.utils.cpp_extension import load

    # The sources' paths are in the key: ninja rebuilds whenever they change, so two checkouts sharing one
    # folder would rebuild each other's build at every start.
    machine = f"{cpu_model()} {sorted(cpu_flags())} torch {torch.__version__} python {sys.version_info[:2]}"
    build = cache_dir() / "cpu-kernels" / hashlib.sha1(f"{machine} {KERNEL_SOURCES}".encode()).hexdigest()[:12]
    try:
        if shutil.which("ninja") is None:  # pip's ninja lives beside this interpreter, which may not be on PATH
            import ninja
            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        build.mkdir(parents=True, exist_ok=True)
        # A build killed midway leaves a "lock" file in the folder that stalls the next one: delete it then.
        logger.info("loading the CPU kernels from %s (the first time builds them: about 30 s)", build)
        return load("nanoengine_cpu_kernels", [str(s) for s in KERNEL_SOURCES], extra_cflags=KERNEL_FLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(build))
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("the CPU kernels could not be built (%s); attention takes the slower SDPA path", error)
        return None


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
                 slot_mapping: torch.Tensor) -> None:
        (self.kernels or torch_backend).store_kv(k, v, k_cache, v_cache, slot_mapping)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of every query row ([num_tokens, num_heads, head_dim]) over its own context."""
        out = torch.empty(q.shape, dtype=q.dtype)
        if self.kernels is None:
            starts = meta.query_start_loc_cpu
            for i, seq_len in enumerate(meta.seq_lens_cpu):
                rows = slice(starts[i], starts[i + 1])
                k = gather_context(k_cache, meta.block_tables[i], seq_len)
                v = gather_context(v_cache, meta.block_tables[i], seq_len)
                out[rows] = flash_attend(q[rows], k, v, seq_len - (starts[i + 1] - starts[i]), scale)
            return out
        decodes, prompts = self.decode_plan(meta), self.prefill_plan(meta)
        if decodes is not None:
            self.kernels.decode_attention(q, k_cache, v_cache, *decodes.kernel_args(), scale, out)
        if prompts is not None:
            self.kernels.prefill_attention(q, k_cache, v_cache, *prompts.kernel_args(), scale, out)
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
