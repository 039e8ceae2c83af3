"""Token embedding and LM head, split over ranks by vocabulary range."""

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.distributed import all_reduce, divide, gather_on_rank0, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.shard_size = divide(vocab_size, tp_size(), "vocab_size")
        self.vocab_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        mine = (local_ids >= 0) & (local_ids < self.shard_size)
        embeds = F.embedding(local_ids.clamp(0, self.shard_size - 1), self.weight)
        return all_reduce(embeds * mine.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the rows that need sampling; rank 0 gets the full vocabulary, others None."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_on_rank0(F.linear(hidden, self.weight), dim=-1)
