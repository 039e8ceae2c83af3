"""When the front starts a local engine core again after it died.

A core that dies (killed, out of memory, a failed step) fails its requests at once, as before; then it is
started again after a back-off that doubles with each death in the window (1 s, 2 s, 4 s, ... at most
30 s), so a core that dies while loading does not spin. More than ``max_restarts`` deaths within
``RESTART_WINDOW_S`` mean something is wrong that a restart does not fix: the front then gives up and exits
non-zero, so that its orchestrator (systemd, Kubernetes) restarts the whole server, or tells a person.
A remote (``--headless``) core cannot be started from here: it is dropped, and may join again.
"""

import time
from collections import deque

RESTART_WINDOW_S = 600.0
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class RestartPolicy:
    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.deaths: deque[float] = deque()

    def after_death(self, now: float | None = None) -> float | None:
        """Seconds to wait before starting a core that just died, or None: give up."""
        now = time.monotonic() if now is None else now
        self.deaths.append(now)
        while now - self.deaths[0] > RESTART_WINDOW_S:
            self.deaths.popleft()
        if len(self.deaths) > self.max_restarts:
            return None
        return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (len(self.deaths) - 1))

    def describe(self) -> str:
        return (f"local engine cores died {len(self.deaths)} times within {RESTART_WINDOW_S:.0f} s "
                f"(--max-core-restarts {self.max_restarts})")
