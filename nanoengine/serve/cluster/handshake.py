"""The front's side of the cluster key's handshake (codec.py draws it; engine_core.join is the core's).

A peer proves the key before it may do anything else; a core that proved it is admitted under the rank it
claims only if that rank is free and its model and options are the front's (``fingerprint``). The doorkeeper
also counts and logs the frames the front drops: undecodable, out of turn, or from a peer not admitted.
"""

import logging
import time

from nanoengine.config import EngineConfig
from nanoengine.serve.codec import Challenge, Codec, Hello, JoinReply, Proof, fingerprint, mac, new_nonce, proves

MAX_HANDSHAKES = 16  # peers between their hello and their proof; a newer one pushes out the oldest
DROP_LOG_INTERVAL_S = 10.0
logger = logging.getLogger("nanoengine.serve")


class Doorkeeper:
    def __init__(self, config: EngineConfig, cluster_key: bytes, codec: Codec):
        self.expected, self.cluster_key, self.codec = fingerprint(config), cluster_key, codec
        self.handshakes: dict[bytes, tuple[Hello, bytes]] = {}  # peer -> its hello and the nonce it must sign
        self.dropped_frames, self.next_drop_log = 0, 0.0
        self.on_dropped_frame = lambda: None

    def challenge(self, identity: bytes, hello: Hello) -> bytes:
        """The reply to a hello: a nonce for the peer to sign with the cluster key."""
        if len(self.handshakes) >= MAX_HANDSHAKES:
            del self.handshakes[next(iter(self.handshakes))]
        nonce = new_nonce()
        self.handshakes[identity] = hello, nonce
        return self.codec.encode(Challenge(nonce))

    def admit(self, identity: bytes, proof: Proof, cores: list) -> tuple[int | None, bytes]:
        """The rank of a core that proved the key and may take it (None if not), and the reply to send it."""
        hello, nonce = self.handshakes.pop(identity)
        if proves(self.cluster_key, proof.mac, "core", nonce, hello.nonce):
            why = self.refusal(hello, cores)
        else:
            why = "it did not prove the cluster key (is its key this server's?)"
        if why is not None:
            logger.warning("refused an engine core claiming rank %d: %s", hello.rank, why)
            return None, self.codec.encode(JoinReply(why, b""))
        return hello.rank, self.codec.encode(JoinReply(None, mac(self.cluster_key, "front", hello.nonce, nonce)))

    def refusal(self, hello: Hello, cores: list) -> str | None:
        """Why a core that proved the key may not serve under the rank it claims, or None."""
        core = cores[hello.rank] if 0 <= hello.rank < len(cores) else None
        differences = [f"{name}={hello.fingerprint.get(name)!r} (this server: {value!r})"
                       for name, value in self.expected.items() if hello.fingerprint.get(name) != value]
        if core is None:
            return f"rank {hello.rank} is outside this server's data_parallel_size={len(cores)}"
        if differences:
            return "it runs another model or config: " + "; ".join(differences)
        if core.process is not None and core.identity is not None:
            return f"rank {hello.rank} is one of this server's own local cores"
        if core.identity is not None and not core.cause_of_death:
            return f"rank {hello.rank} is already served by another engine core"
        return None

    def drop(self, peer: str, why: str) -> None:
        self.dropped_frames += 1
        self.on_dropped_frame()
        now = time.monotonic()
        if now >= self.next_drop_log:
            self.next_drop_log = now + DROP_LOG_INTERVAL_S
            logger.warning("dropped a frame from peer %s on the engine-core socket: %s (%d dropped so far)",
                           peer, why, self.dropped_frames)
