"""The front's guards against the operating system's limits: open files, and a log that could flood.

The front raises its soft ``RLIMIT_NOFILE`` to the hard limit and caps uvicorn's connections below it, so
a connection past the cap is answered 503 instead of waiting in the backlog; ``RepeatFilter`` logs an
error that repeats a few times a window, then says how many it left out.
"""

import logging
import os
import resource
import time

FILES_KEPT_FREE = 64  # descriptors left for what is not a connection: ZMQ, pipes, the model's files, logs
REPEATS_LOGGED = 5  # of one message in each window
REPEAT_WINDOW_S = 60.0

logger = logging.getLogger("nanoengine.serve")


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:  # e.g. an unlimited hard limit that the kernel caps lower
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, error)
            return soft
    logger.info("open-file limit: soft %d (was %d), hard %d", hard if soft != hard else soft, soft, hard)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_limit(open_file_limit: int) -> int:
    """How many connections uvicorn may hold at once: the open-file limit less the descriptors open now and a
    reserve (at least 1)."""
    return max(1, open_file_limit - len(os.listdir("/proc/self/fd")) - FILES_KEPT_FREE)


class RepeatFilter(logging.Filter):
    """Lets ``REPEATS_LOGGED`` records of one kind through per ``REPEAT_WINDOW_S``; the first record of a kind
    after a window with records left out says how many there were."""

    def __init__(self):
        super().__init__()
        self.windows: dict[tuple, list] = {}  # kind -> [window start, records let through, records left out]

    @staticmethod
    def kind(record: logging.LogRecord) -> tuple:
        error = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        return record.name, record.levelno, record.pathname, record.lineno, str(record.msg), error

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        window = self.windows.setdefault(self.kind(record), [now, 0, 0])
        if now - window[0] >= REPEAT_WINDOW_S:
            if window[2]:
                record.msg = f"{record.msg} [{window[2]} more like this were not logged in the last " \
                             f"{now - window[0]:.0f} s]"
            window[:] = [now, 0, 0]
        if window[1] >= REPEATS_LOGGED:
            window[2] += 1
            return False
        window[1] += 1
        return True


def filter_repeats(*logger_names: str) -> None:
    """Put one RepeatFilter on the handlers of the root logger and of ``logger_names`` (uvicorn's own)."""
    repeats = RepeatFilter()
    for name in ("", *logger_names):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(repeats)
