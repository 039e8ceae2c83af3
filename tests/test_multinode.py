"""Multi-node tensor parallelism, two nodes simulated on this machine: the head is this process, node 1 a
`nanoengine serve --headless` process joining it over TCP on 127.0.0.1 (gloo)."""

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import build_tiny_model
from test_tensor_parallel import GREEDY, PROMPTS, SMALL_ENGINE, raised_within

from nanoengine import LLM, distributed
from nanoengine.serve.cli import serve
from nanoengine.serve.cluster.nodes import warn_unless_private

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir) -> str:
    folder = str(tmp_path_factory.mktemp("multinode-llama"))
    build_tiny_model("llama", folder, smollm2_dir)
    return folder


@pytest.fixture(scope="module")
def expected_tokens(tiny_dir) -> list[list[int]]:
    with LLM(tiny_dir, **SMALL_ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_flags() -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in SMALL_ENGINE.items()]


def start_node(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """A real `nanoengine serve` process (one torch thread, as the head's ranks here)."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO} | (env or {})
    return subprocess.Popen([sys.executable, "-m", "nanoengine.serve", *engine_flags(), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def headless_node(model: str, port: int, *more_flags: str) -> subprocess.Popen:
    return start_node([model, "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
                       "--master-addr", "127.0.0.1", "--master-port", str(port), "--headless", *more_flags])


def head(model: str, port: int) -> LLM:
    return LLM(model, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
               **SMALL_ENGINE)


def exit_code_within(process: subprocess.Popen, timeout_s: float) -> int:
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"node still running {timeout_s} s after the head closed: orphaned\n{process.communicate()[0]}")


def test_two_nodes_give_the_same_tokens_as_one(tiny_dir, expected_tokens):
    port = free_port()
    node = headless_node(tiny_dir, port)
    with head(tiny_dir, port) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == expected_tokens
    assert exit_code_within(node, 30) == 0, node.communicate()[0]  # asked to stop, not killed
    assert not dist.is_initialized()


# SIGSTOP: node 1 falls silent with its connections open, as when it loses power. Gloo's collectives wait
# for it until their timeout (aborting the group does not end them), shortened here to keep the test short.
@pytest.mark.parametrize(("end", "within_s"), [(signal.SIGKILL, 15), (signal.SIGSTOP, 5 + 15)])
def test_killed_or_vanished_node_fails_the_head_naming_the_rank(tiny_dir, monkeypatch, end, within_s):
    monkeypatch.setattr(distributed, "STEP_TIMEOUT", timedelta(seconds=5))
    port = free_port()
    node = headless_node(tiny_dir, port)
    with head(tiny_dir, port) as llm:
        engine, steps_run = llm.llm_engine, []
        step = engine.step

        def step_ending_node_1_before_the_third():
            if len(steps_run) == 2:
                node.send_signal(end)
                steps_run.append(time.monotonic())
            steps_run.append(None)
            return step()

        monkeypatch.setattr(engine, "step", step_ending_node_1_before_the_third)
        error = raised_within(lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False), timeout_s=60)
        seconds = time.monotonic() - steps_run[2]
        assert isinstance(error, RuntimeError) and "rank 1" in str(error), error
        assert seconds < within_s, f"the head took {seconds:.1f} s to fail"
        with pytest.raises(RuntimeError, match="broken"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    node.kill()
    assert not dist.is_initialized()


def test_a_node_started_with_other_options_is_refused(tiny_dir):
    port = free_port()
    node = headless_node(tiny_dir, port, "--max-model-len", "64")
    with pytest.raises(ValueError, match=r"rank 1 .* differ from the head's: max_model_len 64 \(the head's: 128\)"):
        head(tiny_dir, port)
    assert exit_code_within(node, 15) != 0
    assert "differ from the head's" in node.communicate()[0]  # the node says why it ends
    assert not dist.is_initialized()


HEAD_THAT_HANGS = """
import sys, time
from nanoengine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=int(sys.argv[2]),
          **SMALL_ENGINE)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
