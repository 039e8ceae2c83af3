"""``nanoengine serve [MODEL] [--port N] [every LLM option as a --flag]``: the OpenAI-compatible server.

The front process (this one) validates the options, starts the engine-core processes
(``--data-parallel-size``, each with its own KV cache), and serves HTTP once every core has loaded
the model. SIGINT or SIGTERM ends in-flight requests and stops the engine cores; if every engine core
dies, the server exits with code 1. ``--headless`` runs one engine core that joins a front on another
node (``--data-parallel-rank R --data-parallel-address HOST:PORT``) instead of serving HTTP. The front and
its cores prove to each other that they hold the cluster key (``--cluster-key-file`` or
``$NANOENGINE_CLUSTER_KEY``), which a data-parallel address other than loopback requires.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import torch
import uvicorn

from nanoengine import prefix_report
from nanoengine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, EngineConfig
from nanoengine.distributed import env_rank, ip_addresses
from nanoengine.engine.worker import run_node
from nanoengine.serve.api_server import OpenAIServer, RequestValidator, create_app
from nanoengine.serve.client import STOP_TIMEOUT_S, EngineCoreClient, logger
from nanoengine.serve.engine_core import run_headless_core
from nanoengine.serve.metrics import Metrics
from nanoengine.serve.tools import TOOL_CALL_PARSERS
from nanoengine.utils.default_model import default_model_path
from nanoengine.utils.gc_heap import freeze_startup_heap

ENGINE_OPTIONS = [f for f in fields(EngineConfig) if f.init and f.name != "model"]
SERVER_CPU_DEFAULTS = {"max_num_batched_tokens": 2048, "max_num_seqs": 128}  # vLLM's API server's, on the CPU
CLUSTER_KEY_VARIABLE = "NANOENGINE_CLUSTER_KEY"
MIN_CLUSTER_KEY_BYTES = 16


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
    2,048 tokens (8,192 offline) and 128 requests, so that a burst's first prompts get their first tokens
    before the last ones are in (at 16 requests a second, float32: mean TTFT 7.3 -> 4.7 s on a 2-core EPYC)."""
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


async def run_server(args: argparse.Namespace, config: EngineConfig, cluster_key: bytes) -> int:
    loop = asyncio.get_running_loop()
    on_signal = asyncio.current_task().cancel  # while the model loads; then a graceful stop
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: on_signal())
    name = Path(config.model).name
    metrics = Metrics(name)
    client = EngineCoreClient(config, metrics.record_stats, cluster_key)
    client.on_dropped_frame = metrics.dropped_frames.labels(name).inc
    try:
        validator = RequestValidator(config)
        validator.config.max_model_len = await client.start()
        server = OpenAIServer(client, validator, [name, config.model], metrics,
                              args.tool_call_parser if args.enable_auto_tool_choice else None)
        app = create_app(server, args.api_key, args.max_request_bytes)
        http = HTTPServer(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=STOP_TIMEOUT_S))

        def on_signal():
            server.stop()
            http.should_exit = True

        client.on_death = on_signal
        freeze_startup_heap()
        await http.serve()
    except asyncio.CancelledError:
        logger.info("interrupted while starting")
    finally:
        client.close()
    return 1 if client.dead else 0


def serve(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     nanoengine: %(message)s")
    try:
        options = with_server_defaults(engine_options(args))
        config = EngineConfig.from_options(args.model or default_model_path(), options)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": serve, "prefix-report": prefix_report.main}
    if not argv or argv[0] not in commands:
        print("usage: nanoengine serve [MODEL] [--port N] [options]  (see nanoengine serve --help)\n"
              "       nanoengine prefix-report REQUESTS.jsonl [--model DIR] [options]", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
