"""Batched sampling: greedy, temperature, top-k, top-p and min-p, with optional per-request seeds.

Sampling draws ``argmax(probs / noise)`` with exponential noise, which picks
token i with probability ``probs[i]``. A seeded request draws its noise row
from its own generator, so its tokens do not depend on the rest of the batch.
"""

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [rows] float32, 0 = greedy
    top_ks: torch.Tensor        # [rows] int64, <= 0 = off
    top_ps: torch.Tensor        # [rows] float32, 1 = off
    min_ps: torch.Tensor        # [rows] float32, 0 = off
    generators: list[torch.Generator | None]  # per row: the request's own generator, or None
    # Decided on the host, so the device never has to be asked:
    all_greedy: bool
    any_top_k_or_p: bool
    any_min_p: bool


def sample(logits: torch.Tensor, t: SamplingTensors, generator: torch.Generator) -> torch.Tensor:
    """logits: [rows, vocab] float32. Returns [rows] int64 token ids."""
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    temperatures = torch.where(t.temperatures > 0, t.temperatures, 1.0)
    probs = torch.softmax(truncate(logits / temperatures.unsqueeze(1), t), dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, row_generator in enumerate(t.generators):
        if row_generator is not None:
            noise[row] = torch.empty(probs.shape[1]).exponential_(generator=row_generator).to(probs.device)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(t.temperatures > 0, sampled, greedy)


def truncate(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, top-p and min-p rule out."""
    if t.any_top_k_or_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1], device=logits.device).expand_as(logits)
        top_ks = torch.where(t.top_ks > 0, t.top_ks, logits.shape[1]).unsqueeze(1)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the best token always stays
        drop = (rank >= top_ks) | (mass_before >= t.top_ps.unsqueeze(1))
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if t.any_min_p:
        probs = logits.softmax(dim=-1)
        floor = t.min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int):
    """Each row's sampled-token logprob and rank, and its ``num_top`` most likely tokens (raw model logprobs)."""
    logprobs = logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], tokens[:, None][:, :0])
    return sampled, ranks, top_values, top_ids
