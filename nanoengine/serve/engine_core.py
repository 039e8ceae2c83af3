"""The engine-core process: one LLMEngine stepping in a loop, fed and read over two ZMQ sockets.

The front process pushes ``EngineCoreRequest``s and abort lists; after each wake-up the core answers
with one ``EngineCoreOutputs`` (the step's DELTA outputs, requests it refused, a stats snapshot).
With nothing to run it blocks on its input socket and on its parent's sentinel, so it never spins,
and it exits at once when the front process dies. It runs in a process group of its own, so the
front can sweep it and its tensor-parallel workers with one signal if it is killed.
"""

import multiprocessing
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field

import zmq

from nanoengine.config import EngineConfig
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import EngineStats, RequestOutput
from nanoengine.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # with output_kind=DELTA
    priority: int
    arrival_time: float  # wall clock (time.time()), stamped in the front
    cache_salt: str | None = None


@dataclass
class EngineCoreOutputs:
    outputs: list[RequestOutput]
    stats: EngineStats
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why make_request refused it


@dataclass
class EngineCoreReady:
    max_model_len: int  # possibly lowered to fit the KV cache


def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the front, which then stops this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds through engine.close() below
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    engine = LLMEngine(config)
    try:
        outputs.send_pyobj(EngineCoreReady(engine.config.max_model_len))
        serve_forever(engine, inputs, outputs, multiprocessing.parent_process().sentinel)
    finally:
        engine.close()
        context.destroy(linger=0)
        if not multiprocessing.parent_process().is_alive():  # a killed front leaves its socket folder behind
            shutil.rmtree(os.path.dirname(input_address.removeprefix("ipc://")), ignore_errors=True)


def serve_forever(engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket, parent_sentinel: int) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    poller.register(parent_sentinel, zmq.POLLIN)
    while True:
        idle = not engine.has_unfinished_requests()
        ready = dict(poller.poll(None if idle else 0))
        if parent_sentinel in ready:
            return  # the front process is gone
        refused = {}
        while inputs.poll(0):
            refused.update(handle(engine, inputs.recv_pyobj()))
        step_outputs = engine.step() if engine.has_unfinished_requests() else []
        stats = engine.stats()
        stats.step_history = []  # the front needs only the current figures
        outputs.send_pyobj(EngineCoreOutputs(step_outputs, stats, refused))


def handle(engine: LLMEngine, message: EngineCoreRequest | list[str]) -> dict[str, str]:
    """Queue a request or abort a list of ids; a request the engine refuses is reported, never raised."""
    if isinstance(message, list):
        engine.abort_request(message)
        return {}
    prompt = {"prompt_token_ids": message.prompt_token_ids, "cache_salt": message.cache_salt}
    try:
        engine.enqueue(engine.make_request(message.request_id, prompt, message.params, message.priority,
                                           message.arrival_time))
    except Exception as error:  # the front validated it already: whatever fails now fails this request only
        return {message.request_id: str(error)}
    return {}
