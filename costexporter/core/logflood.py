"""The same log line at most once a window, for long-running processes: a fault that repeats
every sample or request (a dcgm-exporter that is down, a client that keeps failing) writes one
line a window saying how many like it were left out, never thousands."""

from __future__ import annotations

import collections
import logging
import threading
import time


class FloodFilter(logging.Filter):
    """Let the same message (logger, format, exception type) through at most once a window;
    the next one that passes says how many were left out."""

    window_s = 10.0

    def __init__(self, name: str = "", window_s: float | None = None) -> None:
        super().__init__(name)
        if window_s is not None:
            self.window_s = window_s
        self._last: dict[tuple[str, object, str], float] = {}
        self._dropped: collections.Counter[tuple[str, object, str]] = collections.Counter()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key = (record.name, record.msg, exc)
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
            record.msg = f"{record.msg} [{dropped} more like this in the last {self.window_s:g} s not logged]"
        return True


def install(window_s: float) -> FloodFilter:
    """Every handler of the root logger behind one FloodFilter of `window_s` (after
    logging.basicConfig): the agent's, the watcher's and the demo's logs."""
    flood = FloodFilter(window_s=window_s)
    for handler in logging.getLogger().handlers:
        handler.addFilter(flood)
    return flood
