"""Data parallelism: engine cores behind one server, as a user runs them (real processes, the openai client),
and the routing rule on its own."""

import asyncio
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families
from test_server import alive, descendants, wait_for

from benchmarks.serve import running_server
from nanoengine import LLM, SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.serve.cluster.router import CoreLoad, Router, prompt_hashes
from nanoengine.serve.config import ServerConfig
from nanoengine.serve.engine_core import pin_gpus

MAX_MODEL_LEN = 512
FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--data-parallel-size", "2")
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(autouse=True)
def one_thread_per_core(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the servers' engine cores inherit it


def per_engine(url: str, name: str) -> dict[str, float]:
    """A metric's value for each engine core, by its ``engine`` label."""
    text = httpx.get(f"{url}/metrics").text
    return {s.labels["engine"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(8)]


@pytest.fixture(scope="module")
def dp_server(sharp_tiny_model):
    with running_server(sharp_tiny_model[0], *FLAGS) as (_, url):
        yield url


def test_two_cores_give_the_greedy_tokens_of_one_and_both_serve(sharp_tiny_model, dp_server):
    with LLM(sharp_tiny_model[0], max_model_len=MAX_MODEL_LEN) as llm:  # one engine core, in this process
        offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    client = AsyncOpenAI(base_url=f"{dp_server}/v1", api_key="none", max_retries=0)
    before = per_engine(dp_server, "nanoengine:generation_tokens_total")

    async def all_at_once():
        return await asyncio.gather(*(client.completions.create(model=None, prompt=p, max_tokens=24, **GREEDY)
                                      for p in PROMPTS))

    replies = asyncio.run(all_at_once())
    generated = per_engine(dp_server, "nanoengine:generation_tokens_total")
    assert [r.choices[0].text for r in replies] == [o.outputs[0].text for o in offline]
    assert all(generated[e] > before.get(e, 0) for e in ("0", "1"))  # both cores took requests


def test_shared_prefix_requests_land_on_the_same_core_and_other_salts_route_apart(dp_server):
    system = list(range(1000, 1064))  # four full blocks, sent by no other test
    client = AsyncOpenAI(base_url=f"{dp_server}/v1", api_key="none", max_retries=0)
    before = per_engine(dp_server, "nanoengine:prompt_tokens_total")

    async def tenant_requests():
        long_a = asyncio.create_task(client.completions.create(
            model=None, prompt=system + [1], max_tokens=440, extra_body={"cache_salt": "a", "ignore_eos": True}))
        await asyncio.to_thread(wait_for, lambda: running_core(dp_server),
                                "tenant a's long request to run")  # the other core is now the least loaded
        a_core = running_core(dp_server)
        second_a = await client.completions.create(model=None, prompt=system + [2], max_tokens=2,
                                                   extra_body={"cache_salt": "a"})
        other_tenant = await client.completions.create(model=None, prompt=system + [2], max_tokens=2,
                                                       extra_body={"cache_salt": "b"})
        return await long_a, second_a, other_tenant, a_core

    _, second_a, other_tenant, a_core = asyncio.run(tenant_requests())
    prompt_tokens = per_engine(dp_server, "nanoengine:prompt_tokens_total")
    assert second_a.usage.prompt_tokens_details.cached_tokens == 64  # it went where tenant a's prefix is
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0
    # a's two prompts on a's core, b's on the other
    assert {e: n - before.get(e, 0) for e, n in prompt_tokens.items()} == {a_core: 130, str(1 - int(a_core)): 65}


def running_core(url: str) -> str | None:
    """The engine core that runs a request now (the first, if several do)."""
    return next((e for e, n in sorted(per_engine(url, "nanoengine:num_requests_running").items()) if n), None)


def stream_events(client: OpenAI, prompt: str, max_tokens: int) -> list:
    """The chunks of a streamed completion, or the error that ended it."""
    chunks = []
    try:
        for chunk in client.completions.create(model=None, prompt=prompt, max_tokens=max_tokens, stream=True,
                                               **GREEDY):
            chunks.append(chunk)
    except Exception as error:  # the openai client raises the error event it reads
        chunks.append(error)
    return chunks


def test_a_killed_core_fails_its_requests_is_down_in_metrics_comes_back_and_serves_and_a_crash_loop_exits_1(
        sharp_tiny_model):
    with running_server(sharp_tiny_model[0], *FLAGS, "--max-core-restarts", "1") as (server, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        async def two_streams():
            doomed = asyncio.create_task(asyncio.to_thread(stream_events, client, "Go on and on", 480))
            await asyncio.to_thread(wait_for, lambda: per_engine(url, "nanoengine:num_requests_running").get("0"),
                                    "the first stream to run on core 0")
            # Core 0 is frozen until it is killed, so that its stream cannot finish first (the tiny model writes
            # 480 tokens in about a second, as long as a loaded machine may take to start the second stream).
            [core_0, _] = httpx.get(f"{url}/health").json()["engines"]
            os.kill(core_0["pid"], signal.SIGSTOP)
            survivor = asyncio.create_task(asyncio.to_thread(stream_events, client, "And on", 480))
            await asyncio.to_thread(wait_for, lambda: per_engine(url, "nanoengine:num_requests_running").get("1"),
                                    "the second stream to run on core 1")
            family = {core_0["pid"]} | descendants(core_0["pid"])
            os.kill(core_0["pid"], signal.SIGKILL)
            return await doomed, await survivor, family

        doomed, survivor, family = asyncio.run(two_streams())
        health = httpx.get(f"{url}/health")
        up_while_down = per_engine(url, "nanoengine:engine_up")
        after = client.completions.create(model=None, prompt="Still there?", max_tokens=4, **GREEDY)
        wait_for(lambda: per_engine(url, "nanoengine:kv_cache_usage_perc")["1"] == 0
                 and per_engine(url, "nanoengine:num_requests_running")["1"] == 0, "core 1 to free its blocks")
        wait_for(lambda: not any(alive(pid) for pid in family), "the dead core's processes to end")

        wait_for(lambda: status(url) == "ok", "core 0 to come back")
        generated = per_engine(url, "nanoengine:generation_tokens_total")
        again = asyncio.run(both_cores_busy(url))
        generated_again = per_engine(url, "nanoengine:generation_tokens_total")
        up_again = per_engine(url, "nanoengine:engine_up")
        [core_0, _] = httpx.get(f"{url}/health").json()["engines"]
        os.kill(core_0["pid"], signal.SIGKILL)  # its second death in the window: the server gives up
        assert server.wait(60) == 1
    assert "503" in str(doomed[-1]) or "died" in str(doomed[-1])
    assert survivor[-1].choices[0].finish_reason == "length" and len(survivor) >= 400
    assert after.usage.completion_tokens == 4
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    engine_0 = health.json()["engines"][0]  # before its restart, or as it loads the model again
    assert engine_0["state"] == "starting" or (engine_0["state"] == "restarting"
                                               and "died with exit code -9" in engine_0["why"])
    assert up_while_down == {"0": 0, "1": 1} and up_again == {"0": 1, "1": 1}
    assert [r.usage.completion_tokens for r in again] == [24] * len(again)
    assert generated_again["0"] > generated["0"]  # the new core 0 served


async def both_cores_busy(url: str) -> list:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return await asyncio.gather(*(client.completions.create(model=None, prompt=p, max_tokens=24, **GREEDY)
                                  for p in PROMPTS[:4]))


def headless_core(model: str, address: str, key_file, *flags: str, stderr=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanoengine.serve", model, "--headless", "--data-parallel-rank",
                             "1", "--data-parallel-address", address, "--cluster-key-file", str(key_file), *flags],
                            stderr=stderr, text=True)


def status(url: str) -> str:
    return httpx.get(f"{url}/health").json()["status"]


def test_a_headless_core_joins_serves_and_rejoins_and_a_mismatched_or_wrong_key_one_is_refused(sharp_tiny_model,
                                                                                                tmp_path):
    model, address = sharp_tiny_model[0], f"127.0.0.1:{free_port()}"
    key, wrong_key = tmp_path / "key", tmp_path / "wrong-key"
    key.write_text("the-cluster-key-that-both-sides-hold\n")
    wrong_key.write_text("a-key-of-the-right-length-but-not-the-server's")
    mismatched = headless_core(model, address, key, "--max-model-len", "128", "--data-parallel-size", "2",
                               stderr=subprocess.PIPE)
    cores = [mismatched, headless_core(model, address, key, *FLAGS)]
    try:
        with running_server(model, *FLAGS, "--data-parallel-address", address, "--cluster-key-file", str(key)) \
                as (_, url):
            assert mismatched.wait(60) == 1
            engines = httpx.get(f"{url}/health").json()["engines"]

            async def two_at_once():  # a client per event loop: its connections belong to the loop
                client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                return await asyncio.gather(*(client.completions.create(model=None, prompt=p, max_tokens=24,
                                                                        **GREEDY) for p in PROMPTS[:2]))

            replies = asyncio.run(two_at_once())
            generated = per_engine(url, "nanoengine:generation_tokens_total")
            cores.append(headless_core(model, address, wrong_key, *FLAGS, stderr=subprocess.PIPE))
            assert cores[-1].wait(120) == 1  # refused while both cores serve
            assert status(url) == "ok"
            cores[1].kill()
            wait_for(lambda: status(url) == "degraded", "the server to see rank 1 gone")
            cores.append(headless_core(model, address, key, *FLAGS))  # rank 1 again, in a new process
            wait_for(lambda: status(url) == "ok", "rank 1 to join again")
            again = asyncio.run(two_at_once())
            generated_again = per_engine(url, "nanoengine:generation_tokens_total")
        assert cores[3].wait(60) == 0  # it stops when the front goes away
    finally:
        for process in cores:
            process.kill()
            process.wait()
    assert [(e["state"], e["pid"] is None) for e in engines] == [("ready", False), ("ready", True)]
    assert [r.usage.completion_tokens for r in replies] == [24, 24] and generated == {"0": 24, "1": 24}
    assert [r.choices[0].text for r in again] == [r.choices[0].text for r in replies]
    assert generated_again == {"0": 48, "1": 48}  # the new rank 1 served one of them
    assert "refused this core: it runs another model or config: max_model_len=128 (this server: 512)" in \
        mismatched.stderr.read()
    assert "the front refused this core: it did not prove the cluster key" in cores[2].stderr.read()


def core(rank: int, *, running: int = 0, sent: int = 0, cached: list[int] = ()) -> CoreLoad:
    load = CoreLoad(rank, capacity=100, num_running=running, request_ids={f"{rank}-{i}" for i in range(sent)})
    load.remember(list(cached))
    return load


def test_the_router_prefers_the_longest_cached_prefix_within_the_load_margin():
    chain = prompt_hashes(list(range(64)), "tenant", 16, "xxhash")
    assert prompt_hashes(list(range(64)), "other", 16, "xxhash")[0] != chain[0]  # salts route apart
    prefix = Router("prefix")
    holder, idle = core(0, running=2, sent=2, cached=chain[:3]), core(1)
    assert prefix.pick([holder, idle], chain) is holder  # load 2, within the margin of 0
    busy_holder = core(0, running=2, sent=5, cached=chain)  # 3 waiting: load 14 > 0 + 8
    assert prefix.pick([busy_holder, idle], chain) is idle
    longer = core(1, cached=chain)
    assert prefix.pick([holder, longer], chain) is longer
    assert prefix.pick([core(0, sent=1), idle], chain) is idle  # nothing cached anywhere: the least loaded
    other_tenant = core(0, cached=prompt_hashes(list(range(64)), "other", 16, "xxhash"))
    assert prefix.pick([other_tenant, idle], chain) is idle  # equal loads: the core with room for a new prefix
    assert Router("least-loaded").pick([holder, idle], chain) is idle
    round_robin = Router("round-robin")
    assert [round_robin.pick([holder, idle], chain).rank for _ in range(3)] == [0, 1, 0]


def test_a_core_remembers_no_more_hashes_than_its_kv_cache_holds():
    load = CoreLoad(0, capacity=3)
    load.remember([1, 2, 3])
    load.remember([1, 4])  # 1 is used again, so 2 is the oldest
    assert list(load.recent_hashes) == [3, 1, 4] and load.num_cached_blocks([1, 4, 5]) == 2


def test_data_parallel_options_are_checked_and_offline_data_parallelism_is_refused(sharp_tiny_model):
    folder = sharp_tiny_model[0]
    config = EngineConfig(folder)
    with pytest.raises(ValueError, match="data_parallel_address, which is not set"):
        ServerConfig(data_parallel_size=2, data_parallel_size_local=1).check(config)
    with pytest.raises(ValueError, match="data_parallel_address must be HOST:PORT"):
        ServerConfig(data_parallel_address="nohost").check(config)
    with pytest.raises(ValueError, match="data_parallel_rank must be in"):
        ServerConfig(data_parallel_size=2, data_parallel_rank=2).check(config)
    with pytest.raises(ValueError, match="data_parallel_routing"):
        ServerConfig(data_parallel_routing="random").check(config)
    with pytest.raises(ValueError, match="nanoengine serve --data-parallel-size"):
        LLM(folder, data_parallel_size=2)


def test_each_local_core_sees_only_its_own_gpus(sharp_tiny_model, monkeypatch):
    config = EngineConfig(sharp_tiny_model[0])
    config.tensor_parallel_size = 2  # as two local cores of TP=2 have it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    pin_gpus(config, 1, num_local_cores=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    pin_gpus(config, 1, num_local_cores=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
