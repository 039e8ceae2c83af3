"""The tensor-parallel worker group as rank 0 sees it: ranks 1..N-1 in worker processes (worker.py), this
node's started here, other nodes' by ``nanoengine serve --headless`` there, or every rank by torchrun.

A group is either all alive and in step with rank 0, or given up: once a rank dies or a step fails halfway (the
others may sit in a collective that rank 0 left), every worker is told to exit. Each worker beats a counter in
the store; ``GroupHealth`` reads them to tell a dead rank from a slow one.
"""

import contextlib
import json
import multiprocessing.connection
import threading
import time
import weakref
from collections.abc import Callable
from typing import NoReturn

import torch
import torch.distributed as dist

from nanoengine.config import EngineConfig
from nanoengine.distributed import (
    STARTUP_TIMEOUT,
    another_client,
    connect_store,
    destroy_group,
    init_group,
    rank_device,
    start_stepping,
)
from nanoengine.engine import worker
from nanoengine.engine.model_runner import ModelRunner, StepInputs

HEARTBEAT_TIMEOUT_S = 5.0  # a worker silent this long is dead (a busy one still beats: its own thread does)
FAILED_STEP_SILENCE_S = 4 * worker.HEARTBEAT_INTERVAL_S  # ...or this long, once a collective with it has failed


class WorkerGroup:
    """Starts the workers, joins their group and builds rank 0's runner in it (``build_runner``: its layers
    shard themselves over the group); then sends each step to the workers before rank 0 runs its share."""

    def __init__(self, config: EngineConfig, build_runner: Callable[[], ModelRunner]):
        world_size = config.tensor_parallel_size
        store = connect_store(config.master_addr, config.master_port, 0, world_size)
        self.health = GroupHealth(store, worker.start_workers(config, config.node_ranks()[1:], store.port), world_size)
        try:
            self.health.wait_until_started(config.agreed_options("tensor parallel"))
            self.control_group = init_group(store, 0, world_size,
                                            rank_device(config.device, 0, world_size, config.ranks_per_node))
            self.health.watch()
            self.runner = build_runner()
            # Rank 0 sends each step when it is ready (the workers wait for it without a limit); a worker
            # whose node vanished, never taking it, must not hold rank 0 either.
            start_stepping(self.control_group)
        except BaseException as exc:
            destroy_group()
            self.health.fail(exc, "starting (a script that creates a tensor-parallel LLM must do so under "
                                  "`if __name__ == '__main__':`, as worker processes import it)")
        # Stops the workers on close(), when this object is collected, or at interpreter exit; runs once.
        self.stopper = weakref.finalize(self, stop_workers, self.health, self.control_group)
        self.encoder = worker.StepEncoder()

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Send the step to the workers, then run rank 0's share of it."""
        self.health.raise_if_broken()
        try:
            dist.broadcast_object_list([self.encoder.encode(inputs)], src=0, group=self.control_group)
            return self.runner.forward(inputs)
        except BaseException as exc:
            self.health.fail(exc, "running a step")

    def finish_request(self, request_id: str) -> None:
        self.encoder.finish_request(request_id)

    def close(self) -> None:
        """Stop the workers and leave the group. Safe to call twice."""
        self.stopper()


class OptionsDifferError(ValueError):
    pass


