"""The OpenAI-compatible server as a user runs it: real server processes on free ports, driven by the
official openai client (and httpx where the raw HTTP matters)."""

import asyncio
import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, AuthenticationError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve import running_server
from nanoengine import LLM, SamplingParams
from nanoengine.config import EngineConfig
from nanoengine.sampling_params import StructuredOutputsParams, field_error
from nanoengine.serve.cli import build_parser, engine_options, with_server_defaults
from nanoengine.serve.engine_core import EngineCoreRequest, handle
from nanoengine.serve.protocol import CompletionRequest, ResponseFormat, structured_outputs_params

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tiny_server(sharp_tiny_model):
    folder, _ = sharp_tiny_model
    with running_server(folder, "--max-model-len", str(MAX_MODEL_LEN), "--api-key", KEY) as (_, url):
        yield url


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir):
    with running_server(smollm2_dir, "--max-model-len", "512") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(tiny_server) -> OpenAI:
    return OpenAI(base_url=f"{tiny_server}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tiny_llm(sharp_tiny_model, one_torch_thread):
    with LLM(sharp_tiny_model[0], max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def metric(url: str, name: str) -> float:
    """The sum of a metric's samples named ``name`` (over its labels)."""
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name)


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models_lists_the_served_model(client, sharp_tiny_model):
    assert [m.id for m in client.models.list().data] == [Path(sharp_tiny_model[0]).name]


def test_completion_gives_the_offline_text_and_usage(client, tiny_llm):
    reply = client.completions.create(model=client.models.list().data[0].id, prompt="The cat sat on", **GREEDY)
    offline = tiny_llm.generate(["The cat sat on"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)[0]
    assert reply.choices[0].text == offline.outputs[0].text and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(offline.prompt_token_ids), 12)


def test_streamed_completion_equals_non_streamed_with_a_final_usage_chunk(client):
    whole = client.completions.create(model=None, prompt=[5, 6, 7, 8], **GREEDY)
    chunks = list(client.completions.create(model=None, prompt=[5, 6, 7, 8], stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(client):
    prompt = list(range(300, 340))  # two full blocks and 8 tokens, sent nowhere else
    first = client.completions.create(model=None, prompt=prompt, max_tokens=1)
    again = list(client.completions.create(model=None, prompt=prompt, max_tokens=1, stream=True,
                                           stream_options={"include_usage": True}))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again[-1].usage.prompt_tokens_details.cached_tokens == 32


def test_chat_stream_starts_with_the_role_and_equals_non_streamed(client):
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=None, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=None, messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks) == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 12


def test_logprobs_in_openai_shapes(client):
    reply = client.completions.create(model=None, prompt="Hello", logprobs=2, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert "".join(logprobs.tokens) == reply.choices[0].text
    # Greedy: the sampled token is the most likely one, so it heads its top-2.
    assert all(len(top) == 2 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs,
                                                                             logprobs.token_logprobs))
    chat = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                          top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


BAD_REQUESTS = [
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens", "integer"),
    ("completions", {"prompt": "word " * MAX_MODEL_LEN}, "prompt", "max_model_len"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, "model", "not served"),
    ("completions", {"prompt": [10**9]}, "prompt", "vocabulary"),
    ("completions", {"prompt": "hi", "structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ("chat/completions", {"messages": []}, "messages", "at least 1"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs"),
]


@pytest.mark.parametrize("route, body, param, says", BAD_REQUESTS)
def test_bad_requests_get_400_with_openai_error_body(tiny_server, route, body, param, says):
    response = httpx.post(f"{tiny_server}/v1/{route}", json=body, headers=AUTH)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert says in error["message"]


def test_unknown_fields_are_ignored(client):
    reply = client.completions.create(model=None, prompt="Hi", max_tokens=2, extra_body={"best_of_luck": 1})
    assert reply.usage.completion_tokens <= 2


def test_api_key_is_required_on_v1_routes(tiny_server):
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{tiny_server}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.post(f"{tiny_server}/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{tiny_server}/health").status_code == 200


def test_metrics_count_prompt_and_generated_tokens(tiny_server, client):
    names = ["nanoengine:prompt_tokens_total", "nanoengine:generation_tokens_total",
             "nanoengine:time_to_first_token_seconds_count", "nanoengine:e2e_request_latency_seconds_count"]
    before = [metric(tiny_server, n) for n in names]
    reply = client.completions.create(model=None, prompt="Count these tokens", **GREEDY)
    after = [metric(tiny_server, n) for n in names]
    assert [a - b for a, b in zip(after, before)] == [reply.usage.prompt_tokens, 12, 1, 1]
    assert metric(tiny_server, "nanoengine:inter_token_latency_seconds_count") >= 11


def wait_for(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_blocks_freed(tiny_server):
    generated_before = metric(tiny_server, "nanoengine:generation_tokens_total")
    body = {"prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{tiny_server}/v1/completions", json=body, headers=AUTH) as response:
        data_lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        for _ in range(3):
            next(data_lines)
        assert metric(tiny_server, "nanoengine:kv_cache_usage_perc") > 0
    wait_for(lambda: metric(tiny_server, "nanoengine:num_requests_running") == 0
             and metric(tiny_server, "nanoengine:kv_cache_usage_perc") == 0, "the abort")
    assert metric(tiny_server, "nanoengine:generation_tokens_total") - generated_before < 200


def test_a_client_that_drops_a_non_streamed_request_is_aborted_too(smollm2_server):
    # SmolLM2, not the tiny model: 200 tokens take it seconds, so the request is still running when the
    # client gives up (the tiny model can finish them first).
    generated_before = metric(smollm2_server, "nanoengine:generation_tokens_total")
    body = {"prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{smollm2_server}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
    wait_for(lambda: metric(smollm2_server, "nanoengine:num_requests_running") == 0
             and metric(smollm2_server, "nanoengine:kv_cache_usage_perc") == 0, "the abort")
    assert metric(smollm2_server, "nanoengine:generation_tokens_total") - generated_before < 200


PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(16)]


def test_16_concurrent_streaming_greedy_clients_get_the_offline_tokens(smollm2_dir, smollm2_server):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    with LLM(smollm2_dir, max_model_len=512) as llm:
        offline = llm.generate(PROMPTS, params, use_tqdm=False)
    client = AsyncOpenAI(base_url=f"{smollm2_server}/v1", api_key="none", max_retries=0)
    streamed = asyncio.run(stream_all(client))
    for output, (text, tokens) in zip(offline, streamed):
        assert text == output.outputs[0].text
        assert tokens == [lp[t].decoded_token for t, lp in zip(output.outputs[0].token_ids, output.outputs[0].logprobs)]


async def stream_all(client: AsyncOpenAI) -> list[tuple[str, list[str]]]:
    async def one(prompt):
        text, tokens = "", []
        async for chunk in await client.completions.create(model=None, prompt=prompt, stream=True, logprobs=0,
                                                           **GREEDY):
            text += chunk.choices[0].text
            tokens += chunk.choices[0].logprobs.tokens
        return text, tokens

    return await asyncio.gather(*(one(p) for p in PROMPTS))


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue  # ended meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stream_in_background(url: str, events: list[str]) -> threading.Thread:
    """A long streamed completion whose SSE data lines land in ``events``."""
    body = {"prompt": "Go on and on", "max_tokens": 240, "ignore_eos": True, "stream": True}

    def read():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)

    thread = threading.Thread(target=read)
    thread.start()
    wait_for(lambda: events, "the stream's first token")  # the response starts with it
    return thread


@pytest.mark.parametrize("victim", ["engine core", "tensor-parallel rank 1"])
def test_killing_the_engine_core_or_a_rank_fails_requests_naming_it_and_exits_leaving_no_process(
        sharp_tiny_model, tmp_path, victim):
    log = tmp_path / "server.log"
    with log.open("w") as log_file, running_server(sharp_tiny_model[0], "--max-model-len", str(MAX_MODEL_LEN),
                                                   "--tensor-parallel-size", "2", "--max-core-restarts", "0",
                                                   log=log_file) as (server, url):
        events: list[str] = []
        stream = stream_in_background(url, events)
        family = descendants(server.pid)
        core = next(pid for pid in family if os.getpgid(pid) == pid)  # the engine core leads its own group
        [rank_1] = [pid for pid in family if alive(pid) and pid != core and os.getpgid(pid) == core]
        os.kill(core if victim == "engine core" else rank_1, signal.SIGKILL)
        stream.join()
        assert server.wait(60) == 1
    assert '"code": 503' in events[-2] and events[-1] == "data: [DONE]"
    message = json.loads(events[-2].removeprefix("data: "))["error"]["message"]
    if victim == "engine core":
        whys = [f"the engine core (rank 0, pid {core}) died with exit code -9"]
    else:  # the core outlives its worker long enough to say which rank died, in a step or before the next one
        whys = [f"the engine core (rank 0, pid {core}) failed: RuntimeError: ",
                f"tensor-parallel rank 1 (pid {rank_1})"]
    assert all(why in message for why in whys), message
    assert all(why in log.read_text() for why in whys)
    wait_for(lambda: not any(alive(pid) for pid in family), "every process to end")


def test_a_core_silent_past_the_heartbeat_fails_its_requests_at_once_is_not_ready_and_is_restarted(
        sharp_tiny_model):
    """A stopped core (SIGSTOP; swapping does the same) loses its heartbeat after 5 s. It counts as dead: its
    stream ends with a 503 instead of hanging, /ready says no core is ready, and it is killed and started
    again. (Before, it reconnected after SIGCONT under an identity the front ignored: requests hung for good.)"""
    body = {"prompt": "Go on and on", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with running_server(sharp_tiny_model[0], "--max-model-len", "512") as (_, url):
        [core] = httpx.get(f"{url}/health").json()["engines"]
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            events.append(next(line for line in lines if line.startswith("data: ")))
            os.kill(core["pid"], signal.SIGSTOP)
            stopped_at = time.monotonic()
            events += [line for line in lines if line.startswith("data: ")]
            failed_after = time.monotonic() - stopped_at
        ready = httpx.get(f"{url}/ready")
        wait_for(lambda: httpx.get(f"{url}/ready").status_code == 200, "the core to be started again",
                 timeout_s=120)
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        [restarted] = httpx.get(f"{url}/health").json()["engines"]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and f"pid {core['pid']}) was silent for more than 5 s" in error["message"]
    assert events[-1] == "data: [DONE]" and 5 <= failed_after < 20
    assert ready.status_code == 503 and "no engine core is ready" in ready.json()["why"]
    assert not alive(core["pid"]) and restarted["pid"] != core["pid"] and restarted["state"] == "ready"
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def test_the_engine_core_exits_when_the_front_process_dies_and_removes_its_sockets(sharp_tiny_model, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the front makes its socket folder
    with running_server(sharp_tiny_model[0], "--max-model-len", str(MAX_MODEL_LEN)) as (server, url):
        family = descendants(server.pid)
        [socket_dir] = tmp_path.glob("nanoengine-*")
        assert {p.name for p in socket_dir.iterdir()} == {"engines"}
        server.kill()
        server.wait()
    wait_for(lambda: not any(alive(pid) for pid in family), "every process to end")
    assert not socket_dir.exists()


@pytest.mark.parametrize("signals, flags", [([signal.SIGINT], ()), ([signal.SIGTERM], ("--shutdown-timeout", "0")),
                                           ([signal.SIGTERM, signal.SIGTERM], ())])
def test_a_signal_without_a_drain_ends_in_flight_requests_and_stops_every_process(sharp_tiny_model, signals, flags):
    """SIGINT, SIGTERM with --shutdown-timeout 0, and a second SIGTERM during a drain all stop at once."""
    with running_server(sharp_tiny_model[0], "--max-model-len", str(MAX_MODEL_LEN), *flags) as (server, url):
        events: list[str] = []
        stream = stream_in_background(url, events)
        family = descendants(server.pid)
        for i, sig in enumerate(signals):
            if i:  # two signals sent at once may reach the process as one: let the first start its drain
                wait_for(lambda: httpx.get(f"{url}/ready").status_code == 503, "the drain to begin")
            server.send_signal(sig)
        stream.join()
        assert server.wait(60) == 0
    assert "shutting down" in events[-2] and events[-1] == "data: [DONE]"
    wait_for(lambda: not any(alive(pid) for pid in family), "every process to end")


def test_every_llm_option_is_a_flag():
    args = build_parser().parse_args(["/some/model", "--port", "9000", "--max-num-seqs", "64",
                                      "--no-enable-prefix-caching", "--tensor-parallel-size", "2",
                                      "--cpu-kvcache-space-gib", "0.5"])
    assert (args.model, args.port, args.host) == ("/some/model", 9000, "127.0.0.1")
    assert engine_options(args) == {"max_num_seqs": 64, "enable_prefix_caching": False, "tensor_parallel_size": 2,
                                    "cpu_kvcache_space_gib": 0.5}


def test_the_server_takes_vllm_server_defaults_on_the_cpu(sharp_tiny_model):
    """A step of 2,048 tokens and 128 requests, as `vllm serve` on the CPU; what the user gives is kept, and a
    smaller budget lowers the request cap with it (as offline)."""
    assert with_server_defaults({"device": "cpu"}) == {"device": "cpu", "max_num_batched_tokens": 2048,
                                                       "max_num_seqs": 128}
    assert with_server_defaults({"device": "cpu", "max_num_batched_tokens": 64}) == {
        "device": "cpu", "max_num_batched_tokens": 64, "max_num_seqs": 64}
    assert with_server_defaults({"device": "cpu", "max_num_seqs": 300, "max_num_batched_tokens": 8192}) == {
        "device": "cpu", "max_num_batched_tokens": 8192, "max_num_seqs": 300}
    assert with_server_defaults({"device": "cuda"}) == {"device": "cuda"}
    config = EngineConfig.from_options(sharp_tiny_model[0], with_server_defaults({"device": "cpu"}))
    assert (config.max_num_batched_tokens, config.max_num_seqs) == (2048, 128)


def test_an_engine_core_refusal_names_the_field_at_fault():
    class RefusingEngine:
        def enqueue(self, request):
            raise AssertionError("a refused request is never queued")

        def make_request(self, *args):
            raise field_error("max_tokens", "max_tokens: too many")

    request = EngineCoreRequest("cmpl-1", [1, 2], SamplingParams(), 0, 0.0)
    assert handle(RefusingEngine(), request) == {"cmpl-1": ("max_tokens: too many", "max_tokens")}


def test_response_format_and_structured_outputs_map_onto_engine_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_params = structured_outputs_params
    assert as_params(ResponseFormat(type="json_object"), None) == StructuredOutputsParams(json_object=True)
    assert as_params(ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": schema}}),
                     None) == StructuredOutputsParams(json=schema)
    assert as_params(ResponseFormat(type="text"), None) is None and as_params(None, None) is None
    assert as_params(None, {"regex": "[ab]+"}) == StructuredOutputsParams(regex="[ab]+")
    assert as_params(None, {"choice": ["yes", "no"]}) == StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match="not both"):
        as_params(ResponseFormat(type="json_object"), {"regex": "a"})
    request = CompletionRequest(prompt="hi", structured_outputs={"grammar": 'root ::= "a"'})
    assert request.to_sampling_params({}).structured_outputs == StructuredOutputsParams(grammar='root ::= "a"')


def test_served_outputs_follow_response_format_and_structured_outputs(client):
    answer = {"enum": ["yes", "no"]}
    reply = client.chat.completions.create(
        model=None, messages=[{"role": "user", "content": "Yes or no?"}], temperature=0, max_tokens=16,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), answer)
    schema = {"type": "object", "properties": {"answer": answer}, "required": ["answer"]}
    reply = client.completions.create(model=None, prompt="Answer:", temperature=0, max_tokens=16, extra_body={
        "structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    jsonschema.validate(json.loads(reply.choices[0].text), schema)
    choice = client.completions.create(model=None, prompt="Pick:", temperature=0, max_tokens=16,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", choice.choices[0].text) and choice.choices[0].finish_reason == "stop"


def test_fields_a_request_leaves_out_take_the_model_generation_config(sharp_tiny_model, tmp_path):
    """As vLLM's server does: generation_config.json's sampling values fill the fields a request leaves out
    (max_new_tokens caps a chat request without max_tokens); the request's own values win."""
    model_dir = shutil.copytree(sharp_tiny_model[0], tmp_path / "model")
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 5.0, "max_new_tokens": 6}))
    messages = [{"role": "user", "content": "Count: one two three"}]
    with running_server(str(model_dir), "--max-model-len", str(MAX_MODEL_LEN)) as (_, url):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        defaulted = client.chat.completions.create(model=None, messages=messages, seed=0)
        overridden = client.chat.completions.create(model=None, messages=messages, temperature=0, max_tokens=4)
    with LLM(str(model_dir), max_model_len=MAX_MODEL_LEN) as llm:
        [hot, greedy] = llm.chat([messages] * 2, [SamplingParams(temperature=5.0, seed=0, max_tokens=6),
                                                 SamplingParams(temperature=0, max_tokens=6)], use_tqdm=False)
    assert hot.outputs[0].token_ids != greedy.outputs[0].token_ids  # so the default temperature shows
    assert (defaulted.usage.completion_tokens, defaulted.choices[0].finish_reason) == (6, "length")
    assert defaulted.choices[0].message.content == hot.outputs[0].text
    assert overridden.usage.completion_tokens == 4
    assert overridden.choices[0].message.content == greedy.outputs[0].text[:len(overridden.choices[0].message.content)]
    assert overridden.choices[0].message.content
