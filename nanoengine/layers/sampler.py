"""Batched sampling in vLLM's order: logit bias, penalties; then, for the rows that sample, temperature, min-p,
top-k, top-p.

- Logit bias adds each request's {token id: value} to its logits (greedy rows too).
- Penalties (they change greedy rows too): repetition scales the logits of the
  tokens seen in the prompt or the output (a positive logit is divided by it, a
  negative one multiplied); frequency subtracts its value once per time a token
  was output; presence subtracts its value once if the token was output at all.
- Temperature divides the logits.
- min-p drops the tokens whose probability is below ``min_p`` times the top one's.
- top-k keeps the tokens whose logit is at least the k-th largest (ties at the
  boundary all stay).
- top-p works on what top-k kept, renormalized: going up from the least likely
  token, it drops tokens while their cumulative mass is at most ``1 - top_p``.
  The most likely token always stays.

Sampling inverts each row's cumulative distribution at one uniform draw, which picks token i with
probability ``probs[i]``: one draw a row, where the exponential race (``argmax(probs / noise)``) takes
one a token, 49k a row, several times the cost on a CPU (docs/cpu.md). A seeded request
draws its uniform from its own generator, so its tokens do not depend on the rest of the batch.
"""

from collections.abc import Callable
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


def sample(logits: torch.Tensor, t: SamplingTensors, generator: torch.Generator,
           argmax: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits.argmax(dim=-1)) -> torch.Tensor:
    """logits: [rows, vocab] float32, penalties already applied. Returns [rows] int64 token ids. ``argmax``:
    each row's first largest logit (a platform may bring a faster kernel)."""
    greedy = argmax(logits)
    if t.all_greedy:
        return greedy
    temperatures = torch.where(t.temperatures > 0, t.temperatures, 1.0)
    probs = torch.softmax(truncate(logits / temperatures.unsqueeze(1), t), dim=-1)
    uniform = torch.rand(probs.shape[0], generator=generator, device=probs.device)
    for row, row_generator in enumerate(t.generators):
        if row_generator is not None:
            uniform[row] = torch.rand(1, generator=row_generator).item()
    sampled = invert_cdf(probs, uniform)
    return torch.where(t.temperatures > 0, sampled, greedy)


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability passes ``uniform`` (in [0, 1)) times the row's
    total: token i for a draw in [cdf[i - 1], cdf[i]), so a token of probability 0 is never picked. The
    draw stays below the total, which a draw just under 1 could round up to."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    point = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(1)


def truncate(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) the tokens that min-p, then top-k, then top-p rule out. The temperature is applied."""
    if t.any_min_p:
        probs = logits.softmax(dim=-1)
        floor = t.min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if t.any_top_k_or_p:
        logits = top_k_top_p(logits, t.top_ks, t.top_ps)
    return logits


TOP_P_PART = 1024  # a row with top-p and no top-k looks at its largest logits first: the full sort if they fall short


def top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[1]
    top_ks = torch.where(top_ks > 0, top_ks, vocab_size).clamp(max=vocab_size)
    if logits.device.type == "cpu":  # on a GPU the sort is fast, and the checks would make the host wait
        kept = top_k_top_p_from_top_part(logits, top_ks, top_ps)
        if kept is not None:
            return kept
    ascending, order = logits.sort(dim=-1)
    kth_largest = ascending.gather(1, (vocab_size - top_ks).unsqueeze(1))
    return logits.scatter(1, order, keep_top_k_top_p(ascending, kth_largest, top_ps))


def top_k_top_p_from_top_part(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor | None:
    """The same result from each row's largest logits only (``topk``), or None where that cannot be sure of
    it. Sorting a row of a 49k vocabulary takes many times as long as ``topk`` of 50 on a CPU core.
    The part holds every row's k largest (a row whose ties at its k-th run past it needs more) and, for a
    row with top-p and no top-k, the TOP_P_PART largest, which must hold top_p of the mass: every token below
    them is then dropped, and the mass under the part counts in the cumulative sums above it."""
    vocab_size = logits.shape[1]
    has_k = top_ks < vocab_size
    size = max(int(top_ks[has_k].max()) if has_k.any() else 0, 0 if has_k.all() else TOP_P_PART)
    if size > vocab_size // 4:
        return None
    largest, order = logits.topk(size, dim=-1)
    kth_largest = largest.gather(1, (top_ks.clamp(max=size) - 1).unsqueeze(1))
    kth_largest = torch.where(has_k.unsqueeze(1), kth_largest, float("-inf"))
    if (has_k & ((logits >= kth_largest).sum(dim=-1) > size)).any():  # ties past the part
        return None
    kept = torch.full_like(logits, float("-inf"))
    if has_k.all():
        return kept.scatter(1, order.flip(-1), keep_top_k_top_p(largest.flip(-1), kth_largest, top_ps))
    part_mass = (largest - logits.logsumexp(dim=-1, keepdim=True)).exp().sum(dim=-1)
    untouched = ~has_k & (top_ps >= 1)
    if (~has_k & ~untouched & (part_mass < top_ps)).any():  # too little mass in the part
        return None
    mass_below = torch.where(has_k, 0.0, 1 - part_mass).unsqueeze(1)
    kept = kept.scatter(1, order.flip(-1), keep_top_k_top_p(largest.flip(-1), kth_largest, top_ps, mass_below))
    return torch.where(untouched.unsqueeze(1), logits, kept)


def keep_top_k_top_p(ascending: torch.Tensor, kth_largest: torch.Tensor, top_ps: torch.Tensor,
                     mass_below: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of logits in ascending order (the whole vocabulary, or a top part of it that holds every token
    top-k keeps), with what top-k and then top-p drop set to -inf. ``mass_below``: per row, the probability
    of the tokens under the part, where top-p counts them."""
    ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)  # over top-k's survivors only
    if mass_below is not None:
        mass_up_to = mass_below + (1 - mass_below) * mass_up_to
    drop = mass_up_to <= 1 - top_ps.unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    return ascending.masked_fill(drop, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> torch.Tensor:
    """``logits`` with each row's bias added (a copy, if any row has one)."""
    rows = [row for row, bias in enumerate(biases) for _ in bias or ()]
    if not rows:
        return logits
    token_ids = [token_id for bias in biases for token_id in bias or ()]
    values = [value for bias in biases for value in (bias or {}).values()]
    index = (torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def apply_penalties(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Presence, frequency and repetition penalties (vLLM's definitions, see above); one row per request."""
    output_counts = token_counts(output_ids, logits.shape[1]).to(logits.device)
    seen = (token_counts(prompt_ids, logits.shape[1]).to(logits.device) > 0) | (output_counts > 0)
    scale = torch.where(seen, repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits * (1 / scale), logits * scale)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * (output_counts > 0)


def token_counts(rows: list[list[int]], vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float32: how many times each token occurs in each row's list."""
    return torch.stack([torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size).float()
                        for ids in rows])


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int):
    """Each row's given-token logprob and rank, and its ``num_top`` most likely tokens (raw model logprobs).

    The rank counts the tokens at least as likely as the given one (vLLM's: ties share the worse rank)."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    ranks = (logprobs >= chosen.unsqueeze(1)).sum(dim=-1)
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], tokens[:, None][:, :0])
    return chosen, ranks, top_values, top_ids
