"""What one step's attention needs to know about the flattened batch.

The model runner flattens every scheduled token of every request into one
varlen batch. Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
those rows are the *last* ``query_len`` tokens of its context, whose full
length after this step is ``seq_lens[i]``. Query row ``j`` of request ``i``
therefore sits at position ``seq_lens[i] - query_len + j`` and sees the
context tokens ``0 ..= that position``, read through ``block_tables[i]``.
"""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [num_tokens] int64: cache slot of each new token, -1 = padding
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor         # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32: physical block ids, -1 = unused
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends can plan without a device-to-host sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_drafts: list[int] | None = None  # per request: how many of its query rows are speculative drafts

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
