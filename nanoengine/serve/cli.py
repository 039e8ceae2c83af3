"""``nanoengine serve [MODEL] [--port N] [every LLM option as a --flag]``: the OpenAI-compatible server.

The front process (this one) validates the options, starts the engine-core processes
(``--data-parallel-size``, each with its own KV cache), and serves HTTP once every core has loaded
the model. SIGTERM drains (``--shutdown-timeout``: no new requests, in-flight ones may finish), then ends
what is left and stops the engine cores; SIGINT, a second signal, or ``--shutdown-timeout 0`` does so at
once. A local engine core that dies is started again (``--max-core-restarts``); if the front gives up on
them, or every engine core is gone, the server exits with code 1. ``--headless`` runs one engine core that
joins a front on another node (``--data-parallel-rank R --data-parallel-address HOST:PORT``) instead of
serving HTTP. The front and its cores prove to each other that they hold the cluster key
(``--cluster-key-file`` or ``$NANOENGINE_CLUSTER_KEY``), which a data-parallel address other than loopback
requires. docs/operations.md explains the caps, probes, drain and supervision; docs/security.md the key.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import torch
import uvicorn

from nanoengine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, EngineConfig
from nanoengine.distributed import env_rank, ip_addresses
from nanoengine.engine.processor import Processor
from nanoengine.engine.worker import run_node
from nanoengine.serve.api_server import create_app
from nanoengine.serve.client import STOP_TIMEOUT_S, EngineCoreClient, logger
from nanoengine.serve.cluster.admission import AdmissionControl, AdmissionLimits
from nanoengine.serve.cluster.limits import connection_limit, filter_repeats, raise_open_file_limit
from nanoengine.serve.engine_core import run_headless_core
from nanoengine.serve.metrics import Metrics
from nanoengine.serve.pipeline import OpenAIServer
from nanoengine.serve.tools import TOOL_CALL_PARSERS
from nanoengine.utils.default_model import default_model_path
from nanoengine.utils.gc_heap import freeze_startup_heap

ENGINE_OPTIONS = [f for f in fields(EngineConfig) if f.init and f.name != "model"]
SERVER_CPU_DEFAULTS = {"max_num_batched_tokens": 2048, "max_num_seqs": 128}  # vLLM's API server's, on the CPU
CLUSTER_KEY_VARIABLE = "NANOENGINE_CLUSTER_KEY"
MIN_CLUSTER_KEY_BYTES = 16
WAITING_TOKENS_IN_STEPS = 8  # the default token cap: this many full steps (max_num_batched_tokens) of prompts


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One --flag per EngineConfig field; an omitted flag keeps the field's default."""
    for option in ENGINE_OPTIONS:
        kind = option.type
        if isinstance(kind, types.UnionType):
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        flag = "--" + option.name.replace("_", "-")
        default = None if option.default is MISSING else option.default
        if option.name in SERVER_CPU_DEFAULTS:
            elsewhere = (DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"] if option.name == "max_num_batched_tokens"
                         else DEFAULT_MAX_NUM_SEQS)
            default = f"{SERVER_CPU_DEFAULTS[option.name]} on the CPU, as vLLM's server; else {elsewhere}"
        extra = ({"action": argparse.BooleanOptionalAction} if kind is bool
                 else {"type": json.loads, "metavar": "JSON"} if kind is dict else {"type": kind})
        parser.add_argument(flag, default=argparse.SUPPRESS, help=f"LLM option (default: {default})", **extra)


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
    add_engine_flags(parser)
    return parser


def engine_options(args: argparse.Namespace) -> dict:
    return {option.name: getattr(args, option.name) for option in ENGINE_OPTIONS if hasattr(args, option.name)}


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


