"""A response cache bounded in bytes, with one computation per key at a time.

Dashboards poll the same series again and again; caching their encoded bodies for a few seconds
turns N pollers into one ledger read. The cache is bounded by the size of the bodies it holds
(least recently used first out), and a key's lock lives only while a request computes it, so
neither grows with the number of distinct requests a caller makes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from fastapi.responses import Response

DEFAULT_MAX_BYTES = 64 * 2**20


class ResponseCache:
    def __init__(self, ttl_s: float = 5.0, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[float, Response, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, list[Any]] = {}  # key -> [lock, users]: only keys being computed

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    @property
    def locks(self) -> int:
        return len(self._inflight)

    def get(self, key: Hashable, compute: Callable[[], Response]) -> Response:
        """The cached response of `key` if fresh; else one caller computes it while the others wait
        (nothing cached yet) or get the previous answer (stale). Errors raised by `compute` are
        not cached."""
        if self.ttl_s <= 0 or self.max_bytes <= 0:
            return compute()
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
                self._items.move_to_end(key)
                return hit[1]
            slot = self._inflight.setdefault(key, [threading.Lock(), 0])
            slot[1] += 1
        try:
            lock: threading.Lock = slot[0]
            if hit is not None:  # stale: one request refreshes it, the others get the previous answer
                if not lock.acquire(blocking=False):
                    return hit[1]
            else:  # nothing yet: one computes, the others wait for it (no stampede)
                lock.acquire()
                with self._lock:
                    again = self._items.get(key)
                if again is not None and time.monotonic() - again[0] < self.ttl_s:
                    lock.release()
                    return again[1]
            try:
                t = time.monotonic()
                response = compute()
                self._put(key, t, response)
                return response
            finally:
                lock.release()
        finally:
            with self._lock:
                slot[1] -= 1
                if slot[1] == 0 and self._inflight.get(key) is slot:
                    del self._inflight[key]

    def _put(self, key: Hashable, t: float, response: Response) -> None:
        size = len(response.body)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[2]
            self._items[key] = (t, response, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, _, s) = self._items.popitem(last=False)
                self._bytes -= s
