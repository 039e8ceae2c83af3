"""The front process's handle on its engine cores: starts the local ones, routes each request to one core
and each core's outputs to that request's asyncio queue (one reader task, so a slow client delays only
its own queue).

Every core talks to one ROUTER socket: ipc for the cores the front starts, TCP for ``--headless`` ones
(cluster/: who may join, which core gets a request, when a dead one restarts). A core that dies (its
process ends, or its connection drops: a remote core gone, a local one silent past the heartbeat) fails
its requests at once with ``EngineUnavailableError``.
"""

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from nanoengine.config import EngineConfig
from nanoengine.outputs import EngineStats, RequestOutput
from nanoengine.sampling_params import field_error
from nanoengine.serve.cluster.handshake import Doorkeeper
from nanoengine.serve.cluster.restart_policy import RestartPolicy
from nanoengine.serve.cluster.router import CoreLoad, Router, prompt_hashes
from nanoengine.serve.codec import (
    HEARTBEAT_TIMEOUT_S,
    TO_FRONT,
    Abort,
    Codec,
    EngineCoreFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    Hello,
    Proof,
    Ready,
    cluster_socket,
    max_frame_bytes,
)
from nanoengine.serve.config import ServerConfig
from nanoengine.serve.engine_core import run_engine_core

logger = logging.getLogger("nanoengine.serve")
STOP_TIMEOUT_S = 30  # how long a stopping engine core may take to close before it is killed
EXIT_GRACE_S = 0.1  # a core whose process is ending anyway closes its connection first


class EngineUnavailableError(RuntimeError):
    pass


@dataclass
class CoreHandle(CoreLoad):
    """The front's handle on one engine core."""

    process: multiprocessing.Process | None = None  # a local core's; None for a remote one
    identity: bytes | None = None  # its peer on the ROUTER socket, once it said hello
    connection: int | None = None  # that peer's file descriptor, which names it in disconnection events
    ready: bool = False
    cause_of_death: str | None = None  # why it is gone, once it is
    restart_delay: float | None = None  # once dead: seconds until it is started again, if it will be

    @property
    def state(self) -> str:
        if self.cause_of_death:
            return "dead" if self.restart_delay is None else "restarting"
        return "ready" if self.ready else "starting"

    def describe(self) -> str:
        where = f"pid {self.process.pid}" if self.process else "remote"
        return f"the engine core (rank {self.rank}, {where})"