class Shutdown:
    """SIGTERM drains: new requests get 503 and /ready says so, in-flight ones may finish within
    ``timeout_s``; then (or on SIGINT, a second signal, or the engine cores' end) what is left ends at once."""

    def __init__(self, server: OpenAIServer, http: uvicorn.Server, timeout_s: float):
        self.server, self.http, self.timeout_s = server, http, timeout_s
        self.drain: asyncio.Task | None = None

    def on_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM and self.timeout_s > 0 and self.drain is None:
            self.drain = asyncio.ensure_future(self.drain_then_stop())
        else:
            self.now()

    async def drain_then_stop(self) -> None:
        admission = self.server.admission
        admission.draining = True
        logger.info("draining: %d requests in flight, given up to %g s (--shutdown-timeout)", len(admission.tickets),
                    self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while admission.tickets and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if admission.tickets:
            logger.warning("drained for %g s; ending the %d requests left", self.timeout_s, len(admission.tickets))
        self.now()

    def now(self) -> None:
        self.server.admission.draining = True
        self.server.stop()
        self.http.should_exit = True


async def run_server(args: argparse.Namespace, config: EngineConfig, cluster_key: bytes) -> int:
    loop = asyncio.get_running_loop()
    on_signal = asyncio.current_task().cancel  # while the model loads (given the signal as its message)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: on_signal(sig))
    open_files = raise_open_file_limit()
    name = Path(config.model).name
    metrics = Metrics(name)
    client = EngineCoreClient(config, metrics.record_stats, cluster_key, args.max_core_restarts)
    client.on_dropped_frame = metrics.dropped_frames.labels(name).inc
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
    return 1 if client.dead or client.gave_up else 0


def serve(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     nanoengine: %(message)s")
    try:
        options = with_server_defaults(engine_options(args))
        config = EngineConfig.from_options(args.model or default_model_path(), options)
        admission_limits(args, config)
    except (ValueError, TypeError, OSError) as error:
        parser.error(str(error))
    if config.nnodes > 1:
        warn_unless_private(os.environ.get("MASTER_ADDR", config.master_addr))
    if config.node_ranks()[0] != 0:
        return run_tensor_parallel_node(parser, args, config)
    cluster_key = read_cluster_key(parser, args, config)
    if args.headless:
        return run_headless(parser, config, cluster_key)
    return asyncio.run(run_server(args, config, cluster_key))


def read_cluster_key(parser: argparse.ArgumentParser, args: argparse.Namespace, config: EngineConfig) -> bytes:
    """The key from --cluster-key-file, else from the environment (never from a flag's value, which ``ps``
    shows); b"" when there is none, which only a loopback data-parallel address may go without."""
    try:
        key = (Path(args.cluster_key_file).read_bytes() if args.cluster_key_file
               else os.environ.get(CLUSTER_KEY_VARIABLE, "").encode()).strip()
    except OSError as error:
        parser.error(f"--cluster-key-file: {error}")
    if key and len(key) < MIN_CLUSTER_KEY_BYTES:
        source = "--cluster-key-file" if args.cluster_key_file else f"${CLUSTER_KEY_VARIABLE}"
        parser.error(f"{source}: the key is {len(key)} bytes, fewer than {MIN_CLUSTER_KEY_BYTES} (make one with: "
                     "openssl rand -hex 32 > PATH)")
    if config.data_parallel_address is not None and not key:
        host = config.data_parallel_address.rpartition(":")[0]
        addresses = ip_addresses(host)
        if not addresses or not all(address.is_loopback for address in addresses):
            parser.error(f"--data-parallel-address {config.data_parallel_address} is reachable from other hosts, "
                         "and no cluster key is set: anyone who reaches the port could join as an engine core and "
                         "read the prompts. Give the server and every headless core the same secret with "
                         f"--cluster-key-file PATH (e.g. openssl rand -hex 32 > PATH) or ${CLUSTER_KEY_VARIABLE}, "
                         "or use a loopback address")
    return key


def warn_unless_private(master_addr: str) -> None:
    """The tensor-parallel ranks trust whatever reaches their rendezvous (torch.distributed's store and
    collectives have no authentication): say so when the head's address is not a private one."""
    addresses = ip_addresses(master_addr)
    if not addresses or not all(address.is_private for address in addresses):
        logger.warning("--master-addr %s is not a private or loopback address: the tensor-parallel rendezvous and "
                       "its collectives are unauthenticated (anyone who reaches their ports can join or disrupt the "
                       "group); keep every node's ports on a private network (see docs/security.md)", master_addr)


def run_headless(parser: argparse.ArgumentParser, config: EngineConfig, cluster_key: bytes) -> int:
    if config.data_parallel_address is None:
        parser.error("--headless needs --data-parallel-address HOST:PORT (the front's) and --data-parallel-rank, "
                     "or --nnodes N --node-rank R > 0 for a node of a tensor-parallel group")
    return run_headless_core(config, cluster_key)


def run_tensor_parallel_node(parser: argparse.ArgumentParser, args: argparse.Namespace, config: EngineConfig) -> int:
    """A node other than the head: its tensor-parallel workers run until the head closes them (or dies)."""
    if not args.headless and env_rank() is None:
        parser.error(f"--node-rank {config.node_rank} runs only this node's workers: add --headless")
    logger.info("running tensor-parallel rank(s) %s; node 0 runs the engine", config.node_ranks())
    run_node(config)
    return 0