class GroupHealth:
    """What rank 0 knows of the workers' lives: the processes it started, and every worker's heartbeat."""

    def __init__(self, store: dist.Store, processes: dict[int, multiprocessing.Process], world_size: int):
        self.store, self.processes, self.world_size = store, processes, world_size
        self.last_beat_at: dict[int, float] = {}  # rank -> when its heartbeat counter last moved (once watched)
        self.stopped = threading.Event()
        self.broken: str | None = None  # why the ranks are out of step, once they are

    def wait_until_started(self, options: dict) -> None:
        """Poll until every worker has beaten once, so that one failing to start is an error, not a hang; then
        refuse a worker started with other options than ``options``."""
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        missing = list(range(1, self.world_size))
        while missing:
            if self.dead_ranks():
                raise RuntimeError(self.dead_ranks())
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank(s) {missing} did not join within {STARTUP_TIMEOUT}")
            time.sleep(0.05)
            missing = [rank for rank in missing if not self.store.check([worker.heartbeat_key(rank)])]
        options = json.loads(json.dumps(options))  # as the workers' arrive (JSON has no int keys nor tuples)
        for rank in range(1, self.world_size):
            theirs = json.loads(self.store.get(worker.options_key(rank)))
            differ = [f"{name} {theirs.get(name)!r} (the head's: {value!r})" if name != "config.json" else name
                      for name, value in options.items() if theirs.get(name) != value]
            if differ:
                raise OptionsDifferError(f"rank {rank} was started with options that differ from the head's: "
                                         + ", ".join(differ))

    def watch(self) -> None:
        self.last_beat_at = dict.fromkeys(range(1, self.world_size), time.monotonic())
        threading.Thread(target=self.read_heartbeats, args=(another_client(self.store),), daemon=True,
                         name="nanoengine-heartbeats").start()

    def read_heartbeats(self, store: dist.TCPStore) -> None:
        """The watcher thread: notes when each rank's counter last moved."""
        counts = {}
        while not self.stopped.wait(worker.HEARTBEAT_INTERVAL_S):
            for rank in self.last_beat_at:
                try:
                    count = store.add(worker.heartbeat_key(rank), 0)
                except Exception:  # the store closed under us: the engine is closing
                    return
                if count != counts.get(rank):
                    counts[rank], self.last_beat_at[rank] = count, time.monotonic()
            if self.silent_ranks(HEARTBEAT_TIMEOUT_S) and dist.is_initialized() and dist.get_backend() == "nccl":
                dist.distributed_c10d._abort_process_group()  # else NCCL waits out its timeout; gloo fails by itself
                return

    def silent_ranks(self, for_s: float) -> list[int]:
        now = time.monotonic()
        return [rank for rank, at in self.last_beat_at.items() if now - at > for_s]

    def dead_ranks(self, silent_for_s: float = HEARTBEAT_TIMEOUT_S) -> str | None:
        """Who is dead: a process of this node that exited, or a rank silent for ``silent_for_s``."""
        exited = {rank: f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                  for rank, p in self.processes.items() if not p.is_alive()}
        silent = {rank: f"rank {rank} sent no heartbeat for {silent_for_s:g} s (its process or node is gone)"
                  for rank in self.silent_ranks(silent_for_s) if rank not in exited}
        dead = [why for _, why in sorted((exited | silent).items())]
        return "tensor-parallel " + ", ".join(dead) if dead else None

    def wait_for_dead_rank(self, timeout_s: float) -> str | None:
        """After a failed collective: a rank that died stops beating at once, so a short silence names it. That
        silence is waited out first, so that the ranks that died are named along with those that failed after."""
        deadline = time.monotonic() + timeout_s
        time.sleep(min(timeout_s, FAILED_STEP_SILENCE_S + worker.HEARTBEAT_INTERVAL_S))
        while not self.dead_ranks(FAILED_STEP_SILENCE_S) and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in self.processes.values()], 0.1)
        return self.dead_ranks(FAILED_STEP_SILENCE_S)

    def fail(self, error: BaseException, doing: str) -> NoReturn:
        """Give up after ``error``; when a rank died, raise an error that names it. (A collective fails at once
        on a rank that died, a moment before its silence shows: wait for that.)"""
        collective_failed = isinstance(error, Exception) and not isinstance(error, OptionsDifferError)
        dead = self.wait_for_dead_rank(HEARTBEAT_TIMEOUT_S if collective_failed else 0)
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
        self.stopped.set()
        with contextlib.suppress(Exception):  # the workers also exit when the store is gone
            self.store.set(worker.GIVE_UP_KEY, why)
        for process in self.processes.values():
            process.kill()
            process.join()


def stop_workers(health: GroupHealth, control_group: dist.ProcessGroup) -> None:
    """Ask the workers to exit (unless the group is broken), kill this node's that do not, then leave the group."""
    health.stopped.set()
    if not health.broken and not health.dead_ranks():
        with contextlib.suppress(RuntimeError):  # a worker that died meanwhile is reaped below
            dist.broadcast_object_list([None], src=0, group=control_group)
        for process in health.processes.values():
            process.join(worker.JOIN_TIMEOUT_S)
    health.give_up("the engine closed")
    destroy_group()