class EngineCoreClient:
    def __init__(self, config: EngineConfig, server: ServerConfig, on_stats: Callable[[int, EngineStats], None],
                 cluster_key: bytes = b"", max_core_restarts: int = 0):
        self.config, self.server, self.on_stats, self.cluster_key = config, server, on_stats, cluster_key
        self.on_death: Callable[[], None] = lambda: None
        self.on_core_up: Callable[[int, bool], None] = lambda rank, up: None
        self.codec = Codec(TO_FRONT)
        self.doorkeeper = Doorkeeper(config, cluster_key, self.codec)
        self.restarts = RestartPolicy(max_core_restarts)
        self.gave_up: str | None = None  # why the front stopped restarting its cores, once it did
        self.closing = False
        self.queues: dict[str, asyncio.Queue] = {}
        self.router = Router(server.data_parallel_routing)
        self.cores = [CoreHandle(rank) for rank in range(server.data_parallel_size)]
        self.all_ready: asyncio.Future | None = None
        self.reader: asyncio.Future | None = None  # the tasks that read the cores' messages and connections
        self.socket_dir = tempfile.TemporaryDirectory(prefix="nanoengine-")
        self.context = zmq.asyncio.Context()
        self.socket = cluster_socket(self.context, zmq.ROUTER, config)
        self.disconnects = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.local_address = f"ipc://{self.socket_dir.name}/engines"
        self.socket.bind(self.local_address)
        if server.data_parallel_address is not None:
            self.socket.bind(f"tcp://{server.data_parallel_address}")
        for core in self.cores[:server.data_parallel_size_local]:
            self.start_local(core)

    def start_local(self, core: CoreHandle) -> None:
        spawn = multiprocessing.get_context("spawn")
        core.process = spawn.Process(target=run_engine_core, name=f"nanoengine-core-{core.rank}",
                                     args=(self.config, self.local_address, core.rank,
                                           self.server.data_parallel_size_local, self.cluster_key))
        core.process.start()
        logger.info("engine core %d started (pid %d)", core.rank, core.process.pid)

    @property
    def unavailable(self) -> str | None:
        """Why no core can serve, once none can (or will again)."""
        gone = all(core.cause_of_death and core.restart_delay is None for core in self.cores)
        return "; ".join(core.cause_of_death for core in self.cores) if gone else None

    async def start(self) -> int:
        """Wait until every core has loaded the model; returns the max_model_len that all of them take."""
        loop = asyncio.get_running_loop()
        self.all_ready = loop.create_future()
        for core in self.cores:
            if core.process is not None:
                loop.add_reader(core.process.sentinel, self.core_exited, core)
        if self.server.data_parallel_size_local < len(self.cores):
            logger.info("waiting for engine cores %d..%d to join at tcp://%s", self.server.data_parallel_size_local,
                        len(self.cores) - 1, self.server.data_parallel_address)
        self.reader = asyncio.gather(self.read_messages(), self.watch_connections())
        return await self.all_ready

    async def read_messages(self) -> None:
        while True:
            identity, *frames = await self.socket.recv_multipart(copy=False)
            try:
                message = self.codec.decode(frames)
            except ValueError as error:
                self.doorkeeper.drop(identity.bytes.hex(), str(error))
                continue
            await self.dispatch(identity.bytes, message, frames[0].get(zmq.SRCFD))

    async def dispatch(self, identity: bytes, message, connection: int) -> None:
        """Act on a message that fits its sender's state; drop any other."""
        core = next((c for c in self.cores if c.identity == identity), None)
        if core is None and isinstance(message, Hello):
            await self.socket.send_multipart([identity, self.doorkeeper.challenge(identity, message)])
        elif core is None and isinstance(message, Proof) and identity in self.doorkeeper.handshakes:
            rank, reply = self.doorkeeper.admit(identity, message, self.cores)
            if rank is not None:
                core = self.cores[rank]
                core.identity, core.connection, core.cause_of_death, core.ready = identity, connection, None, False
            await self.socket.send_multipart([identity, reply])
        elif core is None:
            self.doorkeeper.drop(identity.hex(), f"a {type(message).__name__} from a peer that has not been admitted")
        elif core.cause_of_death:
            return  # from a core declared dead meanwhile
        elif isinstance(message, EngineCoreFailed):
            self.core_died(core, f"{core.describe()} failed: {message.why}")
        elif isinstance(message, Ready) and not core.ready:
            self.core_ready(core, message)
        elif isinstance(message, EngineCoreOutputs) and core.ready:
            self.route_outputs(core, message)
        else:
            self.doorkeeper.drop(identity.hex(), f"a {type(message).__name__} from {core.describe()}, which is "
                                                 f"{core.state}")

    async def watch_connections(self) -> None:
        """A core whose connection drops is dead; a peer not admitted that loses its connection is counted as a
        dropped frame (ZMQ cuts off a peer that sends a frame over the cap)."""
        while True:
            event = parse_monitor_message(await self.disconnects.recv_multipart())
            core = next((c for c in self.cores if c.connection == event["value"] and not c.cause_of_death), None)
            if core is not None:
                self.connection_lost(core)
            elif all(c.connection != event["value"] for c in self.cores):
                self.doorkeeper.drop(f"fd {event['value']}", "its connection closed before it was admitted (it left, "
                                     f"or sent a frame over the {max_frame_bytes(self.config)}-byte cap)")

    def connection_lost(self, core: CoreHandle) -> None:
        """A remote core is gone; a local one whose process still runs was silent past the heartbeat (stopped,
        swapping): it counts as dead, and is killed (then restarted as after any death)."""
        if core.process is None:
            return self.core_died(core, f"{core.describe()} disconnected")
        core.process.join(EXIT_GRACE_S)
        if core.process.exitcode is None:
            self.core_died(core, f"{core.describe()} was silent for more than {HEARTBEAT_TIMEOUT_S} s")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(core.process.pid, signal.SIGKILL)

    def core_ready(self, core: CoreHandle, ready: Ready) -> None:
        core.ready, core.capacity = True, ready.num_kvcache_blocks
        self.config.max_model_len = min(self.config.max_model_len, ready.max_model_len)
        logger.info("engine core %d ready (%d KV-cache blocks)", core.rank, ready.num_kvcache_blocks)
        self.on_core_up(core.rank, True)
        if all(c.ready for c in self.cores) and not self.all_ready.done():
            self.all_ready.set_result(self.config.max_model_len)

    def route_outputs(self, core: CoreHandle, message: EngineCoreOutputs) -> None:
        for output in message.outputs:
            if output.request_id in self.queues:
                self.queues[output.request_id].put_nowait(output)
        for request_id, (why, param) in message.refused.items():
            if request_id in self.queues:
                self.queues[request_id].put_nowait(field_error(param, why))
        core.num_running = message.stats.num_running
        self.on_stats(core.rank, message.stats)

    def core_exited(self, core: CoreHandle) -> None:
        asyncio.get_running_loop().remove_reader(core.process.sentinel)
        core.process.join()
        self.kill_process_group(core.process)
        if not core.cause_of_death:  # else it said why before it exited
            self.core_died(core, f"{core.describe()} died with exit code {core.process.exitcode}")
        if core.restart_delay is not None:
            asyncio.get_running_loop().call_later(core.restart_delay, self.restart, core)

    def restart(self, core: CoreHandle) -> None:
        if self.closing or self.gave_up:
            return
        core.identity = core.connection = core.restart_delay = core.cause_of_death = None
        core.ready, core.num_running = False, 0
        self.start_local(core)
        asyncio.get_running_loop().add_reader(core.process.sentinel, self.core_exited, core)

    def core_died(self, core: CoreHandle, why: str) -> None:
        if not self.all_ready.done():
            if core.process is None:  # a remote core lost while it loads: another may join under its rank
                logger.warning("%s while starting; waiting for rank %d to join again", why, core.rank)
                core.identity = None
            else:
                core.cause_of_death = why
                self.all_ready.set_exception(RuntimeError(f"{why} while starting"))
            return
        core.cause_of_death = why
        num_left = sum(not c.cause_of_death for c in self.cores)
        logger.error("%s; %d of %d engine cores left", why, num_left, len(self.cores))
        for request_id in core.request_ids:
            self.queues[request_id].put_nowait(EngineUnavailableError(why))
        core.recent_hashes.clear()
        self.on_core_up(core.rank, False)
        if core.process is not None and self.restarts.max_restarts and not self.closing:
            core.restart_delay = self.restarts.after_death()
            if core.restart_delay is None:
                self.gave_up = self.restarts.describe()
                logger.error("%s: giving up", self.gave_up)
                return self.on_death()
            logger.warning("restarting engine core %d in %g s", core.rank, core.restart_delay)
        if self.unavailable:
            self.on_death()

    def fail_all(self, error: Exception) -> None:
        for queue in self.queues.values():
            queue.put_nowait(error)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The request's DELTA outputs (with the rank of the core that runs it) until it finishes; aborted in
        its engine core if abandoned early."""
        live = [core for core in self.cores if core.ready and not core.cause_of_death]
        if not live:
            raise EngineUnavailableError(self.unavailable or "no engine core is ready")
        hashes = prompt_hashes(request.prompt_token_ids, request.cache_salt, self.config.kvcache_block_size,
                               self.config.prefix_caching_hash_algo)
        core = self.router.pick(live, hashes)
        core.remember(hashes)
        queue = self.queues[request.request_id] = asyncio.Queue()
        core.request_ids.add(request.request_id)
        finished = False
        try:
            await self.socket.send_multipart([core.identity, self.codec.encode(request)])
            while not finished:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                finished = output.finished
                yield core.rank, output
        finally:
            del self.queues[request.request_id]
            core.request_ids.discard(request.request_id)
            if not finished and not core.cause_of_death:  # an abort: fire and forget
                self.socket.send_multipart([core.identity, self.codec.encode(Abort([request.request_id]))])

    def health(self) -> list[dict]:
        return [{"rank": core.rank, "state": core.state, "pid": core.process and core.process.pid,
                 "num_requests": len(core.request_ids), **({"why": core.cause_of_death} if core.cause_of_death else {})}
                for core in self.cores]

    def close(self) -> None:
        """Stop the local cores (each closes its tensor-parallel workers), then sweep their process groups; the
        remote ones see the connection drop and stop themselves."""
        loop = asyncio.get_running_loop()
        self.closing = True
        local = [core.process for core in self.cores if core.process is not None]
        for process in local:
            loop.remove_reader(process.sentinel)  # from here on, its end is expected
            if process.is_alive():
                process.terminate()
        if self.reader is not None:
            self.reader.cancel()
        for process in local:
            process.join(STOP_TIMEOUT_S)
            self.kill_process_group(process)
        self.context.destroy(linger=0)
        self.socket_dir.cleanup()

    @staticmethod
    def kill_process_group(process: multiprocessing.Process) -> None:
        with contextlib.suppress(ProcessLookupError):  # nothing of the group is left
            os.killpg(process.pid, signal.SIGKILL)
        process.join()
