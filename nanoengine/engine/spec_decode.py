"""Speculative decoding with n-gram drafts (vLLM's prompt lookup), verified in the same forward pass.

- Proposing: after a step, a request that decodes looks for the longest suffix n-gram of its tokens
  (``prompt_lookup_max`` down to ``prompt_lookup_min`` long) earlier in its prompt and output, and drafts
  the tokens that followed it, as many as its draft length allows. Where the n-gram occurs more than once,
  it takes the occurrence whose preceding tokens agree longest with its own (the place it is copying from),
  the first of equals; vLLM takes the first. On the spec preset's outputs, replayed: 20% fewer steps for
  its one request, 2-4% for the others.
- The scheduler gives a decode 1 + k tokens of the budget; the model runner computes logits at all k + 1
  positions, and each row is sampled exactly as plain decoding would sample it (penalties, min_tokens,
  grammar, temperature, min-p, top-k, top-p; the row after draft j sees the drafts up to j as output).
- Verifying (``accepted_run``): drafts are kept while each equals the token sampled at its position;
  the first row whose draw differs emits that draw, and when every draft matched the last row's draw is
  a bonus token. Greedy rows draw their argmax. For a sampled row, the draw equals the draft with
  probability p(draft), and a draw that differs is distributed as p with the draft removed,
  renormalised: vLLM's rejection rule for a draft that is a point mass, so the output distribution is
  exactly plain sampling's. A seeded request draws position i's noise from (seed, i) alone, so it
  produces the same tokens with or without drafts, whatever else is in the batch.
- Adapting (``DraftLength``): each request drafts up to its own length, which grows by one after a step
  that accepted every draft and drops to the number accepted otherwise. At length 0 the request skips
  drafting for a while, then probes with one draft; each failed probe doubles the wait (up to
  ``MAX_WAIT`` steps), so a request whose output never copies its context costs almost nothing.
- Paying for themselves (``StepCost``, ``worth_drafting``): a decode step costs a + b * rows seconds,
  fitted over recent decode steps. Few rows read the weights at the same cost (b small, memory-bound);
  many rows make each draft cost its full share of the arithmetic (compute-bound). A request's j-th
  draft is accepted with probability q^j, q its recent rate of accepting a draft after the one before
  (a new request starts from the engine's recent rate over all requests).
  The step keeps drafts, likeliest first, while each adds more expected tokens per second than the
  step already yields, so a batch that is compute-bound drafts less, or not at all.
"""

from collections import deque

import numpy as np

from nanoengine.config import EngineConfig
from nanoengine.engine.structured_output import grammar_prefix

MAX_WAIT = 64  # decode steps a request at draft length 0 waits, at most, before probing again
COST_WINDOW = 64  # decode steps the step-cost fit looks back over
MIN_COST_SAMPLES = 8
AGREEMENT_WINDOW = 32  # tokens before an n-gram's occurrences compared with those before the suffix


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the longest matching suffix n-gram: of its
    occurrences, the one whose preceding tokens agree longest with those before the suffix (up to
    ``AGREEMENT_WINDOW``), the first of those that agree equally (vLLM takes the first occurrence)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # Windows start at 0 .. len - n - 1: every n-gram but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = hits[np.argmax(agreement(tokens, hits, n))] + n
            return tokens[start:start + k].tolist()
    return []


def agreement(tokens: np.ndarray, hits: np.ndarray, n: int) -> np.ndarray:
    """For each occurrence of the suffix n-gram starting at ``hits``, how many tokens before it equal the ones
    before the suffix, counted back from it until the first that differs."""
    back = np.arange(1, AGREEMENT_WINDOW + 1)
    theirs, ours = hits[:, None] - back, len(tokens) - n - back  # [hits, window] and [window]
    same = (theirs >= 0) & (ours >= 0) & (tokens[theirs.clip(0)] == tokens[ours.clip(0)])
    return np.cumprod(same, axis=1).sum(axis=1)


def accepted_run(draft_ids: list[int], sampled_ids: list[int]) -> list[int]:
    """The tokens a drafted request emits: ``sampled_ids[j]`` is the draw at draft j's position (one more
    than there are drafts). Drafts are kept while they equal the draw, then the next draw is emitted."""
    num_accepted = 0
    while num_accepted < len(draft_ids) and draft_ids[num_accepted] == sampled_ids[num_accepted]:
        num_accepted += 1
    return sampled_ids[:num_accepted + 1]


