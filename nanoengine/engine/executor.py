"""Executors: what LLMEngine runs each step on (vLLM's layer of that name).

An executor drives the workers of one tensor-parallel group; each worker owns
a ModelRunner. Rank 0's runner lives in the engine's process and also samples.

- ``UniProcExecutor``: one rank, in this process.
- ``MultiprocExecutor``: rank 0 here, ranks 1..N-1 in worker processes (worker.py): this node's are
  started here, other nodes' by ``nanoengine serve --headless`` there, or every rank by torchrun.

A multi-process group is either all alive and in step with rank 0, or given up: once a rank dies or a
step fails halfway (the others may sit in a collective that rank 0 left), every worker is told to exit.
"""

import contextlib
import multiprocessing.connection
import threading
import time
import weakref
from typing import NoReturn

import torch
import torch.distributed as dist

from nanoengine.config import EngineConfig
from nanoengine.distributed import (
    STARTUP_TIMEOUT,
    connect_store,
    destroy_group,
    init_group,
    rank_device,
    start_stepping,
)
from nanoengine.engine.model_runner import ModelRunner, StepInputs, StepResult
from nanoengine.engine.scheduler import SchedulerOutput
from nanoengine.engine.structured_output import GrammarBitmask
from nanoengine.engine.worker import (
    GIVE_UP_KEY,
    HEARTBEAT_INTERVAL_S,
    JOIN_TIMEOUT_S,
    StepEncoder,
    heartbeat_key,
    start_workers,
)

HEARTBEAT_TIMEOUT_S = 5.0  # a worker silent this long is dead (a busy one still beats: its own thread does)


def make_executor(config: EngineConfig) -> "UniProcExecutor":
    if dist.is_initialized():  # the layers would shard themselves over that group
        raise RuntimeError("torch.distributed is already initialized in this process (is a tensor-parallel "
                           "LLM still open?); close it before creating another LLM")
    if config.node_ranks()[0] != 0:
        raise ValueError(f"node_rank={config.node_rank} runs only the workers of its node: start it with "
                         "`nanoengine serve MODEL ... --headless`; the engine runs on node 0")
    return UniProcExecutor(config) if config.tensor_parallel_size == 1 else MultiprocExecutor(config)


class UniProcExecutor:
    can_rerun_steps = True  # a failed step leaves nothing behind: LLMEngine may rerun its requests one by one

    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None) -> StepResult:
        """Run the model on one step and sample; ``grammar_bitmask`` constrains the structured requests' rows."""
        inputs = StepInputs.of(step)
        return self.runner.sample_step(step, inputs, self.forward(inputs), grammar_bitmask)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.runner.forward(inputs)

    def finish_request(self, request_id: str) -> None:
        """The request is done or aborted (workers drop their copy of its block table)."""

    def close(self) -> None:
        self.runner.close()


class MultiprocExecutor(UniProcExecutor):
    can_rerun_steps = False  # the workers ran (or wait in) the failed step: they are told to exit

    def __init__(self, config: EngineConfig):
        world_size = config.tensor_parallel_size
        store = connect_store(config.master_addr, config.master_port, 0, world_size)
        self.health = GroupHealth(store, start_workers(config, config.node_ranks()[1:], store.port), world_size)
        try:
            self.health.wait_until_started()
            self.control_group = init_group(store, 0, world_size,
                                            rank_device(config.device, 0, world_size, config.ranks_per_node))
            self.health.watch()
            super().__init__(config)
            start_stepping()
        except BaseException as exc:
            destroy_group()
            self.health.fail(exc, "starting (a script that creates a tensor-parallel LLM must do so under "
                                  "`if __name__ == '__main__':`, as worker processes import it)")
        # Stops the workers on close(), when this object is collected, or at interpreter exit; runs once.
        self.stopper = weakref.finalize(self, stop_workers, self.health, self.control_group)
        self.encoder = StepEncoder()

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Send the step to the workers, then run rank 0's share of it."""
        self.health.raise_if_broken()
        try:
            dist.broadcast_object_list([self.encoder.encode(inputs)], src=0, group=self.control_group)
            return super().forward(inputs)
        except BaseException as exc:
            self.health.fail(exc, "running a step")

    def finish_request(self, request_id: str) -> None:
        self.encoder.finish_request(request_id)

    def close(self) -> None:
        """Stop the workers and leave the group. Safe to call twice."""
        self.stopper()
        super().close()


