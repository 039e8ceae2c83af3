"""The engine-core process: one LLMEngine stepping in a loop, fed and read over one ZMQ DEALER socket.

A core connects to the front, joins it (cluster/handshake.py: the cluster key), loads the model and says it
is ready. From then on the front sends requests and aborts; after each wake-up the core answers with one
``EngineCoreOutputs`` (the step's DELTA outputs, requests it refused, a stats snapshot), or, when a step
fails, ``EngineCoreFailed`` before it exits. With nothing to run it blocks on its socket and on a sign that
the front is gone, so it never spins, and it exits at once when the front dies.
"""

import logging
import multiprocessing
import os
import shutil
import signal
import sys

import torch
import zmq

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
    cluster_socket,
    fingerprint,
    mac,
    new_nonce,
    proves,
)
from nanoengine.utils.gc_heap import freeze_startup_heap

logger = logging.getLogger("nanoengine.serve")


def connect(context: zmq.Context, address: str, config: EngineConfig) -> zmq.Socket:
    socket = cluster_socket(context, zmq.DEALER, config)
    socket.connect(address)
    return socket


def run_engine_core(config: EngineConfig, address: str, rank: int, num_local_cores: int, cluster_key: bytes) -> None:
    """A core the front started on this node, sharing its CPU threads with the other local cores; in a process
    group of its own, so that the front can sweep it and its tensor-parallel workers with one signal."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the front, which then stops this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds through engine.close() below
    torch.set_num_threads(max(1, torch.get_num_threads() // num_local_cores))
    if config.device.startswith("cuda"):
        pin_gpus(config, rank, num_local_cores)
    context = zmq.Context()
    parent = multiprocessing.parent_process().sentinel
    try:
        run(config, connect(context, address, config), rank, cluster_key, parent, lambda: True)
    finally:
        context.destroy(linger=0)
        if not multiprocessing.parent_process().is_alive():  # a killed front leaves its socket folder behind
            shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)


def pin_gpus(config: EngineConfig, rank: int, num_local_cores: int) -> None:
    """Local core r sees only its own GPUs, r * TP .. (r + 1) * TP - 1 of those visible, as its cuda:0.. (as vLLM
    does); set before anything in this process initializes CUDA."""
    size = config.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(num_local_cores * size)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[rank * size:(rank + 1) * size])


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
    """The handshake (codec.py draws it): None once the front admitted this core, else why not."""
    socket.send(codec.encode(hello))
    challenge = receive(socket, codec, Challenge)
    socket.send(codec.encode(Proof(mac(cluster_key, "core", challenge.nonce, hello.nonce))))
    reply = receive(socket, codec, JoinReply)
    if reply.refusal is None and not proves(cluster_key, reply.mac, "front", hello.nonce, challenge.nonce):
        return "the front did not prove that it holds the cluster key (is this core's key the server's?)"
    return reply.refusal


def receive(socket: zmq.Socket, codec: Codec, expected: type):
    """The next message from the front if it is an ``expected``; any other frame is dropped (and logged)."""
    while True:
        message = codec.receive(socket)
        if isinstance(message, expected):
            return message
        if message is not None:
            logger.warning("engine core: dropped a %s from the front (a %s was expected)", type(message).__name__,
                           expected.__name__)


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
            refused.update(handle(engine, codec.receive(socket)))
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
