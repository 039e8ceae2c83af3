"""The server against a hostile client: every input below gets a 4xx with OpenAI's error body (never a
500, never a crash), and afterwards the server still serves the same tokens and its metrics are idle."""

import contextlib
import json
import math
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import metric, wait_for

from benchmarks.serve import running_server
from nanoengine.serve.protocol import MAX_JSON_DEPTH

MAX_MODEL_LEN = 256
BODY_LIMIT = 1 << 20
NORMAL = {"prompt": "The cat sat on", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
HELLO = [{"role": "user", "content": "Hello"}]
LONG_PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"


def nested_schema(depth: int) -> dict:
    """An object schema ``depth`` objects deep (JSON nesting about twice that)."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def deep_chat_body(depth: int) -> bytes:
    """A chat body whose response_format holds nested_schema(depth), written out by hand: Python's json module
    recurses once per level, and would give up first."""
    schema = '{"type": "object", "required": ["a"], "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
    return (f'{{"messages": {json.dumps(HELLO)}, '
            f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {schema}}}}}}}'
            ).encode()


@pytest.fixture(scope="module")
def server(sharp_tiny_model):
    with running_server(sharp_tiny_model[0], "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-request-bytes", str(BODY_LIMIT)) as (process, url):
        yield process, url


@pytest.fixture(scope="module")
def url(server):
    return server[1]


@pytest.fixture(scope="module")
def normal_tokens(url) -> str:
    return normal_text(url)


def normal_text(url: str) -> str:
    response = httpx.post(f"{url}/v1/completions", json=NORMAL, timeout=60)
    assert response.status_code == 200
    return response.json()["choices"][0]["text"]


def post(url: str, route: str, body) -> httpx.Response:
    """``body`` as Python's json writes it (NaN and Infinity as such, lone surrogates as \\u escapes), or bytes."""
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(f"{url}/v1/{route}", content=content, headers={"content-type": "application/json"},
                      timeout=60)


def assert_unharmed(url: str, normal_tokens: str) -> None:
    """The server still answers a normal request as before, and nothing is left running or held."""
    assert normal_text(url) == normal_tokens
    wait_for(lambda: metric(url, "nanoengine:num_requests_running") == 0
             and metric(url, "nanoengine:num_requests_waiting") == 0
             and metric(url, "nanoengine:kv_cache_usage_perc") == 0, "an idle engine", timeout_s=30)


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param, error
    return error


# (route, body, the param that the 400 names): each one crashed, stalled or 500ed the server, or was accepted.
HOSTILE = [
    # Beyond int64: the engine core died building its tensors.
    ("completions", {"prompt": "Hello", "max_tokens": 4, "top_k": 2**63}, "top_k"),
    ("completions", {"prompt": "Hello", "seed": 2**64}, "seed"),
    ("completions", {"prompt": "Hello", "priority": -2**63 - 1}, "priority"),
    ("completions", {"prompt": "Hello", "stop_token_ids": [2**70]}, "stop_token_ids.0"),
    # Lone surrogates: block hashing, the tokenizer or the chat template failed on them.
    ("completions", {"prompt": LONG_PROMPT, "cache_salt": "\ud800"}, "cache_salt"),
    ("completions", {"prompt": "caf\udce9"}, "prompt"),
    ("completions", {"prompt": "Hello", "stop": ["\ud800"]}, "stop.0"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\udfff"}]}, "messages.0"),
    ("completions", {"prompt": "Hello", "structured_outputs": {"json": {"enum": ["\ud800"]}}},
     "structured_outputs"),
    # Wrong shapes inside chat messages.
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    # Deep JSON: a RecursionError while pickling at 500 levels, seconds of compiling in the request path.
    ("chat/completions", deep_chat_body(250), "response_format.json_schema.schema"),
    ("completions", {"prompt": "Hello", "structured_outputs": {"json": nested_schema(MAX_JSON_DEPTH)}},
     "structured_outputs"),
    # logprobs as large as the vocabulary: megabytes per token.
    ("completions", {"prompt": "Hello", "logprobs": 49152}, "logprobs"),
    ("chat/completions", {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    # Non-finite floats (NaN temperature acted as greedy, Infinity as random) and an overflowing temperature.
    ("completions", {"prompt": "Hello", "temperature": math.nan}, "temperature"),
    ("completions", {"prompt": "Hello", "temperature": math.inf}, "temperature"),
    ("completions", {"prompt": "Hello", "min_p": math.inf}, "min_p"),
    ("completions", {"prompt": "Hello", "presence_penalty": math.nan}, "presence_penalty"),
    ("completions", {"prompt": "Hello", "repetition_penalty": -math.inf}, "repetition_penalty"),
    ("completions", {"prompt": "Hello", "temperature": 1e-45}, "temperature"),
    # Coercions that pydantic's lax mode made.
    ("chat/completions", {"messages": HELLO, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("completions", {"prompt": [True]}, "prompt.0"),
    ("completions", {"prompt": "Hello", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "Hello", "max_tokens": "16"}, "max_tokens"),
    ("completions", {"prompt": "Hello", "max_tokens": 4.0}, "max_tokens"),
    ("completions", {"prompt": "Hello", "ignore_eos": 1}, "ignore_eos"),
    # Not an object at all.
    ("completions", [1, 2], None),
    ("completions", "Hello", None),
]


@pytest.mark.parametrize("route, body, param", HOSTILE, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(HOSTILE)])
def test_a_hostile_field_is_a_400_naming_it_and_harms_nothing(url, normal_tokens, route, body, param):
    error = assert_openai_error(post(url, route, body), 400, param)
    if param is not None:
        assert param.split(".")[0] in error["message"]
    assert_unharmed(url, normal_tokens)


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/nothing", b"{}", 404),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/completions", b'{"prompt": "Hel', 400),  # truncated JSON
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),  # deeper than the JSON parser goes
    ("POST", "/v1/completions", b'{"prompt": "Hello", "max_tokens": 4}' + b" " * BODY_LIMIT, 413),
])
def test_routing_and_parse_errors_have_openai_bodies_too(url, normal_tokens, method, path, body, status):
    response = httpx.request(method, f"{url}{path}", content=body, headers={"content-type": "application/json"},
                             timeout=60)
    assert_openai_error(response, status, None)
    assert_unharmed(url, normal_tokens)


def test_a_streamed_body_over_the_limit_is_refused_before_it_is_read_whole(server, normal_tokens):
    process, url = server
    memory_before = resident_mib(process.pid)

    def chunks():  # no Content-Length: the server can only count
        yield b'{"prompt": "'
        for _ in range(512):
            yield b"a" * (64 << 10)  # 32 MiB in all
        yield b'"}'

    with contextlib.suppress(httpx.TransportError):  # the server may hang up while the client still writes
        assert_openai_error(httpx.post(f"{url}/v1/completions", content=chunks(), timeout=60), 413, None)
    assert resident_mib(process.pid) - memory_before < 16
    assert_unharmed(url, normal_tokens)


def resident_mib(pid: int) -> float:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024


# What "at once" allows: a 20 MB body once held every client for 9-13 s, while the normal request takes
# 0.35-0.7 s even on a machine that other test runs load.
STALL_S = 3.0


def test_while_a_20_mb_body_and_a_deep_schema_are_refused_others_are_served_at_once(server, normal_tokens):
    process, url = server
    memory_before = resident_mib(process.pid)
    stop, refusals = threading.Event(), []

    def hostile(body: dict, status: int):
        while not stop.is_set():
            refusals.append(post(url, "chat/completions", body).status_code == status)

    huge = {"messages": [{"role": "user", "content": "word " * 4_000_000}]}
    deep = deep_chat_body(400)
    attackers = [threading.Thread(target=hostile, args=args) for args in ((huge, 413), (deep, 400))]
    for attacker in attackers:
        attacker.start()
    try:
        wait_for(lambda: len(refusals) >= 2, "the first refusals", timeout_s=60)
        for _ in range(3):
            start = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            assert time.monotonic() - start < STALL_S
            start = time.monotonic()
            assert normal_text(url) == normal_tokens
            assert time.monotonic() - start < STALL_S
    finally:
        stop.set()
        for attacker in attackers:
            attacker.join()
    assert all(refusals)
    assert resident_mib(process.pid) - memory_before < 64  # 20 MB bodies are never read in


JUNK = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
                 st.sampled_from(["\ud800", "a\udfffb"]),  # lone surrogates, which st.text leaves out
                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
FIELDS = {
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=6), JUNK),
    "max_tokens": st.one_of(st.integers(-2, 6), JUNK),
    "temperature": st.one_of(st.floats(allow_nan=True, allow_infinity=True), JUNK),
    "top_p": st.one_of(st.floats(-1, 2), JUNK),
    "top_k": st.one_of(st.integers(-3, 100), st.integers(), JUNK),
    "min_p": st.one_of(st.floats(), JUNK),
    "seed": st.one_of(st.integers(), JUNK),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), JUNK),
    "logprobs": st.one_of(st.integers(-2, 30), JUNK),
    "presence_penalty": st.one_of(st.floats(), JUNK),
    "repetition_penalty": st.one_of(st.floats(), JUNK),
    "min_tokens": st.one_of(st.integers(-2, 8), JUNK),
    "stream": JUNK,
    "cache_salt": JUNK,
    "structured_outputs": st.one_of(st.fixed_dictionaries({"regex": st.text(max_size=6)}), JUNK),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "x"])}),
                                 JUNK),
}
MESSAGES = st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", 7]),
                                                     "content": st.one_of(st.text(max_size=12), JUNK)}),
                              max_size=3), JUNK)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=st.booleans(), body=st.fixed_dictionaries({}, optional=FIELDS), messages=MESSAGES)
def test_fuzzed_bodies_get_a_reply_or_a_4xx_never_a_500(url, chat, body, messages):
    if chat:
        body = {**{k: v for k, v in body.items() if k not in ("prompt", "logprobs")}, "messages": messages}
    body["max_tokens"] = body.get("max_tokens", 4) if not isinstance(body.get("max_tokens"), int) else min(
        body["max_tokens"], 6)
    response = post(url, "chat/completions" if chat else "completions", body)
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_after_the_fuzzing_the_server_is_unharmed(url, normal_tokens):
    assert_unharmed(url, normal_tokens)
