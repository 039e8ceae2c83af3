"""Tensor parallelism: the calling process is rank 0 and drives N-1 worker processes, one model shard each.

Rank 0 runs the scheduler, its own shard and the sampler. Each step it
broadcasts, on a gloo group of its own, only what changed: per scheduled
request the tokens to compute, their start position and the block ids added
to its block table (the workers keep every live request's table), plus the
ids of requests that ended. Then every rank runs the same forward pass: the
row-parallel layers all-reduce, and the LM head gathers the logits on rank 0.

The step messages travel on a group whose timeout outlasts any idle time;
the forward pass's collectives use the default group's ``STEP_TIMEOUT``.
Rank 0 checks that every worker is alive before each step, so a dead worker
is an error at the next step rather than a hang.
"""

import contextlib
import multiprocessing.connection
import signal
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing

from nanoengine.config import EngineConfig
from nanoengine.distributed import STEP_TIMEOUT, destroy_group, init_group, rank_device
from nanoengine.engine.model_runner import ModelRunner, StepInputs

HOST = "127.0.0.1"
STARTED_KEY = "nanoengine/workers_started"
JOIN_TIMEOUT_S = 30  # how long a closing engine waits for a worker to exit before killing it


class RequestDelta(NamedTuple):
    """One scheduled request, as a worker needs it given what it already knows."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0]
    num_kept_blocks: int  # how much of the worker's block table stays (0 after a preemption)
    new_block_ids: list[int]  # appended after the kept blocks
    samples: bool
    prompt_rows: tuple[int, int]
    num_drafts: int


class StepMessage(NamedTuple):
    finished_ids: list[str]  # requests whose block tables the workers drop
    requests: list[RequestDelta]


class StepEncoder:
    """Rank 0's copy of the workers' block tables: turns a step's inputs into the message that updates them."""

    def __init__(self):
        self.sent_tables: dict[str, list[int]] = {}
        self.finished_ids: list[str] = []

    def finish_request(self, request_id: str) -> None:
        if self.sent_tables.pop(request_id, None) is not None:
            self.finished_ids.append(request_id)

    def encode(self, inputs: StepInputs) -> StepMessage:
        deltas = []
        for request_id, token_ids, start, block_ids, samples, prompt_rows, num_drafts in zip(
                inputs.request_ids, inputs.token_ids, inputs.starts, inputs.block_tables, inputs.samples,
                inputs.prompt_rows, inputs.num_drafts):
            sent = self.sent_tables.setdefault(request_id, [])
            # Tables grow, but lose their tail after rejected drafts, and start over after a preemption.
            num_kept = common_prefix_length(sent, block_ids)
            new_block_ids = block_ids[num_kept:]
            del sent[num_kept:]
            sent.extend(new_block_ids)
            deltas.append(RequestDelta(request_id, token_ids, start, num_kept, new_block_ids, samples, prompt_rows,
                                       num_drafts))
        finished_ids, self.finished_ids = self.finished_ids, []
        return StepMessage(finished_ids, deltas)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    shorter = min(len(a), len(b))
    return next((i for i in range(shorter) if a[i] != b[i]), shorter)


