"""The same log line at most once a window, for long-running processes: a fault that repeats
every sample or request (a dcgm-exporter that is down, a client that keeps failing) writes one
line a window saying how many like it were left out, never thousands."""

from __future__ import annotations

import collections
import logging
import threading
import time


class FloodFilter(logging.Filter):
    """Let the same message (logger, format or text, exception type) through at most once a
    window; the next one that passes says how many were left out."""

    window_s = 10.0

    def __init__(self, name: str = "", window_s: float | None = None, by_message: bool = False) -> None:
        """`by_message`: "the same" is the same text, arguments filled in (a daemon's lines name
        their job or URL there: two jobs' lines are two lines); else the same format."""
        super().__init__(name)
        if window_s is not None:
            self.window_s = window_s
        self.by_message = by_message
        self._last: dict[tuple[str, object, str], float] = {}
        self._dropped: collections.Counter[tuple[str, object, str]] = collections.Counter()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key = (record.name, record.getMessage() if self.by_message else record.msg, exc)
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e18) < self.window_s:
                self._dropped[key] += 1
                return False
            if len(self._last) > 10_000:  # messages with the varying part in the format itself
                self._last.clear()
            self._last[key] = now
            dropped = self._dropped.pop(key, 0)
        if dropped:
            note = f" [{dropped} more like this in the last {self.window_s:g} s not logged]"
            if self.by_message:
                record.msg, record.args = record.getMessage() + note, None
            else:
                record.msg = f"{record.msg}{note}"
        return True


def install(window_s: float, handlers: list[logging.Handler]) -> FloodFilter:
    """`handlers` (the ones the process set up for itself: never a host's, such as a test
    runner's capture) behind one FloodFilter of `window_s`."""
    flood = FloodFilter(window_s=window_s, by_message=True)
    for handler in handlers:
        handler.addFilter(flood)
    return flood
