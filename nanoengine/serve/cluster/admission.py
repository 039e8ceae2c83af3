"""Admission control in the front: how many requests and prompt tokens may wait for their first token,
for how long, and whether the server is ready for more (docs/operations.md has the flags and the why).

``AdmissionGate`` refuses a generation request before its body is read while the queue is full (429) or
the server drains (503); ``AdmissionControl.add_tokens`` refuses one whose prompt would overfill the token
cap (429); ``Shutdown`` drains on SIGTERM.
"""

import asyncio
import json
import logging
import math
import signal
import time
from collections import deque
from dataclasses import dataclass, field

from nanoengine.serve.errors import SHUTTING_DOWN, APIError, engine_gone, overloaded

logger = logging.getLogger("nanoengine.serve")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
RETRY_AFTER_MAX_S = 60
RECENT_STARTS = 32  # first tokens remembered to estimate how often a queued request leaves the queue


@dataclass
class AdmissionLimits:
    max_waiting_requests: int  # 0 = unbounded
    max_waiting_tokens: int  # 0 = unbounded
    max_queue_seconds: float  # 0 = no deadline


@dataclass(eq=False)  # one per request: compared (and hashed) by identity
class Ticket:
    """One request from the gate to the end of its response."""

    arrival: float = field(default_factory=time.monotonic)
    num_tokens: int = 0
    waiting: bool = True


class AdmissionControl:
    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self.tickets: set[Ticket] = set()  # every request in flight, waiting or not
        self.num_waiting = self.num_waiting_tokens = 0
        self.recent_starts: deque[float] = deque(maxlen=RECENT_STARTS)
        self.draining = False

    def full(self) -> str | None:
        """Why the queue takes no more requests, while it does not."""
        requests, tokens = self.limits.max_waiting_requests, self.limits.max_waiting_tokens
        if requests and self.num_waiting >= requests:
            return f"{self.num_waiting} requests are waiting, the server's limit (--max-waiting-requests {requests})"
        if tokens and self.num_waiting_tokens >= tokens:
            return (f"{self.num_waiting_tokens} prompt tokens are waiting, the server's limit (--max-waiting-tokens "
                    f"{tokens})")
        return None

    def enter(self) -> Ticket:
        ticket = Ticket()
        self.tickets.add(ticket)
        self.num_waiting += 1
        return ticket

    def add_tokens(self, ticket: Ticket, num_tokens: int) -> str | None:
        """Count a tokenized prompt as waiting, or say why it would take the queue past its token cap (a prompt
        alone in the queue is always taken, whatever its length)."""
        cap = self.limits.max_waiting_tokens
        if cap and self.num_waiting_tokens and self.num_waiting_tokens + num_tokens > cap:
            return (f"its {num_tokens} prompt tokens would take the {self.num_waiting_tokens} waiting past the "
                    f"server's limit (--max-waiting-tokens {cap})")
        ticket.num_tokens = num_tokens
        self.num_waiting_tokens += num_tokens
        return None

    def started(self, ticket: Ticket) -> None:
        """The request got its first token (or ended): it waits no more."""
        if ticket.waiting:
            ticket.waiting = False
            self.num_waiting -= 1
            self.num_waiting_tokens -= ticket.num_tokens
            self.recent_starts.append(time.monotonic())

    def leave(self, ticket: Ticket) -> None:
        if ticket in self.tickets:
            self.started(ticket)
            self.tickets.discard(ticket)

    def seconds_left(self, ticket: Ticket) -> float | None:
        """How long the request may still wait for its first token (None: as long as it takes)."""
        if not self.limits.max_queue_seconds:
            return None
        return max(0.0, ticket.arrival + self.limits.max_queue_seconds - time.monotonic())

    def retry_after(self) -> int:
        """Whole seconds until a queued request is likely to leave the queue: the mean gap between recent
        first tokens (1 s before there is any)."""
        if len(self.recent_starts) < 2:
            return 1
        gap = (self.recent_starts[-1] - self.recent_starts[0]) / (len(self.recent_starts) - 1)
        return min(RETRY_AFTER_MAX_S, max(1, math.ceil(gap)))

    def readiness(self, num_ready_cores: int) -> tuple[bool, dict]:
        """Whether a load balancer should send more requests here, and why."""
        why = [reason for reason in (
            self.draining and "the server is draining (shutting down)",
            not num_ready_cores and "no engine core is ready",
            self.full() and f"the queue is full: {self.full()}") if reason]
        return not why, {"ready": not why, "why": why, "num_waiting_requests": self.num_waiting,
                         "num_waiting_tokens": self.num_waiting_tokens, "num_requests": len(self.tickets),
                         "num_ready_engines": num_ready_cores}


class AdmissionGate:
    """ASGI middleware: a generation request gets a ``Ticket`` (in ``scope["state"]["admission"]``) for as long
    as its response lasts, or a 429 / 503 before its body is read."""

    def __init__(self, app, admission: AdmissionControl):
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_ROUTES:
            return await self.app(scope, receive, send)
        if self.admission.draining:
            return await refuse(send, engine_gone(SHUTTING_DOWN))
        if why := self.admission.full():
            return await refuse(send, overloaded(why, self.admission.retry_after()))
        ticket = self.admission.enter()
        scope.setdefault("state", {})["admission"] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.leave(ticket)


async def refuse(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), **(error.headers or {})}
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})
    await send({"type": "http.response.body", "body": body})


class Shutdown:
    """SIGTERM drains: new requests get 503 and /ready says so, in-flight ones may finish within
    ``timeout_s``; then (or on SIGINT, a second signal, or the engine cores' end) what is left ends at once."""

    def __init__(self, server, http, timeout_s: float):
        """``server``: the OpenAIServer; ``http``: the uvicorn.Server."""
        self.server, self.http, self.timeout_s = server, http, timeout_s
        self.drain: asyncio.Task | None = None

    def on_signal(self, sig: int) -> None:
        if sig == signal.SIGTERM and self.timeout_s > 0 and self.drain is None:
            self.drain = asyncio.ensure_future(self.drain_then_stop())
        else:
            self.now()

    async def drain_then_stop(self) -> None:
        admission = self.server.admission
        admission.draining = True
        logger.info("draining: %d requests in flight, given up to %g s (--shutdown-timeout)", len(admission.tickets),
                    self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        while admission.tickets and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if admission.tickets:
            logger.warning("drained for %g s; ending the %d requests left", self.timeout_s, len(admission.tickets))
        self.now()

    def now(self) -> None:
        self.server.admission.draining = True
        self.server.stop()
        self.http.should_exit = True