print("generated", flush=True)
time.sleep(600)
""".replace("SMALL_ENGINE", repr(SMALL_ENGINE))


# SIGSTOP: the head falls silent with its connections open, as when its node loses power.
@pytest.mark.parametrize(("end", "says"), [(signal.SIGKILL, "tensor-parallel rank 1 failed"),
                                           (signal.SIGSTOP, "the head's store has not answered for 5 s")])
def test_headless_node_exits_when_the_head_dies_or_vanishes(tiny_dir, end, says):
    port = free_port()
    node = headless_node(tiny_dir, port)
    head_process = subprocess.Popen([sys.executable, "-c", HEAD_THAT_HANGS, tiny_dir, str(port)], cwd=REPO,
                                    stdout=subprocess.PIPE, text=True)
    try:
        assert head_process.stdout.readline() == "generated\n"
        head_process.send_signal(end)
        assert exit_code_within(node, 15) != 0
        assert says in node.communicate()[0]
    finally:
        head_process.kill()
        node.kill()


def test_env_launch_as_torchrun_does_it(tiny_dir, expected_tokens, monkeypatch):
    """Every rank is its own process, placed by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT: rank 1's
    `nanoengine serve` runs only its worker."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    node = start_node([tiny_dir, "--tensor-parallel-size", "2"], env | {"RANK": "1", "LOCAL_RANK": "1"})
    for name, value in (env | {"RANK": "0", "LOCAL_RANK": "0"}).items():
        monkeypatch.setenv(name, value)
    with LLM(tiny_dir, tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        assert llm.llm_engine.model_executor.workers.health.processes == {}  # rank 0 started no process
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert tokens == expected_tokens
    assert exit_code_within(node, 30) == 0, node.communicate()[0]


@pytest.mark.parametrize(("options", "message"), [
    (dict(nnodes=2, node_rank=1, master_port=29400), "runs only the workers of its node: .* --headless"),
    (dict(nnodes=2), "master_port: with nnodes > 1"),
    (dict(nnodes=2, node_rank=2, master_port=29400), r"node_rank must be in \[0, 1\]"),
    (dict(tensor_parallel_size=3, nnodes=2, master_port=29400), r"tensor_parallel_size \(3\) is not divisible by nn"),
])
def test_wrong_node_options_fail_before_any_process_starts(tiny_dir, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_dir, **{"tensor_parallel_size": 2} | options)
    assert not dist.is_initialized()


def test_headless_without_a_node_other_than_the_head_is_refused(tiny_dir, capsys):
    with pytest.raises(SystemExit):
        serve([tiny_dir, "--tensor-parallel-size", "2", "--headless"])
    assert "--headless needs --data-parallel-address HOST:PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve([tiny_dir, "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "29400"])
    assert "add --headless" in capsys.readouterr().err


def test_a_killed_node_takes_the_workers_it_started_with_it(tmp_path, smollm2_dir):
    """Four ranks over two nodes: node 1 runs rank 2 itself and rank 3 as its child, which sees it die."""
    build_tiny_model("llama", tmp_path, smollm2_dir, num_key_value_heads=4)
    port = free_port()
    node = start_node([str(tmp_path), "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
                       "--master-addr", "127.0.0.1", "--master-port", str(port), "--headless"])
    with LLM(str(tmp_path), tensor_parallel_size=4, nnodes=2, master_addr="127.0.0.1", master_port=port,
             **SMALL_ENGINE) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 20
        rank_3 = children_of(node.pid)
        node.kill()
        node.wait()
        deadline = time.monotonic() + 10
        while any(is_running(pid) for pid in rank_3) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(is_running(pid) for pid in rank_3), "node 1's own worker outlived it"
        with pytest.raises(RuntimeError, match="rank 2 .*, rank 3 "):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def children_of(pid: int) -> list[int]:
    done = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(child) for child in done.stdout.split()]


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper that a container may lack)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("master_addr, warned", [("8.8.8.8", True), ("10.0.0.1", False), ("127.0.0.1", False),
                                                 ("localhost", False), ("192.168.1.20", False)])
def test_the_launcher_warns_when_the_rendezvous_is_not_on_a_private_network(master_addr, warned, caplog):
    warn_unless_private(master_addr)
    assert ("is not a private or loopback address" in caplog.text) == warned
