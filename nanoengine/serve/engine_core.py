"""The engine-core process: one LLMEngine stepping in a loop, fed and read over one ZMQ DEALER socket.

A core connects to the front's ROUTER socket (ipc for a core the front started, TCP for a ``--headless``
core on another node), says who it is (its rank and its config's fingerprint), and it and the front prove
that they hold the cluster key (codec.py has the messages). The front admits the core, or says why not
(another model or config, a wrong key); an admitted core loads the model and says it is ready. From then on
the front sends requests and aborts; after each wake-up the core answers with one ``EngineCoreOutputs`` (the
step's DELTA outputs, requests it refused, a stats snapshot), or, when a step fails, with ``EngineCoreFailed``
(the error, which names a dead tensor-parallel rank) before it exits. A frame that is not what the core's
state expects is logged and dropped. With nothing to run it blocks on its socket and on a sign
that the front is gone (its parent's sentinel, or for a headless core the socket's disconnection),
so it never spins, and it exits at once when the front dies. A local core runs in a process group of
its own, so the front can sweep it and its tensor-parallel workers with one signal if it is killed.
"""

import logging
import multiprocessing
import os
import shutil
import signal
import sys
from dataclasses import fields
from pathlib import Path

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from nanoengine.config import EngineConfig
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.serve.codec import (
    TO_CORE,
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
from nanoengine.utils.gc_heap import freeze_startup_heap

logger = logging.getLogger("nanoengine.serve")


# Options that may differ from core to core: where the files are, how much memory the KV cache takes,
# which core this is, and what only the front uses.
NODE_LOCAL_OPTIONS = {"model", "tokenizer", "num_kvcache_blocks", "gpu_memory_utilization", "cpu_kvcache_space_gib",
                      "trace", "data_parallel_size_local", "data_parallel_rank", "data_parallel_address",
                      "data_parallel_routing"}
HEARTBEAT_MS = {zmq.HEARTBEAT_IVL: 1000, zmq.HEARTBEAT_TIMEOUT: 5000}  # a silent peer is dropped after 5 s


def fingerprint(config: EngineConfig) -> dict:
    """What two cores behind one front must share: the model (its folder's name and its config) and every
    engine option that changes what a request gets; as a hello carries it (tuples become lists)."""
    model = {k: v for k, v in config.hf_config.to_dict().items()
             if not k.startswith("_") and k != "transformers_version"}
    options = {f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name not in NODE_LOCAL_OPTIONS}
    return msgspec.msgpack.decode(msgspec.msgpack.encode({"model name": Path(config.model).name,
                                                          "model config": model, **options}))


def connect(context: zmq.Context, address: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    for option, value in HEARTBEAT_MS.items():
        socket.setsockopt(option, value)
    socket.connect(address)
    return socket


def run_engine_core(config: EngineConfig, address: str, rank: int, cluster_key: bytes) -> None:
    """A core the front started on this node (one of ``data_parallel_size_local``, sharing its CPU threads)."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the front, which then stops this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds through engine.close() below
    torch.set_num_threads(max(1, torch.get_num_threads() // config.data_parallel_size_local))
    if config.device.startswith("cuda"):
        pin_gpus(config, rank)
    context = zmq.Context()
    parent = multiprocessing.parent_process().sentinel
    try:
        run(config, connect(context, address), rank, cluster_key, parent, lambda: True)
    finally:
        context.destroy(linger=0)
        if not multiprocessing.parent_process().is_alive():  # a killed front leaves its socket folder behind
            shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)


def pin_gpus(config: EngineConfig, rank: int) -> None:
    """Local core r sees only its own GPUs, r * TP .. (r + 1) * TP - 1 of those visible, as its cuda:0.. (as vLLM
    does); set before anything in this process initializes CUDA."""
    size = config.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(config.data_parallel_size_local * size)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[rank * size:(rank + 1) * size])


def run_headless_core(config: EngineConfig, cluster_key: bytes) -> int:
    """``nanoengine serve --headless --data-parallel-rank R --data-parallel-address HOST:PORT``: one core that
    joins the front over TCP and runs until the front goes away."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    context = zmq.Context()
    address = f"tcp://{config.data_parallel_address}"
    socket = connect(context, address)
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    logger.info("engine core %d: joining the front at %s", config.data_parallel_rank, address)
    try:
        return run(config, socket, config.data_parallel_rank, cluster_key, monitor,
                   lambda: drained_disconnect(monitor))
    finally:
        context.destroy(linger=0)


def drained_disconnect(monitor: zmq.Socket) -> bool:
    events = []
    while monitor.poll(0):
        events.append(recv_monitor_message(monitor)["event"])
    return zmq.EVENT_DISCONNECTED in events


def run(config: EngineConfig, socket: zmq.Socket, rank: int, cluster_key: bytes, front_watch, front_gone) -> int:
    """Join the front (or be refused), load the model, then serve until the front is gone."""
    codec = Codec(TO_CORE)
    refusal = join(socket, codec, Hello(rank, fingerprint(config), new_nonce()), cluster_key)
    if refusal is not None:
        logger.error("engine core %d: the front refused this core: %s", rank, refusal)
        return 1
    engine = LLMEngine(config)
    freeze_startup_heap()
    try:
        socket.send(codec.encode(Ready(engine.config.max_model_len, len(engine.block_manager.blocks))))
        serve_forever(engine, socket, codec, front_watch, front_gone)
    finally:
        engine.close()
    logger.info("engine core %d: the front is gone; stopping", rank)
    return 0


def join(socket: zmq.Socket, codec: Codec, hello: Hello, cluster_key: bytes) -> str | None:
    """The handshake (see codec.py): None once the front admitted this core, else why not."""
    socket.send(codec.encode(hello))
    challenge = receive(socket, codec, Challenge)
    socket.send(codec.encode(Proof(mac(cluster_key, "core", challenge.nonce, hello.nonce))))
    reply = receive(socket, codec, JoinReply)
    if reply.refusal is None and not proves(cluster_key, reply.mac, "front", hello.nonce, challenge.nonce):
        return "the front did not prove that it holds the cluster key (is this core's key the server's?)"
    return reply.refusal


def receive(socket: zmq.Socket, codec: Codec, expected: type):
    """The next message from the front if it is an ``expected``; any other frame is dropped."""
    while True:
        message = decoded(socket, codec)
        if isinstance(message, expected):
            return message
        if message is not None:
            logger.warning("engine core: dropped a %s from the front (a %s was expected)", type(message).__name__,
                           expected.__name__)


def decoded(socket: zmq.Socket, codec: Codec):
    """The next message from the front, or None (logged) when its frame does not decode."""
    try:
        return codec.decode(socket.recv_multipart(copy=False))
    except ValueError as error:
        logger.warning("engine core: dropped a frame from the front: %s", error)
        return None


def serve_forever(engine: LLMEngine, socket: zmq.Socket, codec: Codec, front_watch, front_gone) -> None:
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(front_watch, zmq.POLLIN)
    while True:
        idle = not engine.has_unfinished_requests()
        ready = dict(poller.poll(None if idle else 0))
        if front_watch in ready and front_gone():
            return
        refused = {}
        while socket.poll(0):
            refused.update(handle(engine, decoded(socket, codec)))
        try:
            step_outputs = engine.step() if engine.has_unfinished_requests() else []
        except Exception as error:
            socket.send(codec.encode(EngineCoreFailed(f"{type(error).__name__}: {error}")))
            raise
        for output in step_outputs:  # the front has them: not worth resending each step (and node to node)
            output.prompt_token_ids = []
        stats = engine.stats()
        stats.step_history = []  # the front needs only the current figures
        socket.send(codec.encode(EngineCoreOutputs(step_outputs, stats, refused)))


def handle(engine: LLMEngine, message) -> dict[str, tuple[str, str | None]]:
    """Queue a request or abort a list of ids; a request the engine refuses is reported (why, and the field
    at fault where the error names one), never raised. Any other message is dropped."""
    if isinstance(message, Abort):
        engine.abort_request(message.request_ids)
        return {}
    if not isinstance(message, EngineCoreRequest):
        if message is not None:
            logger.warning("engine core: dropped a %s from the front while serving", type(message).__name__)
        return {}
    prompt = {"prompt_token_ids": message.prompt_token_ids, "cache_salt": message.cache_salt}
    try:
        engine.enqueue(engine.make_request(message.request_id, prompt, message.params, message.priority,
                                           message.arrival_time))
    except Exception as error:  # the front validated it already: whatever fails now fails this request only
        return {message.request_id: (str(error), getattr(error, "param", None))}
    return {}
