"""The processes of other nodes: a ``--headless`` engine core that joins a front over TCP, a node of a
tensor-parallel group, and the cluster key they share with the front (docs/security.md)."""

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from nanoengine.config import EngineConfig
from nanoengine.distributed import env_rank, ip_addresses
from nanoengine.engine.worker import run_node
from nanoengine.serve.config import ServerConfig
from nanoengine.serve.engine_core import connect, run

CLUSTER_KEY_VARIABLE = "NANOENGINE_CLUSTER_KEY"
MIN_CLUSTER_KEY_BYTES = 16
logger = logging.getLogger("nanoengine.serve")


def read_cluster_key(parser: argparse.ArgumentParser, key_file: str | None, server: ServerConfig) -> bytes:
    """The key from --cluster-key-file, else from the environment (never from a flag's value, which ``ps``
    shows); b"" when there is none, which only a loopback data-parallel address may go without."""
    try:
        key = (Path(key_file).read_bytes() if key_file else os.environ.get(CLUSTER_KEY_VARIABLE, "").encode()).strip()
    except OSError as error:
        parser.error(f"--cluster-key-file: {error}")
    if key and len(key) < MIN_CLUSTER_KEY_BYTES:
        source = "--cluster-key-file" if key_file else f"${CLUSTER_KEY_VARIABLE}"
        parser.error(f"{source}: the key is {len(key)} bytes, fewer than {MIN_CLUSTER_KEY_BYTES} (make one with: "
                     "openssl rand -hex 32 > PATH)")
    address = server.data_parallel_address
    if address is not None and not key:
        addresses = ip_addresses(address.rpartition(":")[0])
        if not addresses or not all(ip.is_loopback for ip in addresses):
            parser.error(f"--data-parallel-address {address} is reachable from other hosts, "
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


def run_headless_core(parser: argparse.ArgumentParser, config: EngineConfig, server: ServerConfig,
                      cluster_key: bytes) -> int:
    """``nanoengine serve --headless --data-parallel-rank R --data-parallel-address HOST:PORT``: one core that
    joins the front over TCP and runs until the front goes away."""
    if server.data_parallel_address is None:
        parser.error("--headless needs --data-parallel-address HOST:PORT (the front's) and --data-parallel-rank, "
                     "or --nnodes N --node-rank R > 0 for a node of a tensor-parallel group")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    context = zmq.Context()
    address = f"tcp://{server.data_parallel_address}"
    socket = connect(context, address, config)
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    logger.info("engine core %d: joining the front at %s", server.data_parallel_rank, address)
    try:
        return run(config, socket, server.data_parallel_rank, cluster_key, monitor,
                   lambda: drained_disconnect(monitor))
    finally:
        context.destroy(linger=0)


def drained_disconnect(monitor: zmq.Socket) -> bool:
    events = []
    while monitor.poll(0):
        events.append(recv_monitor_message(monitor)["event"])
    return zmq.EVENT_DISCONNECTED in events


def run_tensor_parallel_node(parser: argparse.ArgumentParser, headless: bool, config: EngineConfig) -> int:
    """A node other than the head: its tensor-parallel workers run until the head closes them (or dies)."""
    if not headless and env_rank() is None:
        parser.error(f"--node-rank {config.node_rank} runs only this node's workers: add --headless")
    logger.info("running tensor-parallel rank(s) %s; node 0 runs the engine", config.node_ranks())
    run_node(config)
    return 0
