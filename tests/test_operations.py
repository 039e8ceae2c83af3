"""The server as an operator runs it (docs/operations.md): bounded admission with 429s, a queue deadline,
readiness, a graceful drain, and a low open-file limit. Real server processes, real clients, 127.0.0.1 only.

To hold requests in the queue whatever the machine's speed, a test stops the engine core (SIGSTOP) for a
moment and lets it go on (SIGCONT)."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from test_server import alive, descendants, metric, wait_for

from benchmarks.serve import running_server, server_process
from nanoengine.serve.cluster.admission import AdmissionControl, AdmissionLimits
from nanoengine.serve.cluster.limits import REPEATS_LOGGED, RepeatFilter

TINY = ("--max-model-len", "512")


class Stream:
    """A streamed completion read in a thread: its HTTP status and its SSE data lines."""

    def __init__(self, url: str, **body):
        self.status, self.events = None, []
        self.thread = threading.Thread(target=self.read, args=(url, {"ignore_eos": True, **body, "stream": True}))
        self.thread.start()

    def read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            self.status = response.status_code
            lines = list(response.iter_lines())
            self.events = [line for line in lines if line.startswith("data: ")] or lines

    def wait_first_token(self) -> None:
        wait_for(lambda: self.status is not None, "the first token")
        assert self.status == 200

    def finished_with(self) -> str | None:
        self.thread.join(120)
        chunks = [json.loads(e.removeprefix("data: ")) for e in self.events[:-1]]
        return chunks[-1]["choices"][0]["finish_reason"] if chunks and "choices" in chunks[-1] else None


def ready(url: str) -> httpx.Response:
    return httpx.get(f"{url}/ready")


def rss_kib(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1])


async def flood(url: str, count: int, max_tokens: int = 2) -> list[tuple[int | str, dict, float]]:
    """``count`` requests at once, each on its own connection: (status or error, headers, seconds) for each."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        async def one():
            start = time.perf_counter()
            try:
                response = await client.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": max_tokens})
                return response.status_code, response.headers, time.perf_counter() - start
            except httpx.HTTPError as error:
                return type(error).__name__, {}, time.perf_counter() - start

        return await asyncio.gather(*(one() for _ in range(count)))


def core_pid(url: str) -> int:
    return httpx.get(f"{url}/health").json()["engines"][0]["pid"]


def test_a_flood_past_the_caps_is_refused_at_once_while_admitted_requests_finish_and_a_drain_can_time_out(
        sharp_tiny_model):
    flags = (*TINY, "--max-waiting-requests", "3", "--max-waiting-tokens", "600", "--shutdown-timeout", "1")
    with running_server(sharp_tiny_model[0], *flags) as (server, url):
        rss_before, core = rss_kib(server.pid), core_pid(url)
        assert ready(url).status_code == 200
        os.kill(core, signal.SIGSTOP)  # holds every request in the queue (briefly: ZMQ's heartbeat allows 5 s)
        queued = [Stream(url, prompt="word " * 300, max_tokens=2)]
        wait_for(lambda: ready(url).json()["num_waiting_tokens"] >= 300, "the long prompt to queue")
        too_long = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 350, "max_tokens": 2})
        queued += [Stream(url, prompt="Hi", max_tokens=2) for _ in range(2)]
        wait_for(lambda: ready(url).json()["num_waiting_requests"] == 3, "three requests to queue")
        full = ready(url)
        refused = asyncio.run(flood(url, 40))
        os.kill(core, signal.SIGCONT)
        finish_reasons = [stream.finished_with() for stream in queued]
        wait_for(lambda: ready(url).status_code == 200, "readiness once the queue emptied")
        rss_after = rss_kib(server.pid)

        doomed = Stream(url, prompt="Go on", max_tokens=480)
        doomed.wait_first_token()
        family = descendants(server.pid)
        os.kill(core, signal.SIGSTOP)  # it cannot finish within the drain
        server.send_signal(signal.SIGTERM)  # drains for 1 s, then ends it
        assert doomed.finished_with() is None
        os.kill(core, signal.SIGCONT)
        assert server.wait(60) == 0
    assert too_long.status_code == 429 and "--max-waiting-tokens 600" in too_long.json()["error"]["message"]
    assert int(too_long.headers["retry-after"]) >= 1
    assert full.status_code == 503 and "the queue is full" in full.json()["why"][0]
    assert {status for status, _, _ in refused} == {429}
    assert all(int(headers["retry-after"]) >= 1 for _, headers, _ in refused)
    assert max(seconds for _, _, seconds in refused) < 2.0
    assert finish_reasons == ["length"] * 3
    assert rss_after - rss_before < 20 * 1024
    assert '"code": 503' in doomed.events[-2] and "shutting down" in doomed.events[-2]
    assert doomed.events[-1] == "data: [DONE]"
    wait_for(lambda: not any(alive(pid) for pid in family), "every process to end")


