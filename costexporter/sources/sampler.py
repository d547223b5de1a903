"""Sampling on a background thread, off the scrape path: the agent drains, /metrics peeks."""

from __future__ import annotations

import collections
import logging
import threading
import time

from .base import GpuSource, Reading

log = logging.getLogger("costexporter.sources.sampler")


class Sampler:
    """Reads `source` every `interval_s` into a bounded buffer.

    `drain()` hands the booker everything read since the last drain; `latest()` is each GPU's
    newest reading, for the live view. When the buffer is full the oldest readings go first and
    are counted in `dropped` (their time will book `unobserved`, never silently vanish).
    """

    def __init__(self, source: GpuSource, interval_s: float = 1.0, capacity: int = 1_000_000) -> None:
        self.source = source
        self.interval_s = interval_s
        self._buf: collections.deque[Reading] = collections.deque()
        self.capacity = capacity
        self.dropped = 0
        self.reads = 0
        self._latest: dict[int, Reading] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="costexporter-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                readings = self.source.read()
            except Exception:  # a source bug must not kill sampling: log, count, go on
                log.exception("sampling failed")
                self.source.errors[(-1, "read_failed")] += 1
                readings = []
            self.reads += 1
            for r in readings:
                self._latest[r.gpu] = r
            overflow = len(self._buf) + len(readings) - self.capacity
            for _ in range(max(overflow, 0)):
                self._buf.popleft()
                self.dropped += 1
            self._buf.extend(readings)
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (a slow read): skip the missed ticks, do not burst
                next_t = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    def drain(self) -> list[Reading]:
        out = []
        buf = self._buf
        for _ in range(len(buf)):
            out.append(buf.popleft())
        return out

    def latest(self) -> dict[int, Reading]:
        return dict(self._latest)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
