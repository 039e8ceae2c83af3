"""The front process's handle on the engine core: starts it, sends requests, routes outputs to asyncio queues.

One reader task receives every ``EngineCoreOutputs`` and puts each request's outputs on that
request's queue, so a slow HTTP client only ever delays its own queue. The event loop also watches
the engine-core process's sentinel: when the process dies, every waiting request gets
``EngineUnavailableError`` at once and ``on_death`` runs.
"""

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import tempfile
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from nanoengine.config import EngineConfig
from nanoengine.outputs import EngineStats, RequestOutput
from nanoengine.serve.engine_core import EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, run_engine_core

logger = logging.getLogger("nanoengine.serve")
STOP_TIMEOUT_S = 30  # how long a stopping engine core may take to close before it is killed


class EngineUnavailableError(RuntimeError):
    pass


class EngineCoreClient:
    def __init__(self, config: EngineConfig, on_stats: Callable[[EngineStats], None]):
        self.on_stats = on_stats
        self.on_death: Callable[[], None] = lambda: None
        self.queues: dict[str, asyncio.Queue] = {}
        self.dead: str | None = None  # why the engine core is gone, once it is
        self.reader: asyncio.Task | None = None
        self.socket_dir = tempfile.TemporaryDirectory(prefix="nanoengine-")
        input_address, output_address = (f"ipc://{self.socket_dir.name}/{name}" for name in ("in", "out"))
        self.context = zmq.asyncio.Context()
        self.inputs, self.outputs = self.context.socket(zmq.PUSH), self.context.socket(zmq.PULL)
        self.inputs.bind(input_address)
        self.outputs.bind(output_address)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, input_address, output_address), name="nanoengine-core")
        self.process.start()
        logger.info("engine core started (pid %d)", self.process.pid)

    async def start(self) -> EngineCoreReady:
        """Wait until the engine core has loaded the model; then route its outputs and watch its life."""
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(self.process.sentinel, died.set_result, None)
        ready = asyncio.ensure_future(self.outputs.recv())
        await asyncio.wait([died, ready], return_when=asyncio.FIRST_COMPLETED)
        loop.remove_reader(self.process.sentinel)
        if not ready.done():
            ready.cancel()
            raise RuntimeError(f"the engine core exited with code {self.process.exitcode} while starting")
        self.reader = asyncio.create_task(self.read_outputs())
        loop.add_reader(self.process.sentinel, self.engine_died)
        return pickle.loads(ready.result())

    async def read_outputs(self) -> None:
        while True:
            message: EngineCoreOutputs = pickle.loads(await self.outputs.recv())
            for output in message.outputs:
                if output.request_id in self.queues:
                    self.queues[output.request_id].put_nowait(output)
            for request_id, why in message.refused.items():
                if request_id in self.queues:
                    self.queues[request_id].put_nowait(ValueError(why))
            self.on_stats(message.stats)

    def engine_died(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join()
        self.dead = f"the engine core (pid {self.process.pid}) died with exit code {self.process.exitcode}"
        logger.error("%s; shutting down", self.dead)
        self.kill_process_group()
        self.fail_all(EngineUnavailableError(self.dead))
        self.on_death()

    def fail_all(self, error: Exception) -> None:
        for queue in self.queues.values():
            queue.put_nowait(error)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[RequestOutput]:
        """The request's DELTA outputs until it finishes; aborted in the engine core if abandoned early."""
        if self.dead:
            raise EngineUnavailableError(self.dead)
        queue = self.queues[request.request_id] = asyncio.Queue()
        finished = False
        try:
            await self.inputs.send_pyobj(request)
            while not finished:
                output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                finished = output.finished
                yield output
        finally:
            del self.queues[request.request_id]
            if not finished and not self.dead:
                self.inputs.send_pyobj([request.request_id])  # an abort: fire and forget

    def close(self) -> None:
        """Stop the engine core (it closes its tensor-parallel workers), then sweep its process group."""
        asyncio.get_running_loop().remove_reader(self.process.sentinel)  # from here on, its end is expected
        if self.reader is not None:
            self.reader.cancel()
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
        self.kill_process_group()
        self.context.destroy(linger=0)
        self.socket_dir.cleanup()

    def kill_process_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # nothing of the group is left
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.join()
