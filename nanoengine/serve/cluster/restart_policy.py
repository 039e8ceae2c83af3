"""When the front starts a local engine core again after it died: after a back-off that doubles with each
death in the window (1 s, 2 s, ... at most 30 s), until more than ``max_restarts`` deaths within
``RESTART_WINDOW_S``; then the front gives up and exits non-zero, for its orchestrator to see.
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
