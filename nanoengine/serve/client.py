"""The front process's handle on its engine cores: starts the local ones, admits the remote ones, routes each
request to one core and each core's outputs to asyncio queues.

Every core talks to one ROUTER socket (ipc for the local cores, TCP at ``data_parallel_address`` for the
``--headless`` ones). One reader task receives every message and puts each request's outputs on that
request's queue, so a slow HTTP client only ever delays its own queue. A core dies when its process exits
(the event loop watches each local core's sentinel) or when a remote core's connection drops (ZMQ's
heartbeats notice a silent node within seconds). Its requests then get ``EngineUnavailableError`` at
once and the other cores keep serving. A dead local core is started again under ``RestartPolicy``
(supervisor.py); a remote one may join again under its rank. When no core is left and none will be
restarted, or the policy gives up, ``dead`` or ``gave_up`` says why and ``on_death`` runs.

The reader trusts no frame (codec.py has the protocol): a peer that has not proved the cluster key may only
say hello and answer its challenge, an admitted core may only send what its state expects, and a frame that
does not decode, or does not fit, is dropped and counted (``dropped_frames``; a log line at most every
``DROP_LOG_INTERVAL_S``). Nothing else happens: the serving cores never notice.
"""

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from nanoengine.config import EngineConfig
from nanoengine.outputs import EngineStats, RequestOutput
from nanoengine.sampling_params import field_error
from nanoengine.serve.cluster.router import CoreLoad, Router, prompt_hashes
from nanoengine.serve.cluster.supervisor import RestartPolicy
from nanoengine.serve.codec import (
    TO_FRONT,
    Abort,
    Challenge,
    Codec,
    EngineCoreFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    Hello,
    JoinReply,
    Proof,
    Ready,
    mac,
    new_nonce,
    proves,
)
from nanoengine.serve.engine_core import HEARTBEAT_MS, fingerprint, run_engine_core

logger = logging.getLogger("nanoengine.serve")
STOP_TIMEOUT_S = 30  # how long a stopping engine core may take to close before it is killed
MAX_HANDSHAKES = 16  # peers between their hello and their proof; a newer one pushes out the oldest
DROP_LOG_INTERVAL_S = 10.0


class EngineUnavailableError(RuntimeError):
    pass


@dataclass
class EngineCore(CoreLoad):
    process: multiprocessing.Process | None = None  # a local core's; None for a remote one
    identity: bytes | None = None  # its peer on the ROUTER socket, once it said hello
    connection: int | None = None  # that peer's file descriptor, which names it in disconnection events
    ready: bool = False
    dead: str | None = None  # why it is gone, once it is
    restart_delay: float | None = None  # once dead: seconds until it is started again, if it will be

    @property
    def state(self) -> str:
        if self.dead:
            return "dead" if self.restart_delay is None else "restarting"
        return "ready" if self.ready else "starting"

    def describe(self) -> str:
        where = f"pid {self.process.pid}" if self.process else "remote"
        return f"the engine core (rank {self.rank}, {where})"


