"""The front <-> engine-core protocol: its messages, their encoding (msgspec's typed msgpack, one frame
each, never pickle: a peer can only send a frame the other side drops), and the cluster key's proofs.

Before a core is admitted, each side proves it holds the key with an HMAC-SHA256 of both sides' fresh
nonces, labelled with its role so that one side's answer never serves as the other's:

    core  -> front   Hello(rank, fingerprint, nonce)
    front -> core    Challenge(nonce)
    core  -> front   Proof(mac)                  HMAC(key, "core" + the front's nonce + the core's)
    front -> core    JoinReply(refusal, mac)     HMAC(key, "front" + the core's nonce + the front's); refusal
                                                 None: welcome, else why not
    core  -> front   Ready                       once it loaded the model
    front -> core    EngineCoreRequest, Abort    from then on
    core  -> front   EngineCoreOutputs           after each wake-up; EngineCoreFailed before it exits on an error
"""

import hashlib
import hmac
import logging
import secrets
from pathlib import Path
from typing import Annotated, Any

import msgspec
import zmq

from nanoengine.config import EngineConfig
from nanoengine.outputs import EngineStats, RequestOutput
from nanoengine.sampling_params import SamplingParams

NONCE_BYTES = 32
HEARTBEAT_TIMEOUT_S = 5  # a peer silent this long (a stopped or swapping process) loses its connection
ENTRY_BYTES = 256  # the most a token's logprob entry takes in a frame: its id, logprob, rank and text
REQUEST_BYTES = 4 * 2**20  # room for a request's own fields: a structured output's schema, stop strings
FRAME_MARGIN = 4
logger = logging.getLogger("nanoengine.serve")
Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]


class Hello(msgspec.Struct, tag=True):
    rank: int
    fingerprint: dict[str, Any]  # what must equal the front's for the core to join (see fingerprint())
    nonce: Nonce


class Challenge(msgspec.Struct, tag=True):
    nonce: Nonce


class Proof(msgspec.Struct, tag=True):
    mac: bytes


class JoinReply(msgspec.Struct, tag=True):
    refusal: str | None  # None: the core is admitted
    mac: bytes


class Ready(msgspec.Struct, tag=True):
    max_model_len: int  # possibly lowered to fit the KV cache
    num_kvcache_blocks: int


class EngineCoreRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # with output_kind=DELTA
    priority: int
    arrival_time: float  # wall clock (time.time()), stamped in the front
    cache_salt: str | None = None


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class EngineCoreOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]  # without their prompt_token_ids: the front has them
    stats: EngineStats
    refused: dict[str, tuple[str, str | None]] = {}  # request id -> (why, the field at fault)


class EngineCoreFailed(msgspec.Struct, tag=True):
    why: str  # the front fails the core's requests with it: it names a dead tensor-parallel rank


TO_FRONT = Hello | Proof | Ready | EngineCoreOutputs | EngineCoreFailed
TO_CORE = Challenge | JoinReply | EngineCoreRequest | Abort


def max_frame_bytes(config: EngineConfig) -> int:
    """The cluster sockets' cap on one frame: a margin over the largest legal one, a step's outputs where each
    token of the step and of a whole prompt carries max_logprobs + 1 entries. A peer that sends a larger frame
    loses its connection (ZMQ's MAXMSGSIZE) instead of making the other side hold it."""
    tokens = config.max_num_batched_tokens + config.max_model_len
    return FRAME_MARGIN * (tokens * (config.max_logprobs + 2) * ENTRY_BYTES + REQUEST_BYTES)


def cluster_socket(context: zmq.Context, kind: int, config: EngineConfig) -> zmq.Socket:
    """A socket of the front <-> core link: heartbeats (a silent peer is dropped) and the frame cap."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_S * 1000)
    socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes(config))
    return socket


def fingerprint(config: EngineConfig) -> dict:
    """What two cores behind one front must share, as a hello carries it (tuples become lists)."""
    agreed = {"model name": Path(config.model).name, **config.agreed_options("data parallel")}
    return msgspec.msgpack.decode(msgspec.msgpack.encode(agreed))


class Codec:
    """One side's encoder, and its decoder of what the other side sends (``TO_FRONT`` or ``TO_CORE``)."""

    def __init__(self, incoming):
        self.encode = msgspec.msgpack.Encoder().encode
        self.decoder = msgspec.msgpack.Decoder(incoming)

    def decode(self, frames: list) -> Any:
        """The message in a one-frame multipart message (bytes or zmq Frames); raises ValueError for anything
        else."""
        if len(frames) != 1:
            raise ValueError(f"{len(frames)} frames where one was expected")
        try:
            return self.decoder.decode(memoryview(frames[0]))
        except Exception as error:  # whatever a hostile frame makes the decoder raise (depth, size, bad values)
            raise ValueError(f"{type(error).__name__}: {error}") from None

    def receive(self, socket: zmq.Socket):
        """The core's side: the next message from the front, or None (logged) when its frame does not decode."""
        try:
            return self.decode(socket.recv_multipart(copy=False))
        except ValueError as error:
            logger.warning("engine core: dropped a frame from the front: %s", error)
            return None


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(key: bytes, role: str, *nonces: bytes) -> bytes:
    return hmac.new(key, role.encode() + b"".join(nonces), hashlib.sha256).digest()


def proves(key: bytes, claimed: bytes, role: str, *nonces: bytes) -> bool:
    return hmac.compare_digest(claimed, mac(key, role, *nonces))
