"""Tensor-parallel group helpers: a single process is the group of one.

Layers ask for their rank and the group size here, so the same model code
runs alone or split over ``torch.distributed`` ranks. Ranks meet through a
TCPStore: rank 0 hosts it (at ``master_addr:master_port``), or, under
torchrun, its ``env://`` variables say where it is.
"""

import ipaddress
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# Joining the group and loading the model: a rank on a slow node may take this long to catch up.
STARTUP_TIMEOUT = timedelta(minutes=10)
# Once every rank has loaded, a collective of a step that waits this long fails instead of hanging.
STEP_TIMEOUT = timedelta(seconds=30)
# Workers wait for the next step for as long as the engine stays open (their heartbeats end them if it goes).
IDLE_TIMEOUT = timedelta(days=365)
ENV_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # torchrun's env:// rendezvous


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_on_rank0(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Concatenate every rank's shard of ``x`` along ``dim`` on rank 0; other ranks get None."""
    if tp_size() == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x, shards, dst=0)
    return torch.cat(shards, dim) if tp_rank() == 0 else None


def min_over_ranks(value: int, device: torch.device) -> int:
    if tp_size() == 1:
        return value
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def env_rank() -> int | None:
    """This process's rank when a launcher such as torchrun set the env:// variables, else None."""
    return int(os.environ["RANK"]) if all(name in os.environ for name in ENV_VARIABLES) else None


def ip_addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses ``host`` (a name, or an address, IPv6 possibly in brackets) stands for; none if it does not
    resolve."""
    try:
        found = socket.getaddrinfo(host.strip("[]"), None)
    except (OSError, UnicodeError):
        return []
    return [ipaddress.ip_address(info[4][0].partition("%")[0]) for info in found]


def rank_device(device: str, rank: int, world_size: int, ranks_per_node: int) -> torch.device:
    """On CUDA, a rank of a group runs on the GPU of its place on its node; a single rank runs where it was told."""
    if world_size == 1 or device == "cpu":
        return torch.device(device)
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if env_rank() is not None else rank % ranks_per_node
    return torch.device("cuda", local_rank)


def connect_store(master_addr: str, port: int, rank: int, world_size: int) -> dist.Store:
    """The store the ranks meet in: rank 0 hosts it (port 0: the OS picks one), the others connect to it."""
    if env_rank() is not None:
        store, _, _ = next(dist.rendezvous("env://", timeout=STARTUP_TIMEOUT))
        return store
    return dist.TCPStore(master_addr, port, world_size, is_master=rank == 0, wait_for_workers=False,
                         timeout=STARTUP_TIMEOUT)


def another_client(store: dist.TCPStore) -> dist.TCPStore:
    """A connection of its own for a thread: its calls never queue behind a blocking wait of the main thread's."""
    return dist.TCPStore(store.host, store.port, is_master=False, timeout=STARTUP_TIMEOUT)


def init_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> dist.ProcessGroup:
    """Join the tensor-parallel group as the default group; returns a gloo group for the step messages."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=STARTUP_TIMEOUT,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=STARTUP_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def start_stepping(*more_groups: dist.ProcessGroup) -> None:
    """Every rank has loaded: from now on a collective (of the default group and ``more_groups``) fails after
    STEP_TIMEOUT."""
    for group in (None, *more_groups):
        dist.distributed_c10d._set_pg_timeout(STEP_TIMEOUT, group)


def destroy_group() -> None:
    """Leave the group (and its subgroups), so that another engine can form a new one."""
    if dist.is_initialized():
        dist.destroy_process_group()