class AcceptanceRate:
    """The chance that a draft is accepted given that the one before it was: decayed counts of drafts accepted
    and of verifications that rejected one, starting from ``prior`` as if two verifications had shown it."""

    def __init__(self, prior: float = 0.5, decay: float = 0.9):
        self.decay = decay
        self.accepted, self.rejected = 2 * prior, 2 * (1 - prior)

    @property
    def value(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.decay * self.accepted + num_accepted
        self.rejected = self.decay * self.rejected + (num_accepted < num_drafted)


class DraftLength:
    """One request's adaptive draft length (see the module docstring); ``prior``: the acceptance it starts
    from, the engine's recent rate over all requests (a fixed prior can sit below what the step cost asks
    for, and then no request ever drafts)."""

    def __init__(self, max_length: int, prior: float = 0.5):
        self.max_length = max_length
        self.length = max_length
        self.wait = 0  # steps to skip before the next probe, at length 0
        self.next_wait = 1
        self.rate = AcceptanceRate(prior)

    @property
    def acceptance(self) -> float:
        return self.rate.value

    def allowed(self) -> int:
        """How many drafts this step may carry (called once per decode step)."""
        if self.length or self.wait == 0:
            return max(self.length, 1)
        self.wait -= 1
        return 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self.rate.update(num_drafted, num_accepted)
        if num_accepted == num_drafted:
            self.length = min(self.max_length, self.length + 1)
            self.next_wait = 1
        else:
            self.length = num_accepted
        if self.length == 0:
            self.wait, self.next_wait = self.next_wait, min(2 * self.next_wait, MAX_WAIT)


class StepCost:
    """A decode step's seconds as a + b * rows, fitted by least squares over the last ``COST_WINDOW`` decode steps."""

    def __init__(self):
        self.samples: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)

    def add(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until enough steps of different sizes have run."""
        if len(self.samples) < MIN_COST_SAMPLES:
            return None
        rows, seconds = np.array(self.samples, dtype=np.float64).T
        if rows.std() == 0:
            return None
        b = max(0.0, float(np.cov(rows, seconds, bias=True)[0, 1] / rows.var()))
        return max(0.0, float(seconds.mean() - b * rows.mean())), b


def worth_drafting(acceptances: list[float], num_drafts: list[int], num_rows: int,
                   cost: tuple[float, float] | None) -> list[int]:
    """How many of its drafts each request keeps, given each one's acceptance q, a step of ``num_rows``
    rows without drafts, and the step cost (a, b); drafts are kept likeliest first while each adds more
    expected tokens per second than the step yields with the drafts kept so far."""
    if cost is None:
        return num_drafts
    a, b = cost
    candidates = sorted(((q ** (j + 1), i) for i, (q, n) in enumerate(zip(acceptances, num_drafts))
                         for j in range(n)), reverse=True)
    kept = [0] * len(num_drafts)
    tokens, seconds = float(num_rows), a + b * num_rows
    for p, i in candidates:
        if p * seconds <= b * tokens:  # p / b <= tokens / seconds: this draft would lower the rate
            break
        kept[i] += 1
        tokens, seconds = tokens + p, seconds + b
    return kept


class Drafter:
    """The engine's drafting policy: proposes each decoding request's drafts after a step, keeps those that
    pay, and learns from each verification."""

    def __init__(self, config: EngineConfig, block_manager):
        self.config, self.spec, self.block_manager = config, config.speculative, block_manager
        self.counts = [0, 0, 0]  # (drafted requests, draft tokens, accepted tokens)
        self.step_cost = StepCost()  # what a decode step costs per row
        self.acceptance = AcceptanceRate(decay=0.99)  # over every request's verified drafts: a new one's prior

    def add_request(self, request) -> None:
        if self.spec is not None:
            request.draft_length = DraftLength(self.spec.num_speculative_tokens, prior=self.acceptance.value)

    def record_step_cost(self, scheduled, seconds: float) -> None:
        """Time the steps that only decode (with or without drafts), for ``worth_drafting``."""
        if self.spec is not None and all(n == 1 + len(d) for n, d in zip(scheduled.num_new_tokens, scheduled.drafts)):
            self.step_cost.add(sum(scheduled.num_new_tokens), seconds)

    def record_verifications(self, result) -> None:
        """Count each request's verified drafts, adapt its draft length, and give back the blocks of rejected
        drafts (``result``: the step's StepResult)."""
        for request, run, num_drafts in zip(result.requests, result.token_ids, result.num_drafts):
            if num_drafts:
                num_accepted = len(run) - 1
                for i, count in enumerate((1, num_drafts, num_accepted)):
                    self.counts[i] += count
                request.draft_length.update(num_drafts, num_accepted)
                self.acceptance.update(num_drafts, num_accepted)
                if not request.is_finished:
                    size = self.block_manager.block_size
                    self.block_manager.free(request, num_kept_blocks=-(-request.num_computed_tokens // size))

    def propose(self, requests: list) -> None:
        """Draft the next tokens of each request that just sampled."""
        spec = self.spec
        for request in requests:
            request.spec_token_ids = []
            if spec is None or request.is_finished:
                continue
            structured = request.matcher is not None
            if structured and request.num_output_tokens < request.params.min_tokens:
                continue  # its rows' stop-token bans would need the matcher's state after each draft
            # What the request may still emit, less the token sampled after the drafts.
            room = min(request.max_tokens - request.num_output_tokens,
                       self.config.max_model_len - request.num_tokens) - 1
            num_drafts = min(room, request.draft_length.allowed())
            if num_drafts > 0:
                drafts = propose_ngram(request.all_token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                       num_drafts)
                request.spec_token_ids = grammar_prefix(request.matcher, drafts) if structured else drafts
        if spec is not None:
            self.keep_drafts_that_pay([r for r in requests if not r.is_finished])

    def keep_drafts_that_pay(self, decoding: list) -> None:
        drafted = [r for r in decoding if r.spec_token_ids]
        if not drafted:
            return  # nothing to cut: skip the fit, which runs every step
        kept = worth_drafting([r.draft_length.acceptance for r in drafted], [len(r.spec_token_ids) for r in drafted],
                              len(decoding), self.step_cost.fit())
        for request, num_kept in zip(drafted, kept):
            request.spec_token_ids = request.spec_token_ids[:num_kept]
