"""The engine-core socket trusts no frame: a running server's cluster port (TCP, 127.0.0.1) is sent pickles,
fuzzed msgpack and messages out of turn by a rogue peer that never proved the cluster key; each is dropped and
counted, and the server serves on. Plus the codec on its own, the key's rules, and a scan of the package."""

import asyncio
import os
import pickle
import re
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_data_parallel import free_port
from test_server import metric, wait_for

from benchmarks.serve import running_server
from nanoengine.config import EngineConfig
from nanoengine.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput
from nanoengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from nanoengine.serve.cli import serve
from nanoengine.serve.client import EngineCoreClient
from nanoengine.serve.cluster.handshake import MAX_HANDSHAKES
from nanoengine.serve.codec import (
    NONCE_BYTES,
    TO_CORE,
    TO_FRONT,
    Abort,
    Challenge,
    Codec,
    EngineCoreFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    Hello,
    Proof,
    Ready,
    fingerprint,
    mac,
    max_frame_bytes,
    new_nonce,
    proves,
)
from nanoengine.serve.config import ServerConfig

DROPPED = "nanoengine:engine_core_frames_dropped_total"
KEY = "a-test-cluster-key-of-32-bytes.."
PACKAGE = Path(__file__).parent.parent / "nanoengine"


class CreatesAFile:
    """A pickle that, once loaded, opens (so creates) ``path`` for writing."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.fixture(scope="module")
def cluster_server(sharp_tiny_model, tmp_path_factory):
    """A server with its engine core, and its cluster port open at 127.0.0.1 behind a key; yields (url,
    cluster address, log path)."""
    folder = tmp_path_factory.mktemp("cluster")
    (folder / "key").write_text(KEY + "\n")
    address, log_path = f"127.0.0.1:{free_port()}", folder / "server.log"
    with open(log_path, "w") as log, running_server(
            sharp_tiny_model[0], "--max-model-len", "256", "--data-parallel-address", address,
            "--cluster-key-file", str(folder / "key"), log=log) as (_, url):
        yield url, address, log_path


@pytest.fixture(scope="module")
def rogue(cluster_server):
    """A peer connected to the cluster port, as an engine core would be."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(f"tcp://{cluster_server[1]}")
    yield socket
    context.destroy(linger=0)


def completion_text(url: str) -> str:
    reply = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def assert_serving(url: str) -> None:
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and [e["state"] for e in health["engines"]] == ["ready"]


def test_a_pickle_at_the_cluster_port_runs_nothing_and_is_dropped_and_counted(cluster_server, rogue, tmp_path):
    url, _, log_path = cluster_server
    before, target = metric(url, DROPPED), tmp_path / "created-by-a-pickle"
    rogue.send(pickle.dumps(CreatesAFile(target)))
    rogue.send(b"\x80\x04garbage that no unpickler takes")  # what once killed the front's reader
    wait_for(lambda: metric(url, DROPPED) == before + 2, "both frames to be counted", timeout_s=60)
    assert len(completion_text(url)) > 0
    assert not target.exists()
    assert_serving(url)
    assert "dropped a frame from peer" in log_path.read_text()


def valid_front_messages() -> list:
    """Well-formed messages for the front that a peer that has not been admitted may not send."""
    stats = EngineStats(10, 10, 0, 0, 0, 0, 0, 0)
    output = RequestOutput("cmpl-1", None, [], [CompletionOutput(0, "x", [1], None, None)], True, RequestMetrics(0.0))
    return [Proof(b"\x00" * 32), Ready(256, 10), EngineCoreOutputs([output], stats), EngineCoreFailed("a lie")]


def truncated(message) -> st.SearchStrategy[bytes]:
    encoded = msgspec.msgpack.encode(message)
    return st.integers(0, len(encoded) - 1).map(lambda n: encoded[:n])


