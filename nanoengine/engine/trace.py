"""The step trace: what the scheduler decided in each step, as one compact block per step.

Turned on by ``LLM(model, trace=True)``; it goes to the ``nanoengine.trace`` logger at INFO, so it can be
sent anywhere with Python's ``logging``. Without a handler of its own (or on the root logger) it prints
to stderr. A block, logged after scheduling and before the model runs::

    step 7: 2 scheduled, 17 tokens | free blocks 3 (1 cached) | running [a, c] | waiting [b]
      decode  a  37+1/38   new blocks [9]
      prefill c  16+16/40  new blocks [12]  cache hit 1 block(s) (16 tokens): 3#5d1e0c
      preempted b

With speculative decoding a decode line ends with its drafts (``+ 3 drafts``), and after the model has
run one line says how many each drafted request kept: ``  accepted a 2/3, d 0/1``.

``37+1/38``: 37 tokens already had K/V in the cache, 1 is computed now, of 38 known tokens. A request
is a *prefill* while it computes prompt tokens (or recomputes after a preemption), a *decode* once only
its last sampled token is new. ``3#5d1e0c``: block 3, whose chained hash ends in ``5d1e0c``.
"""

import logging

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.request import Request
from nanoengine.engine.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger("nanoengine.trace")


class StepTrace:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.num_steps = 0
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        if not logger.hasHandlers():
            logger.addHandler(logging.StreamHandler())

    def log(self, step: SchedulerOutput) -> None:
        self.num_steps += 1
        logger.info("\n".join(self.lines(step)))

    def lines(self, step: SchedulerOutput) -> list[str]:
        bm, scheduler = self.block_manager, self.scheduler
        lines = [f"step {self.num_steps}: {len(step.requests)} scheduled, {step.total_tokens} tokens"
                 f" | free blocks {bm.num_free_blocks} ({bm.num_cached_free_blocks} cached)"
                 f" | running {ids(scheduler.running)} | waiting {ids(scheduler.waiting)}"]
        lines += [self.request_line(r, n - len(d), r in step.admitted) + (f"  + {len(d)} drafts" if d else "")
                  for r, n, d in zip(step.requests, step.num_new_tokens, step.drafts)]
        if step.preempted:
            lines.append(f"  preempted {', '.join(r.request_id for r in step.preempted)}")
        return lines

    def log_verified(self, result) -> None:
        """After the model ran: how many drafts each drafted request kept."""
        verified = [f"{r.request_id} {len(run) - 1}/{n}" for r, run, n in zip(result.requests, result.token_ids,
                                                                              result.num_drafts) if n]
        if verified:
            logger.info("  accepted " + ", ".join(verified))

    def request_line(self, request: Request, num_new: int, admitted: bool) -> str:
        computed, size = request.num_computed_tokens, self.block_manager.block_size
        kind = "decode " if computed >= request.num_tokens - 1 and request.num_output_tokens else "prefill"
        num_held_before = -(-computed // size)  # blocks that hold the tokens computed in earlier steps
        line = f"  {kind} {request.request_id}  {computed}+{num_new}/{request.num_tokens}"
        if len(request.block_ids) > num_held_before:
            line += f"  new blocks {request.block_ids[num_held_before:]}"
        if admitted and computed:  # the blocks it holds before this step's new ones came from the cache
            hits = " ".join(f"{b}#{h & 0xFFFFFF:06x}" for b, h in zip(request.block_ids[:num_held_before],
                                                                     request.block_hashes))
            line += f"  cache hit {num_held_before} block(s) ({computed} tokens): {hits}"
        return line


def ids(requests: list[Request]) -> str:
    return "[" + ", ".join(r.request_id for r in requests) + "]"