class GroupHealth:
    """What rank 0 knows of the workers' lives: the processes it started, and every worker's heartbeat."""

    def __init__(self, store: dist.Store, processes: dict[int, multiprocessing.Process], world_size: int):
        self.store, self.processes, self.world_size = store, processes, world_size
        self.silent_ranks: list[int] = []  # ranks whose heartbeat stopped, as the watcher thread finds them
        self.stopped = threading.Event()
        self.broken: str | None = None  # why the ranks are out of step, once they are

    def wait_until_started(self) -> None:
        """Poll until every worker has beaten once, so that one failing to start is an error, not a hang."""
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        missing = list(range(1, self.world_size))
        while missing:
            if self.dead_ranks():
                raise RuntimeError(self.dead_ranks())
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank(s) {missing} did not join within {STARTUP_TIMEOUT}")
            time.sleep(0.05)
            missing = [rank for rank in missing if not self.store.check([heartbeat_key(rank)])]

    def watch(self) -> None:
        threading.Thread(target=self.read_heartbeats, daemon=True, name="nanoengine-heartbeats").start()

    def read_heartbeats(self) -> None:
        """The watcher thread: a rank whose counter stays still for HEARTBEAT_TIMEOUT_S is dead."""
        last_beats = {rank: (0, time.monotonic()) for rank in range(1, self.world_size)}  # (count, when it moved)
        while not self.stopped.wait(HEARTBEAT_INTERVAL_S):
            now = time.monotonic()
            for rank, (count, moved_at) in last_beats.items():
                try:
                    new_count = self.store.add(heartbeat_key(rank), 0)
                except Exception:  # the store closed under us: the engine is closing
                    return
                if new_count != count:
                    last_beats[rank] = (new_count, now)
                elif now - moved_at > HEARTBEAT_TIMEOUT_S and rank not in self.silent_ranks:
                    self.silent_ranks.append(rank)
                    if dist.is_initialized() and dist.get_backend() == "nccl":
                        dist.distributed_c10d._abort_process_group()  # NCCL would wait out its timeout

    def dead_ranks(self) -> str | None:
        exited = {rank: f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                  for rank, p in self.processes.items() if not p.is_alive()}
        silent = {rank: f"rank {rank} sent no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s (its process or node is gone)"
                  for rank in self.silent_ranks if rank not in exited}
        dead = [why for _, why in sorted((exited | silent).items())]
        return "tensor-parallel " + ", ".join(dead) if dead else None

    def wait_for_dead_rank(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while not self.dead_ranks() and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in self.processes.values()], 0.1)
        return self.dead_ranks()

    def fail(self, error: BaseException, doing: str) -> NoReturn:
        """Give up after ``error``; when a rank died, raise an error that names it. A collective fails at once
        on a rank that died, before its heartbeat stops: wait that long to learn which."""
        dead = self.wait_for_dead_rank(HEARTBEAT_TIMEOUT_S + 1 if isinstance(error, Exception) else 0)
        self.give_up(dead or f"{doing} failed with {type(error).__name__}: {error}")
        if dead:
            raise RuntimeError(f"{dead} while {doing}") from error
        raise error

    def raise_if_broken(self) -> None:
        dead = self.dead_ranks()
        if dead and not self.broken:
            self.give_up(dead)
        if self.broken:
            raise RuntimeError(f"tensor parallelism is broken ({self.broken}); close this LLM and create a new one")

    def give_up(self, why: str) -> None:
        """Tell every worker to exit (through the store: some may sit in a collective) and kill this node's."""
        self.broken = self.broken or why
        self.stop_watching()
        with contextlib.suppress(Exception):  # the workers also exit when the store is gone
            self.store.set(GIVE_UP_KEY, why)
        for process in self.processes.values():
            process.kill()
            process.join()

    def stop_watching(self) -> None:
        self.stopped.set()


def stop_workers(health: GroupHealth, control_group: dist.ProcessGroup) -> None:
    """Ask the workers to exit (unless the group is broken), kill this node's that do not, then leave the group."""
    health.stop_watching()
    if not health.broken and not health.dead_ranks():
        with contextlib.suppress(RuntimeError):  # a worker that died meanwhile is reaped below
            dist.broadcast_object_list([None], src=0, group=control_group)
        for process in health.processes.values():
            process.join(JOIN_TIMEOUT_S)
    health.give_up("the engine closed")
    destroy_group()