def test_a_request_past_its_queue_deadline_gets_a_503_never_a_stream_and_a_drain_lets_in_flight_requests_finish(
        sharp_tiny_model):
    flags = (*TINY, "--max-queue-seconds", "1", "--shutdown-timeout", "60")
    with running_server(sharp_tiny_model[0], *flags) as (server, url):
        core = core_pid(url)
        generated = metric(url, "nanoengine:generation_tokens_total")

        async def two_late_requests():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"prompt": "Hi", "max_tokens": 2}
                return await asyncio.gather(client.post(f"{url}/v1/completions", json={**body, "stream": True}),
                                            client.post(f"{url}/v1/completions", json=body))

        os.kill(core, signal.SIGSTOP)  # the engine core takes nothing from its queue
        start = time.monotonic()
        late = asyncio.run(two_late_requests())
        waited = time.monotonic() - start
        os.kill(core, signal.SIGCONT)
        wait_for(lambda: metric(url, "nanoengine:num_requests_waiting") == 0
                 and metric(url, "nanoengine:num_requests_running") == 0, "the late requests' aborts")
        generated_late = metric(url, "nanoengine:generation_tokens_total") - generated

        in_flight = Stream(url, prompt="Hi", max_tokens=240)
        in_flight.wait_first_token()
        family = descendants(server.pid)
        os.kill(core, signal.SIGSTOP)  # it stays in flight until the drain has begun
        server.send_signal(signal.SIGTERM)
        wait_for(lambda: ready(url).status_code == 503, "readiness to go down")
        during_drain = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        os.kill(core, signal.SIGCONT)
        assert in_flight.finished_with() == "length"
        assert server.wait(60) == 0
    for response in late:
        assert response.status_code == 503 and response.headers["content-type"] == "application/json"
        assert "--max-queue-seconds" in response.json()["error"]["message"]
    assert 1 <= waited < 4 and generated_late == 0  # ended by the deadline, never run
    assert during_drain.status_code == 503 and "shutting down" in during_drain.json()["error"]["message"]
    assert len([e for e in in_flight.events if '"text"' in e]) == 240
    wait_for(lambda: not any(alive(pid) for pid in family), "every process to end")


def test_at_a_low_open_file_limit_a_burst_gets_clean_answers_and_a_short_log(sharp_tiny_model, tmp_path):
    log = tmp_path / "server.log"
    command = ["prlimit", "--nofile=128:256", sys.executable, "-m", "nanoengine.serve", sharp_tiny_model[0],
               "--max-model-len", "256", "--max-waiting-requests", "0", "--max-waiting-tokens", "0"]
    with log.open("w") as log_file, server_process(command, log=log_file) as (_, url):
        answers = asyncio.run(flood(url, 600, max_tokens=8))
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    statuses = [status for status, _, _ in answers]
    assert set(statuses) <= {200, 503} and statuses.count(200) > 0, sorted(set(map(str, statuses)))
    assert max(seconds for _, _, seconds in answers) < 60
    assert after.status_code == 200
    text = log.read_text()
    assert "open-file limit: soft 256 (was 128), hard 256" in text
    assert text.count("Too many open files") <= 2 * REPEATS_LOGGED and len(text) < 200_000


def test_the_repeat_filter_logs_a_few_of_a_kind_then_says_how_many_it_left_out(monkeypatch):
    import logging

    clock = [0.0]
    monkeypatch.setattr("nanoengine.serve.cluster.limits.time.monotonic", lambda: clock[0])
    repeats = RepeatFilter()
    record = logging.LogRecord("asyncio", logging.ERROR, "x.py", 1, "accept failed", None, None)
    other = logging.LogRecord("asyncio", logging.ERROR, "x.py", 2, "something else", None, None)
    passed = [repeats.filter(record) for _ in range(1000)]
    assert passed.count(True) == REPEATS_LOGGED and repeats.filter(other)
    clock[0] = 61.0
    assert repeats.filter(record) and "995 more like this were not logged" in record.getMessage()


def test_admission_counts_waiting_requests_and_tokens_until_their_first_token():
    admission = AdmissionControl(AdmissionLimits(max_waiting_requests=2, max_waiting_tokens=100, max_queue_seconds=0))
    first, second = admission.enter(), admission.enter()
    assert admission.add_tokens(first, 150) is None  # alone in the queue: taken whatever its length
    assert "--max-waiting-tokens 100" in admission.add_tokens(second, 10)
    assert "--max-waiting-requests 2" in admission.full()
    admission.started(first)
    admission.leave(second)
    assert (admission.num_waiting, admission.num_waiting_tokens, admission.full()) == (0, 0, None)
    assert admission.readiness(num_ready_cores=0)[1]["why"] == ["no engine core is ready"]
    admission.leave(first)
    assert not admission.tickets and admission.seconds_left(first) is None


def test_bad_operations_flags_are_refused_naming_the_flag(sharp_tiny_model):
    result = subprocess.run([sys.executable, "-m", "nanoengine.serve", sharp_tiny_model[0], "--max-waiting-tokens",
                             "-1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--max-waiting-tokens must be >= 0" in result.stderr