# msgpack headers that claim far more than follows: a 4-billion-element array, map, str and bin.
OVERSIZED_HEADERS = [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"]
DEEP_HELLO = msgspec.msgpack.encode({"type": "Hello", "rank": 0, "nonce": b"n" * NONCE_BYTES,
                                     "fingerprint": {"a": None}})[:-1] + b"\x91" * 100_000 + b"\xc0"  # nested 100k deep
TO_CORE_MESSAGES = [Abort(["cmpl-1"]), EngineCoreRequest("cmpl-1", [1, 2], SamplingParams(), 0, 0.0)]
FRAMES = st.one_of(
    st.binary(min_size=0, max_size=256).map(lambda b: [b]),
    st.sampled_from(valid_front_messages() + TO_CORE_MESSAGES).map(lambda m: [msgspec.msgpack.encode(m)]),
    st.sampled_from(valid_front_messages()).flatmap(truncated).map(lambda b: [b]),
    st.tuples(st.sampled_from(OVERSIZED_HEADERS), st.binary(max_size=64)).map(lambda t: [t[0] + t[1]]),
    st.binary(min_size=1, max_size=8).map(lambda salt: [salt * (2**20 // len(salt))]),  # a megabyte of junk
    st.integers(0, 2 * NONCE_BYTES).filter(lambda n: n != NONCE_BYTES).map(  # a hello with a bad nonce
        lambda n: [msgspec.msgpack.encode({"type": "Hello", "rank": 0, "fingerprint": {}, "nonce": b"n" * n})]),
    st.lists(st.binary(max_size=16), min_size=2, max_size=4),  # several frames where one belongs
    st.just([DEEP_HELLO]),
)


def test_fuzzed_frames_at_the_cluster_port_are_all_dropped_and_the_server_serves_on(cluster_server, rogue):
    url = cluster_server[0]
    before, sent = metric(url, DROPPED), []

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(FRAMES)
    def send(frames):
        rogue.send_multipart(frames)
        sent.append(frames)

    send()
    wait_for(lambda: metric(url, DROPPED) == before + len(sent), f"all {len(sent)} frames to be counted",
             timeout_s=120)
    assert_serving(url)
    assert len(completion_text(url)) > 0
    time.sleep(0.5)
    assert metric(url, DROPPED) == before + len(sent)  # each counted once, and the core's frames never


def test_a_peer_with_a_wrong_key_is_refused_and_the_server_serves_on(cluster_server, rogue):
    url, _, log_path = cluster_server
    front, core = Codec(TO_FRONT), Codec(TO_CORE)
    rogue.send(front.encode(Hello(0, {}, new_nonce())))
    assert rogue.poll(30_000), "the front answers a hello with a challenge"
    challenge = core.decode(rogue.recv_multipart())
    rogue.send(front.encode(Proof(b"\x00" * 32)))
    assert rogue.poll(30_000)
    admission = core.decode(rogue.recv_multipart())
    assert "did not prove the cluster key" in admission.refusal and admission.mac == b""
    assert len(challenge.nonce) == NONCE_BYTES
    assert "refused an engine core claiming rank 0: it did not prove the cluster key" in log_path.read_text()
    assert_serving(url)


def test_an_admitted_core_may_send_only_what_its_state_expects(sharp_tiny_model):
    """The front in this process, with no local core; the test plays a remote core that holds the key."""
    config = EngineConfig(sharp_tiny_model[0], max_model_len=256)
    server = ServerConfig(data_parallel_address=f"127.0.0.1:{free_port()}", data_parallel_size_local=0).check(config)
    key, front, codec = KEY.encode(), Codec(TO_FRONT), Codec(TO_CORE)
    stats = EngineStats(10, 10, 0, 0, 0, 0, 0, 0)

    async def scenario():
        client = EngineCoreClient(config, server, lambda rank, stats: None, key)
        started = asyncio.ensure_future(client.start())
        core = client.context.socket(zmq.DEALER)
        core.connect(f"tcp://{server.data_parallel_address}")
        hello = Hello(0, fingerprint(config), new_nonce())
        await core.send(front.encode(hello))
        challenge = codec.decode(await core.recv_multipart())
        await core.send(front.encode(Proof(mac(key, "core", challenge.nonce, hello.nonce))))
        admission = codec.decode(await core.recv_multipart())
        assert admission.refusal is None and proves(key, admission.mac, "front", hello.nonce, challenge.nonce)
        await core.send(front.encode(EngineCoreOutputs([], stats)))  # outputs before it is ready
        await core.send(front.encode(Ready(256, 10)))
        max_model_len = await asyncio.wait_for(started, 60)
        for out_of_turn in (Ready(256, 10), hello, Proof(b"")):  # ready twice, a second handshake
            await core.send(front.encode(out_of_turn))
        await core.send(front.encode(EngineCoreOutputs([], stats)))
        for _ in range(3 * MAX_HANDSHAKES):  # a flood of hellos from peers that never prove the key
            flooder = client.context.socket(zmq.DEALER)
            flooder.connect(f"tcp://{server.data_parallel_address}")
            await flooder.send(front.encode(Hello(0, {}, new_nonce())))
            assert isinstance(codec.decode([await asyncio.wait_for(flooder.recv(), 30)]), Challenge)
        await asyncio.sleep(0.5)
        try:
            return max_model_len, client.doorkeeper.dropped_frames, client.health(), len(client.doorkeeper.handshakes)
        finally:
            client.close()
            await asyncio.gather(client.reader, return_exceptions=True)  # its cancellation, awaited

    max_model_len, dropped, health, handshakes = asyncio.run(scenario())
    assert max_model_len == 256 and dropped == 4 and handshakes == MAX_HANDSHAKES
    assert [(engine["state"], engine["num_requests"]) for engine in health] == [("ready", 0)]


def test_a_frame_over_the_cap_costs_its_peer_the_connection_and_is_counted_as_dropped(sharp_tiny_model, caplog):
    """ZMQ's MAXMSGSIZE: the front never holds a frame larger than a margin over the largest legal one."""
    config = EngineConfig(sharp_tiny_model[0], max_model_len=256, max_num_batched_tokens=256, max_logprobs=0)
    server = ServerConfig(data_parallel_address=f"127.0.0.1:{free_port()}", data_parallel_size_local=0).check(config)
    cap = max_frame_bytes(config)

    async def scenario():
        client = EngineCoreClient(config, server, lambda rank, stats: None, KEY.encode())
        started = asyncio.ensure_future(client.start())
        rogue = client.context.socket(zmq.DEALER)
        cut = rogue.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        rogue.connect(f"tcp://{server.data_parallel_address}")
        await rogue.send(b"\x00" * (cap + 1))
        await asyncio.wait_for(cut.recv_multipart(), 30)  # the front cut the connection
        dropped_for_size = await wait_until(lambda: client.doorkeeper.dropped_frames == 1)
        await rogue.send(b"\x00" * 16)  # reconnected, under the cap: read, and dropped as undecodable
        dropped_after = await wait_until(lambda: client.doorkeeper.dropped_frames == 2)
        try:
            return dropped_for_size, dropped_after, started.done(), client.health()
        finally:
            client.close()
            started.cancel()
            await asyncio.gather(client.reader, started, return_exceptions=True)

    async def wait_until(condition, timeout_s: float = 30) -> bool:
        for _ in range(int(timeout_s / 0.05)):
            if condition():
                return True
            await asyncio.sleep(0.05)
        return False

    dropped_for_size, dropped_after, started, health = asyncio.run(scenario())
    assert dropped_for_size and dropped_after and not started
    assert [engine["state"] for engine in health] == ["starting"]  # rank 0 is still free for a real core
    assert f"over the {cap}-byte cap" in caplog.text
    assert 1 << 20 < cap < 1 << 30


def test_the_codec_carries_requests_and_outputs_exactly_and_builds_nothing_else():
    params = SamplingParams(temperature=0.5, stop=["."], logprobs=2, output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    request = EngineCoreRequest("cmpl-1", [1, 2, 3], params, 2, 123.5, "tenant")
    output = RequestOutput("cmpl-1", None, [], [CompletionOutput(0, "hi", [7], -0.5, [{7: Logprob(-0.5, 1, "hi")}],
                                                                 "stop", ".")], True, RequestMetrics(1.0, 2.0))
    outputs = EngineCoreOutputs([output], EngineStats(10, 9, 1, 16, 0, 0, 1, 0, step_history=[(1, 0, 0.1)]),
                                {"cmpl-2": ("max_tokens: too many", "max_tokens")})
    front, core = Codec(TO_FRONT), Codec(TO_CORE)
    assert core.decode([front.encode(request)]) == request
    assert front.decode([core.encode(outputs)]) == outputs
    with pytest.raises(ValueError, match="Invalid value .EngineCoreRequest."):
        front.decode([front.encode(request)])  # a request is not a message to the front
    with pytest.raises(ValueError, match="temperature"):  # each dataclass is checked as it is built
        bad_params = {"temperature": -1, "stop_strings": []}
        core.decode([msgspec.msgpack.encode(msgspec.structs.asdict(request) | {"type": "EngineCoreRequest",
                                                                              "params": bad_params})])
    with pytest.raises(ValueError):
        core.decode([pickle.dumps(request)])


@pytest.mark.parametrize("address", ["0.0.0.0:5570", "10.1.2.3:5570", "*:5570"])
def test_a_cluster_address_beyond_loopback_needs_a_key(sharp_tiny_model, monkeypatch, capsys, address):
    monkeypatch.delenv("NANOENGINE_CLUSTER_KEY", raising=False)
    with pytest.raises(SystemExit):
        serve([sharp_tiny_model[0], "--data-parallel-address", address])
    assert "reachable from other hosts, and no cluster key is set" in capsys.readouterr().err


def test_a_short_or_unreadable_key_is_refused(sharp_tiny_model, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("NANOENGINE_CLUSTER_KEY", "short")
    with pytest.raises(SystemExit):
        serve([sharp_tiny_model[0], "--data-parallel-address", "127.0.0.1:5570"])
    assert "$NANOENGINE_CLUSTER_KEY: the key is 5 bytes, fewer than 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve([sharp_tiny_model[0], "--cluster-key-file", str(tmp_path / "absent")])
    assert "--cluster-key-file: [Errno 2]" in capsys.readouterr().err


# What may load code from bytes; the one exception is tensor parallelism's step messages, which
# torch.distributed pickles (broadcast_object_list) between the ranks of a group trusted by its network.
FORBIDDEN = re.compile(r"pickle\.loads?\(|import pickle|recv_pyobj|send_pyobj|torch\.load\((?![^)]*weights_only=True)"
                       r"|broadcast_object_list")
TENSOR_PARALLEL_STEPS = {("engine/tp_group.py", 2), ("engine/worker.py", 1)}  # (file, uses of broadcast_object_list)


def test_nothing_in_the_package_unpickles_what_a_peer_sends_but_tensor_parallel_steps():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for hit in FORBIDDEN.findall(path.read_text()):
            found.setdefault((os.path.relpath(path, PACKAGE), hit), 0)
            found[os.path.relpath(path, PACKAGE), hit] += 1
    assert {(path, count) for (path, hit), count in found.items()} == TENSOR_PARALLEL_STEPS, found
    assert {hit for _, hit in found} == {"broadcast_object_list"}
