"""Tensor-parallel group helpers: a single process is the group of one.

Layers ask for their rank and the group size here, so the same model code
runs alone or split over ``torch.distributed`` ranks.
"""

from datetime import timedelta

import torch
import torch.distributed as dist

# A rank that waits this long inside a step's collective fails with an error instead of hanging.
STEP_TIMEOUT = timedelta(minutes=10)
# Workers wait for the next step for as long as the engine stays open.
IDLE_TIMEOUT = timedelta(days=365)


def tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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


def rank_device(device: str, rank: int, world_size: int) -> torch.device:
    """On CUDA, rank r of a tensor-parallel group runs on cuda:r; a single rank runs where it was told."""
    if world_size == 1 or device == "cpu":
        return torch.device(device)
    return torch.device("cuda", rank)


def init_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> dist.ProcessGroup:
    """Join the tensor-parallel group as the default group; returns a gloo group for the step messages."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=STEP_TIMEOUT,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def destroy_group() -> None:
    """Leave the group (and its subgroups), so that another engine can form a new one."""
    if dist.is_initialized():
        dist.destroy_process_group()
