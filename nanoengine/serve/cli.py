"""``nanoengine serve [MODEL] [--port N] [every LLM option as a --flag]``: the OpenAI-compatible server.

The front process (this one) validates the options, starts the engine-core processes
(``--data-parallel-size``, each with its own KV cache), and serves HTTP once every core has loaded
the model. SIGINT or SIGTERM ends in-flight requests and stops the engine cores; if every engine core
dies, the server exits with code 1. ``--headless`` runs one engine core that joins a front on another
node (``--data-parallel-rank R --data-parallel-address HOST:PORT``) instead of serving HTTP.
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

from nanoengine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, EngineConfig
from nanoengine.distributed import env_rank
from nanoengine.engine.processor import Processor
from nanoengine.engine.worker import run_node
from nanoengine.serve import prefix_report
from nanoengine.serve.api_server import OpenAIServer, create_app
from nanoengine.serve.client import STOP_TIMEOUT_S, EngineCoreClient, logger
from nanoengine.serve.engine_core import run_headless_core
from nanoengine.serve.metrics import Metrics
from nanoengine.utils.default_model import default_model_path
from nanoengine.utils.gc_heap import freeze_startup_heap

ENGINE_OPTIONS = [f for f in fields(EngineConfig) if f.init and f.name != "model"]
SERVER_CPU_DEFAULTS = {"max_num_batched_tokens": 2048, "max_num_seqs": 128}  # vLLM's API server's, on the CPU


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
    parser.add_argument("--headless", action="store_true",
                        help="serve no HTTP: run an engine core that joins the front at --data-parallel-address, "
                             "or, with --nnodes N --node-rank R > 0, this node's tensor-parallel workers")
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


async def run_server(args: argparse.Namespace, config: EngineConfig) -> int:
    loop = asyncio.get_running_loop()
    on_signal = asyncio.current_task().cancel  # while the model loads; then a graceful stop
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: on_signal())
    name = Path(config.model).name
    metrics = Metrics(name)
    client = EngineCoreClient(config, metrics.record_stats)
    try:
        validator = Processor(config)
        validator.config.max_model_len = await client.start()
        server = OpenAIServer(client, validator, [name, config.model], metrics)
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
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     nanoengine: %(message)s")
    try:
        options = with_server_defaults(engine_options(args))
        config = EngineConfig.from_options(args.model or default_model_path(), options)
    except (ValueError, TypeError, OSError) as error:
        parser.error(str(error))
    if config.node_ranks()[0] != 0:
        return run_tensor_parallel_node(parser, args, config)
    if args.headless:
        return run_headless(parser, config)
    return asyncio.run(run_server(args, config))


def run_headless(parser: argparse.ArgumentParser, config: EngineConfig) -> int:
    if config.data_parallel_address is None:
        parser.error("--headless needs --data-parallel-address HOST:PORT (the front's) and --data-parallel-rank, "
                     "or --nnodes N --node-rank R > 0 for a node of a tensor-parallel group")
    return run_headless_core(config)


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