class EngineCoreClient:
    def __init__(self, config: EngineConfig, on_stats: Callable[[int, EngineStats], None], cluster_key: bytes = b"",
                 max_core_restarts: int = 0):
        self.config, self.on_stats, self.cluster_key = config, on_stats, cluster_key
        self.on_death: Callable[[], None] = lambda: None
        self.on_dropped_frame: Callable[[], None] = lambda: None
        self.on_core_up: Callable[[int, bool], None] = lambda rank, up: None
        self.codec = Codec(TO_FRONT)
        self.handshakes: dict[bytes, tuple[Hello, bytes]] = {}  # peer -> its hello and the nonce it must sign
        self.dropped_frames, self.next_drop_log = 0, 0.0
        self.restarts = RestartPolicy(max_core_restarts)
        self.gave_up: str | None = None  # why the front stopped restarting its cores, once it did
        self.closing = False
        self.queues: dict[str, asyncio.Queue] = {}
        self.router = Router(config.data_parallel_routing)
        self.cores = [EngineCore(rank) for rank in range(config.data_parallel_size)]
        self.expected = fingerprint(config)
        self.all_ready: asyncio.Future | None = None
        self.reader: asyncio.Future | None = None  # the tasks that read the cores' messages and connections
        self.socket_dir = tempfile.TemporaryDirectory(prefix="nanoengine-")
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.disconnects = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        for option, value in HEARTBEAT_MS.items():
            self.socket.setsockopt(option, value)
        self.local_address = f"ipc://{self.socket_dir.name}/engines"
        self.socket.bind(self.local_address)
        if config.data_parallel_address is not None:
            self.socket.bind(f"tcp://{config.data_parallel_address}")
        for core in self.cores[:config.data_parallel_size_local]:
            self.start_local(core)

    def start_local(self, core: EngineCore) -> None:
        spawn = multiprocessing.get_context("spawn")
        core.process = spawn.Process(target=run_engine_core,
                                     args=(self.config, self.local_address, core.rank, self.cluster_key),
                                     name=f"nanoengine-core-{core.rank}")
        core.process.start()
        logger.info("engine core %d started (pid %d)", core.rank, core.process.pid)

    @property
    def dead(self) -> str | None:
        """Why no core can serve, once none can (or will again)."""
        gone = all(core.dead and core.restart_delay is None for core in self.cores)
        return "; ".join(core.dead for core in self.cores) if gone else None

    async def start(self) -> int:
        """Wait until every core has loaded the model; returns the max_model_len that all of them take."""
        loop = asyncio.get_running_loop()
        self.all_ready = loop.create_future()
        for core in self.cores:
            if core.process is not None:
                loop.add_reader(core.process.sentinel, self.core_exited, core)
        if self.config.data_parallel_size_local < len(self.cores):
            logger.info("waiting for engine cores %d..%d to join at tcp://%s", self.config.data_parallel_size_local,
                        len(self.cores) - 1, self.config.data_parallel_address)
        self.reader = asyncio.gather(self.read_messages(), self.watch_connections())
        return await self.all_ready

    async def read_messages(self) -> None:
        while True:
            identity, *frames = await self.socket.recv_multipart(copy=False)
            try:
                message = self.codec.decode(frames)
            except ValueError as error:
                self.drop(identity.bytes, str(error))
                continue
            await self.dispatch(identity.bytes, message, frames[0].get(zmq.SRCFD))

    async def dispatch(self, identity: bytes, message, connection: int) -> None:
        """Act on a message that fits its sender's state; drop any other."""
        core = next((c for c in self.cores if c.identity == identity), None)
        if core is None and isinstance(message, Hello):
            await self.challenge(identity, message)
        elif core is None and isinstance(message, Proof) and identity in self.handshakes:
            await self.admit(identity, message, connection)
        elif core is None:
            self.drop(identity, f"a {type(message).__name__} from a peer that has not been admitted")
        elif core.dead:
            return  # from a core declared dead meanwhile
        elif isinstance(message, EngineCoreFailed):
            self.core_died(core, f"{core.describe()} failed: {message.why}")
        elif isinstance(message, Ready) and not core.ready:
            self.core_ready(core, message)
        elif isinstance(message, EngineCoreOutputs) and core.ready:
            self.route_outputs(core, message)
        else:
            self.drop(identity, f"a {type(message).__name__} from {core.describe()}, which is {core.state}")

    def drop(self, identity: bytes, why: str) -> None:
        self.dropped_frames += 1
        self.on_dropped_frame()
        now = time.monotonic()
        if now >= self.next_drop_log:
            self.next_drop_log = now + DROP_LOG_INTERVAL_S
            logger.warning("dropped a frame from peer %s on the engine-core socket: %s (%d dropped so far)",
                           identity.hex(), why, self.dropped_frames)

    async def watch_connections(self) -> None:
        """A remote core whose connection drops (its process ended, or its node fell silent) is dead."""
        while True:
            event = parse_monitor_message(await self.disconnects.recv_multipart())
            core = next((c for c in self.cores if c.connection == event["value"] and not c.dead), None)
            if core is not None and core.process is None:
                self.core_died(core, f"{core.describe()} disconnected")

    async def challenge(self, identity: bytes, hello: Hello) -> None:
        """Answer a hello with a nonce for the peer to sign with the cluster key."""
        if len(self.handshakes) >= MAX_HANDSHAKES:
            del self.handshakes[next(iter(self.handshakes))]
        nonce = new_nonce()
        self.handshakes[identity] = hello, nonce
        await self.socket.send_multipart([identity, self.codec.encode(Challenge(nonce))])

    async def admit(self, identity: bytes, proof: Proof, connection: int) -> None:
        """Take a core that proved the cluster key under the rank it said hello with, or tell it why not."""
        hello, nonce = self.handshakes.pop(identity)
        if proves(self.cluster_key, proof.mac, "core", nonce, hello.nonce):
            why = self.refusal(hello)
        else:
            why = "it did not prove the cluster key (is its key this server's?)"
        if why is None:
            core = self.cores[hello.rank]
            core.identity, core.connection, core.dead, core.ready = identity, connection, None, False
        else:
            logger.warning("refused an engine core claiming rank %d: %s", hello.rank, why)
        reply = JoinReply(why, mac(self.cluster_key, "front", hello.nonce, nonce) if why is None else b"")
        await self.socket.send_multipart([identity, self.codec.encode(reply)])

    def refusal(self, hello: Hello) -> str | None:
        """Why a core that proved the key may not serve under the rank it claims, or None."""
        core = self.cores[hello.rank] if 0 <= hello.rank < len(self.cores) else None
        differences = [f"{name}={hello.fingerprint.get(name)!r} (this server: {value!r})"
                       for name, value in self.expected.items() if hello.fingerprint.get(name) != value]
        if core is None:
            return f"rank {hello.rank} is outside this server's data_parallel_size={len(self.cores)}"
        if differences:
            return "it runs another model or config: " + "; ".join(differences)
        if core.process is not None and core.identity is not None:
            return f"rank {hello.rank} is one of this server's own local cores"
        if core.identity is not None and not core.dead:
            return f"rank {hello.rank} is already served by another engine core"
        return None

    def core_ready(self, core: EngineCore, ready: Ready) -> None:
        core.ready, core.capacity = True, ready.num_kvcache_blocks
        self.config.max_model_len = min(self.config.max_model_len, ready.max_model_len)
        logger.info("engine core %d ready (%d KV-cache blocks)", core.rank, ready.num_kvcache_blocks)
        self.on_core_up(core.rank, True)
        if all(c.ready for c in self.cores) and not self.all_ready.done():
            self.all_ready.set_result(self.config.max_model_len)

    def route_outputs(self, core: EngineCore, message: EngineCoreOutputs) -> None:
        for output in message.outputs:
            if output.request_id in self.queues:
                self.queues[output.request_id].put_nowait(output)
        for request_id, (why, param) in message.refused.items():
            if request_id in self.queues:
                self.queues[request_id].put_nowait(field_error(param, why))
        core.num_running = message.stats.num_running
        self.on_stats(core.rank, message.stats)

    def core_exited(self, core: EngineCore) -> None:
        asyncio.get_running_loop().remove_reader(core.process.sentinel)
        core.process.join()
        self.kill_process_group(core.process)
        if not core.dead:  # else it said why before it exited
            self.core_died(core, f"{core.describe()} died with exit code {core.process.exitcode}")
        if core.restart_delay is not None:
            asyncio.get_running_loop().call_later(core.restart_delay, self.restart, core)

    def restart(self, core: EngineCore) -> None:
        if self.closing or self.gave_up:
            return
        core.identity = core.connection = core.restart_delay = core.dead = None
        core.ready, core.num_running = False, 0
        self.start_local(core)
        asyncio.get_running_loop().add_reader(core.process.sentinel, self.core_exited, core)

    def core_died(self, core: EngineCore, why: str) -> None:
        if not self.all_ready.done():
            if core.process is None:  # a remote core lost while it loads: another may join under its rank
                logger.warning("%s while starting; waiting for rank %d to join again", why, core.rank)
                core.identity = None
            else:
                core.dead = why
                self.all_ready.set_exception(RuntimeError(f"{why} while starting"))
            return
        core.dead = why
        logger.error("%s; %d of %d engine cores left", why, sum(not c.dead for c in self.cores), len(self.cores))
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
        if self.dead:
            self.on_death()

    def fail_all(self, error: Exception) -> None:
        for queue in self.queues.values():
            queue.put_nowait(error)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The request's DELTA outputs (with the rank of the core that runs it) until it finishes; aborted in
        its engine core if abandoned early."""
        live = [core for core in self.cores if core.ready and not core.dead]
        if not live:
            raise EngineUnavailableError(self.dead or "no engine core is ready")
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
            if not finished and not core.dead:  # an abort: fire and forget
                self.socket.send_multipart([core.identity, self.codec.encode(Abort([request.request_id]))])

    def health(self) -> list[dict]:
        return [{"rank": core.rank, "state": core.state, "pid": core.process and core.process.pid,
                 "num_requests": len(core.request_ids), **({"why": core.dead} if core.dead else {})}
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
