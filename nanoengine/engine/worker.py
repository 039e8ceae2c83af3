"""Tensor-parallel workers: ranks 1..N-1, each a process that owns one ModelRunner (one shard of the model).

A worker joins the group through the store (see distributed.py), builds its
shard, then runs every step that rank 0 broadcasts until rank 0 sends None.
A step's message carries only what changed: per scheduled request the tokens
to compute, their start position and the block ids added to its block table
(a worker keeps every live request's table), plus the ids of requests that
ended. A worker holds no scheduler and samples nothing.

Each worker beats a counter in the store twice a second; rank 0's executor
reads them to tell a dead rank from a slow one. A worker ends itself when the
store is gone (its head died) or silent for 5 s (its node vanished), when the
head gives up on the group, or when the process that started it dies:
nothing is left orphaned.
"""

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing

from nanoengine.config import EngineConfig
from nanoengine.distributed import another_client, connect_store, destroy_group, init_group, rank_device, start_stepping
from nanoengine.engine.model_runner import ModelRunner, StepInputs
from nanoengine.utils.gc_heap import freeze_startup_heap

HEARTBEAT_INTERVAL_S = 0.5
HEAD_SILENCE_S = 5.0  # a head whose store has not answered a heartbeat this long is gone
GIVE_UP_KEY = "nanoengine/give_up"  # set by rank 0 when the group is broken or closing: every worker exits
JOIN_TIMEOUT_S = 30  # how long a closing node waits for a worker to exit before killing it


def heartbeat_key(rank: int) -> str:
    return f"nanoengine/heartbeat/{rank}"


def options_key(rank: int) -> str:
    return f"nanoengine/options/{rank}"


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


def start_workers(config: EngineConfig, ranks: list[int], port: int) -> dict[int, multiprocessing.Process]:
    """Start one worker process per rank (on this node), joining the store at ``config.master_addr:port``."""
    context = torch.multiprocessing.get_context("spawn")
    processes = {rank: context.Process(target=run_spawned_worker, args=(config, rank, port), daemon=True,
                                       name=f"nanoengine-tp-rank{rank}") for rank in ranks}
    for process in processes.values():
        process.start()
    return processes


def run_node(config: EngineConfig) -> None:
    """A node other than the head (``nanoengine serve --headless``): run this node's ranks, the first in this
    process, until the head closes them."""
    first, *others = config.node_ranks()
    processes = start_workers(config, others, config.master_port)
    try:
        run_worker(config, first, config.master_port)
    finally:
        for process in processes.values():
            process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()


def run_spawned_worker(config: EngineConfig, rank: int, port: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the process that started it
    run_worker(config, rank, port)


def run_worker(config: EngineConfig, rank: int, port: int) -> None:
    """Join the group, build this rank's shard, run every step rank 0 sends until None."""
    world_size = config.tensor_parallel_size
    store = connect_store(config.master_addr, port, rank, world_size)
    # Rank 0 checks them before going on.
    store.set(options_key(rank), json.dumps(config.agreed_options("tensor parallel")))
    stopping = threading.Event()
    threading.Thread(target=send_heartbeats, args=(another_client(store), rank, stopping), daemon=True,
                     name="nanoengine-heartbeat").start()
    device = rank_device(config.device, rank, world_size, config.ranks_per_node)
    if device.type == "cpu":  # the node's ranks share its cores
        torch.set_num_threads(max(1, torch.get_num_threads() // config.ranks_per_node))
    try:
        control_group = init_group(store, rank, world_size, device)
        runner = ModelRunner(config, rank)
        freeze_startup_heap()
        start_stepping()
        decoder = StepDecoder()
        while (message := receive_step(control_group)) is not None:
            runner.forward(decoder.decode(message))
    except BaseException:
        print(f"nanoengine: tensor-parallel rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # at once: a broken group's teardown may wait on dead ranks, while this one's heart beats on
    stopping.set()
    runner.close()
    destroy_group()


def receive_step(control_group: dist.ProcessGroup) -> StepMessage | None:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control_group)
    return box[0]


def send_heartbeats(store: dist.Store, rank: int, stopping: threading.Event) -> None:
    """Beat until the worker stops; end the process at once when the head is gone, silent or has given up."""
    parent = multiprocessing.parent_process()
    answered_at = [time.monotonic()]  # when the head's store last answered
    threading.Thread(target=exit_if_head_silent, args=(answered_at, rank, stopping), daemon=True,
                     name="nanoengine-head-watch").start()
    while True:
        try:
            store.add(heartbeat_key(rank), 1)
            why = store.get(GIVE_UP_KEY).decode() if store.check([GIVE_UP_KEY]) else None
            answered_at[0] = time.monotonic()
        except Exception:  # rank 0 hosts the store (torchrun: its agent)
            why = "the head is gone (its store cannot be reached)"
        if why is None and parent is not None and not parent.is_alive():
            why = "the process that started it is gone"
        if why and not stopping.is_set():
            exit_worker(rank, why)
        if stopping.wait(HEARTBEAT_INTERVAL_S):
            return


def exit_if_head_silent(answered_at: list[float], rank: int, stopping: threading.Event) -> None:
    """A head node that vanished without closing its connections (power lost, cable pulled) leaves a store
    call waiting forever (the store's timeout does not bound it): its silence ends the worker instead."""
    while not stopping.wait(HEARTBEAT_INTERVAL_S):
        if time.monotonic() - answered_at[0] > HEAD_SILENCE_S:
            exit_worker(rank, f"the head's store has not answered for {HEAD_SILENCE_S:g} s (its node is gone)")


def exit_worker(rank: int, why: str) -> None:
    print(f"nanoengine: tensor-parallel rank {rank} exits: {why}", file=sys.stderr, flush=True)
    os._exit(1)  # the main thread may sit in a collective that will never complete