class StepDecoder:
    """A worker's block tables: applies each step's message and rebuilds the step's full inputs."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def decode(self, message: StepMessage) -> StepInputs:
        for request_id in message.finished_ids:
            del self.tables[request_id]
        inputs = StepInputs([], [], [], [], [], [], [])
        for delta in message.requests:
            table = self.tables.setdefault(delta.request_id, [])
            del table[delta.num_kept_blocks:]
            table.extend(delta.new_block_ids)
            inputs.request_ids.append(delta.request_id)
            inputs.token_ids.append(delta.token_ids)
            inputs.starts.append(delta.start)
            inputs.block_tables.append(table)
            inputs.samples.append(delta.samples)
            inputs.prompt_rows.append(delta.prompt_rows)
            inputs.num_drafts.append(delta.num_drafts)
        return inputs


# Rank 0 ------------------------------------------------------------------------------------------


def start_model_runner(config: EngineConfig) -> ModelRunner:
    """Rank 0's model runner; with tensor_parallel_size > 1 it first starts the other ranks."""
    if dist.is_initialized():  # the layers would shard themselves over that group
        raise RuntimeError("torch.distributed is already initialized in this process (is a tensor-parallel "
                           "LLM still open?); close it before creating another LLM")
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    workers = TensorParallelWorkers(config)
    try:
        return ModelRunner(config, workers=workers)
    except BaseException:
        workers.kill()
        workers.close()
        raise


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts their processes, sends them each step, stops them.

    The workers are either all alive and in step with rank 0, or all dead: once one dies or a step
    fails halfway (the others may sit in a collective that rank 0 left), the rest are killed.
    """

    def __init__(self, config: EngineConfig):
        world_size = config.tensor_parallel_size
        # Port 0: the OS picks a free port, so engines on one machine never collide.
        store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=STEP_TIMEOUT)
        context = torch.multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=run_worker, args=(config, rank, store.port), daemon=True,
                                          name=f"nanoengine-tp-rank{rank}") for rank in range(1, world_size)]
        for process in self.processes:
            process.start()
        try:
            self.wait_until_started(store)
            self.control_group = init_group(store, 0, world_size, rank_device(config.device, 0, world_size))
        except BaseException:
            self.kill()
            destroy_group()
            raise
        # Stops the workers on close(), when this object is collected, or at interpreter exit; runs once.
        self.stopper = weakref.finalize(self, stop_workers, self.processes, self.control_group)
        self.encoder = StepEncoder()
        self.broken: str | None = None  # why the ranks are out of step, once they are

    def wait_until_started(self, store: dist.Store) -> None:
        """Poll until every worker has checked in, so that one failing to start is an error, not a hang."""
        deadline = time.monotonic() + STEP_TIMEOUT.total_seconds()
        while int(store.add(STARTED_KEY, 0)) < len(self.processes):
            dead = self.dead_workers()
            if dead:
                raise RuntimeError(f"{dead} while starting (a script that creates a tensor-parallel LLM must do "
                                   "so under `if __name__ == '__main__':`, as worker processes import it)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {STEP_TIMEOUT}")
            time.sleep(0.05)

    def run_step(self, inputs: StepInputs, forward: Callable[[StepInputs], torch.Tensor]) -> torch.Tensor:
        """Send the step to the workers, then run rank 0's share of it with ``forward``."""
        self.raise_if_broken()
        try:
            dist.broadcast_object_list([self.encoder.encode(inputs)], src=0, group=self.control_group)
            return forward(inputs)
        except BaseException as exc:
            self.reap_ending_workers(timeout_s=1)
            dead = self.dead_workers()
            self.broken = dead or f"a step failed with {type(exc).__name__}: {exc}"
            self.kill()
            if dead:
                raise RuntimeError(dead) from exc
            raise

    def raise_if_broken(self) -> None:
        self.broken = self.broken or self.dead_workers()
        if self.broken:
            self.kill()
            raise RuntimeError(f"tensor parallelism is broken ({self.broken}); close this LLM and create a new one")

    def reap_ending_workers(self, timeout_s: float) -> None:
        """A collective can fail on a dying worker before the OS reports the exit: wait a moment for it."""
        ended = multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout_s)
        for process in self.processes:
            if process.sentinel in ended:
                process.join()

    def dead_workers(self) -> str | None:
        dead = [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]
        return "tensor-parallel worker " + ", ".join(dead) if dead else None

    def finish_request(self, request_id: str) -> None:
        self.encoder.finish_request(request_id)

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
            process.join()

    def close(self) -> None:
        """Stop the workers and leave the group. Safe to call twice."""
        self.stopper()


def stop_workers(processes: list, control_group: dist.ProcessGroup) -> None:
    """Ask the workers to exit (when all are alive), kill any that do not, then leave the group."""
    if all(p.is_alive() for p in processes):
        with contextlib.suppress(RuntimeError):  # a worker that died meanwhile is reaped below
            dist.broadcast_object_list([None], src=0, group=control_group)
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
    destroy_group()


# Ranks 1..N-1 ------------------------------------------------------------------------------------


def run_worker(config: EngineConfig, rank: int, port: int) -> None:
    """A worker process: join the group, build this rank's shard, run every step rank 0 sends until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0, which then stops the workers
    world_size = config.tensor_parallel_size
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=STEP_TIMEOUT)
    store.add(STARTED_KEY, 1)
    device = rank_device(config.device, rank, world_size)
    if device.type == "cpu":  # the ranks share the machine's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    control_group = init_group(store, rank, world_size, device)
    runner = ModelRunner(config, rank)
    decoder = StepDecoder()
    while (message := receive_step(control_group)) is not None:
        runner.forward(decoder.decode(message))
    runner.close()
    destroy_group()


def receive_step(control_group: dist.ProcessGroup) -> StepMessage | None:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control_group)
    return box[0]
