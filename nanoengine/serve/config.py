"""ServerConfig: what the server decides beyond one engine: how many engine cores, where they meet, how a
request picks one (data parallelism: docs/serving.md). ``EngineConfig`` holds what one engine core runs."""

from dataclasses import dataclass

import torch

from nanoengine.config import EngineConfig
from nanoengine.sampling_params import check_number

ROUTINGS = ("prefix", "least-loaded", "round-robin")  # how the server picks an engine core for a request


@dataclass
class ServerConfig:
    data_parallel_size: int = 1  # engine cores behind one server, each with its own KV cache
    data_parallel_size_local: int | None = None  # of them, started by the server itself (None = all)
    data_parallel_rank: int = 0  # the rank of a --headless core
    data_parallel_address: str | None = None  # HOST:PORT where the server meets the cores of other nodes
    data_parallel_routing: str = "prefix"  # "prefix" (longest cached prefix, then load), "least-loaded", ...

    def check(self, engine: EngineConfig) -> "ServerConfig":
        size = self.data_parallel_size
        check_number("data_parallel_size", size, int, low=1)
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = size if self.data_parallel_address is None else 1
        check_number("data_parallel_size_local", self.data_parallel_size_local, int, low=0, high=size)
        check_number("data_parallel_rank", self.data_parallel_rank, int, low=0, high=size - 1)
        num_gpus = self.data_parallel_size_local * engine.tensor_parallel_size
        if engine.device.startswith("cuda") and self.data_parallel_size_local > 1 and (
                engine.device != "cuda" or torch.cuda.device_count() < num_gpus):
            raise ValueError(f"{self.data_parallel_size_local} local engine cores of tensor_parallel_size="
                             f"{engine.tensor_parallel_size} need device 'cuda' and {num_gpus} GPUs (core r runs on "
                             f"GPUs r * TP and up), found {torch.cuda.device_count()}")
        if self.data_parallel_routing not in ROUTINGS:
            raise ValueError(f"data_parallel_routing must be one of {ROUTINGS}, got {self.data_parallel_routing!r}")
        if self.data_parallel_address is not None:
            host, _, port = str(self.data_parallel_address).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"data_parallel_address must be HOST:PORT, got {self.data_parallel_address!r}")
        elif self.data_parallel_size_local < size:
            raise ValueError(f"data_parallel_size_local={self.data_parallel_size_local} < data_parallel_size="
                             f"{size}: the other cores join at data_parallel_address, which is not set")
        return self
