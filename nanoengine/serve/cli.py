"""``nanoengine serve [MODEL] [--port N] [every LLM option as a --flag]``: the OpenAI-compatible server.

The front process (this one) validates the options, starts the engine-core processes, and serves HTTP
once every core has loaded the model. SIGTERM drains, SIGINT stops at once; a local engine core that dies
is started again. ``--headless`` runs an engine core (or a tensor-parallel node) for a front on another
node instead. docs/serving.md and docs/operations.md explain it all; docs/security.md the cluster key.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import fields
from pathlib import Path

import torch
import uvicorn

from nanoengine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, EngineConfig
from nanoengine.engine.arg_utils import add_option_flags
from nanoengine.engine.processor import Processor
from nanoengine.serve.api_server import create_app
from nanoengine.serve.client import STOP_TIMEOUT_S, EngineCoreClient, logger
from nanoengine.serve.cluster.admission import AdmissionControl, AdmissionLimits, Shutdown
from nanoengine.serve.cluster.limits import connection_limit, filter_repeats, raise_open_file_limit
from nanoengine.serve.cluster.nodes import (
    CLUSTER_KEY_VARIABLE,
    MIN_CLUSTER_KEY_BYTES,
    read_cluster_key,
    run_headless_core,
    run_tensor_parallel_node,
    warn_unless_private,
)
from nanoengine.serve.config import ServerConfig
from nanoengine.serve.metrics import Metrics
from nanoengine.serve.pipeline import OpenAIServer
from nanoengine.serve.tools import TOOL_CALL_PARSERS
from nanoengine.utils.default_model import default_model_path
from nanoengine.utils.gc_heap import freeze_startup_heap

ENGINE_OPTIONS = [f for f in fields(EngineConfig) if f.init and f.name != "model"]
SERVER_OPTIONS = fields(ServerConfig)
SERVER_CPU_DEFAULTS = {"max_num_batched_tokens": 2048, "max_num_seqs": 128}  # vLLM's API server's, on the CPU
SHOWN_DEFAULTS = {name: f"{value} on the CPU, as vLLM's server; else {elsewhere}" for (name, value), elsewhere in
                  zip(SERVER_CPU_DEFAULTS.items(), (DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"], DEFAULT_MAX_NUM_SEQS))}
WAITING_TOKENS_IN_STEPS = 8  # the default token cap: this many full steps (max_num_batched_tokens) of prompts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoengine serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("NANOENGINE_API_KEY"),
                        help="demand 'Authorization: Bearer KEY' on /v1 routes (default: $NANOENGINE_API_KEY)")
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                        help="refuse (413) a request body larger than this (default: 4 MiB)")
    parser.add_argument("--max-waiting-requests", type=int,
                        help="refuse (429) new requests while this many wait for their first token; 0 = no limit "
                             "(default: max_num_seqs, one more batch)")
    parser.add_argument("--max-waiting-tokens", type=int,
                        help="refuse (429) a request whose prompt would take the tokens waiting past this; 0 = no "
                             f"limit (default: {WAITING_TOKENS_IN_STEPS} x max_num_batched_tokens)")
    parser.add_argument("--max-queue-seconds", type=float, default=0,
                        help="end (503) a request that got no first token within this many seconds; 0 = never "
                             "(default: 0)")
    parser.add_argument("--shutdown-timeout", type=float, default=20,
                        help="on SIGTERM, let in-flight requests finish for up to this many seconds; 0 = end them "
                             "at once (default: 20, within Kubernetes' 30 s grace period)")
    parser.add_argument("--max-core-restarts", type=int, default=3,
                        help="start a local engine core that died again, up to this many times in 10 minutes, then "
                             "exit with code 1; 0 = never (default: 3)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto": parse tool calls out of the text (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                        help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>, Qwen2.5/Qwen3)")
    parser.add_argument("--headless", action="store_true",
                        help="serve no HTTP: run an engine core that joins the front at --data-parallel-address, "
                             "or, with --nnodes N --node-rank R > 0, this node's tensor-parallel workers")
    parser.add_argument("--cluster-key-file", metavar="PATH",
                        help="a file holding the secret that the server and its engine cores share, at least "
                             f"{MIN_CLUSTER_KEY_BYTES} bytes (default: ${CLUSTER_KEY_VARIABLE}); needed when "
                             "--data-parallel-address is not a loopback address")
    add_option_flags(parser, ENGINE_OPTIONS, given_only=True, shown_defaults=SHOWN_DEFAULTS)
    add_option_flags(parser, SERVER_OPTIONS, "data-parallel option", given_only=True)
    return parser


def engine_options(args: argparse.Namespace) -> dict:
    return {option.name: getattr(args, option.name) for option in ENGINE_OPTIONS if hasattr(args, option.name)}


def server_options(args: argparse.Namespace) -> dict:
    return {option.name: getattr(args, option.name) for option in SERVER_OPTIONS if hasattr(args, option.name)}


def with_server_defaults(options: dict) -> dict:
    """vLLM's defaults for its API server on the CPU, where they differ from an offline LLM's: a step of at most
    2,048 tokens (4,096 offline) and 128 requests, so that a burst's first prompts get their first tokens
    before the last ones are in (a lower mean TTFT under a burst: docs/performance.md)."""
    device = options.get("device", "auto")
    if device != "cpu" and (device != "auto" or torch.cuda.is_available()):
        return options
    budget = options.get("max_num_batched_tokens", SERVER_CPU_DEFAULTS["max_num_batched_tokens"])
    max_num_seqs = min(SERVER_CPU_DEFAULTS["max_num_seqs"], budget)  # a budget below it lowers it, as offline
    return {"max_num_batched_tokens": budget, "max_num_seqs": max_num_seqs} | options


class HTTPServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # run_server handles the signals for the server's whole life, startup included


def admission_limits(args: argparse.Namespace, config: EngineConfig) -> AdmissionLimits:
    requests, tokens = args.max_waiting_requests, args.max_waiting_tokens
    for flag, value in (("--max-waiting-requests", requests), ("--max-waiting-tokens", tokens),
                        ("--max-queue-seconds", args.max_queue_seconds), ("--shutdown-timeout", args.shutdown_timeout),
                        ("--max-core-restarts", args.max_core_restarts)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0 (0 = no limit), got {value}")
    return AdmissionLimits(config.max_num_seqs if requests is None else requests,
                           WAITING_TOKENS_IN_STEPS * config.max_num_batched_tokens if tokens is None else tokens,
                           args.max_queue_seconds)


async def run_server(args: argparse.Namespace, config: EngineConfig, server_config: ServerConfig,
                     cluster_key: bytes) -> int:
    loop = asyncio.get_running_loop()
    on_signal = asyncio.current_task().cancel  # while the model loads (given the signal as its message)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: on_signal(sig))
    open_files = raise_open_file_limit()
    name = Path(config.model).name
    metrics = Metrics(name)
    client = EngineCoreClient(config, server_config, metrics.record_stats, cluster_key, args.max_core_restarts)
    client.doorkeeper.on_dropped_frame = metrics.dropped_frames.labels(name).inc
    client.on_core_up = metrics.record_engine_up
    try:
        validator = Processor(config)
        validator.config.max_model_len = await client.start()
        server = OpenAIServer(client, validator, [name, config.model], metrics,
                              args.tool_call_parser if args.enable_auto_tool_choice else None,
                              AdmissionControl(admission_limits(args, config)))
        app = create_app(server, args.api_key, args.max_request_bytes)
        http = HTTPServer(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=STOP_TIMEOUT_S,
                                         limit_concurrency=connection_limit(open_files)))
        filter_repeats("uvicorn", "uvicorn.access")
        shutdown = Shutdown(server, http, args.shutdown_timeout)
        on_signal = shutdown.on_signal
        client.on_death = shutdown.now
        freeze_startup_heap()
        await http.serve()
    except asyncio.CancelledError:
        logger.info("interrupted while starting")
    finally:
        client.close()
    return 1 if client.unavailable or client.gave_up else 0


def serve(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     nanoengine: %(message)s")
    try:
        options = with_server_defaults(engine_options(args))
        config = EngineConfig.from_options(args.model or default_model_path(), options)
        server_config = ServerConfig(**server_options(args)).check(config)
        admission_limits(args, config)
    except (ValueError, TypeError, OSError) as error:
        parser.error(str(error))
    if config.nnodes > 1:
        warn_unless_private(os.environ.get("MASTER_ADDR", config.master_addr))
    if config.node_ranks()[0] != 0:
        return run_tensor_parallel_node(parser, args.headless, config)
    cluster_key = read_cluster_key(parser, args.cluster_key_file, server_config)
    if args.headless:
        return run_headless_core(parser, config, server_config, cluster_key)
    return asyncio.run(run_server(args, config, server_config, cluster_key))
