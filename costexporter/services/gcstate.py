"""Garbage collection for a service that holds a large state for its whole life.

A watcher of 1,000 jobs holds a few hundred MB of Python objects (views, folds, readers) that
live as long as the process. CPython's full collection walks every one of them whenever a
quarter as many new objects have survived since the last one: measured at 1,000 jobs, ~150 ms
every few polls, 10-15% of the watcher's time, to free nothing. `gc.freeze()` after the first
round moves what is alive then into a permanent generation that collections no longer walk.
Every `refresh_rounds` rounds the state is unfrozen, collected and frozen again, so reference
cycles that died among the frozen objects are still reclaimed (objects freed by reference
counting never wait for it).

Freezing is process-wide: the process's owner (the `watch` command) opts in, not the library.

A peak (an agent catching up on a long backlog, a watcher's first poll) leaves memory that
glibc keeps for reuse rather than returning it: the process's RSS stays at the peak. After a
round whose RSS grew by `trim_growth_bytes` and a quarter since the last return, `malloc_trim`
hands the allocator's free pages back (a no-op off glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Callable

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set (Linux), None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc: nothing to return
        return None


class FrozenState:
    """Call `after_round()` after each round of the service's loop."""

    def __init__(
        self, refresh_rounds: int = 720, trim_growth_bytes: int = 16 << 20
    ) -> None:  # 720 polls: an hour at 5 s
        if refresh_rounds < 1:
            raise ValueError("refresh_rounds must be >= 1")
        self.refresh_rounds = refresh_rounds
        self.rounds = 0
        self.trim_growth_bytes = trim_growth_bytes
        self.rss_after_trim: int | None = None  # None: not trimmed yet
        self.trims = 0
        self._trim = _malloc_trim()

    def after_round(self) -> None:
        self.rounds += 1
        if self.rounds == 1 or self.rounds % self.refresh_rounds == 0:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        self._return_peak()

    def _return_peak(self) -> None:
        """Hand free heap pages back after the RSS grew (a peak's leftovers), not every round:
        the trim walks the heap (a few ms at a few hundred MB)."""
        if self._trim is None:
            return
        rss = rss_bytes()
        if rss is None:
            return
        base = self.rss_after_trim
        # A quarter above the last trim's RSS, too: a round's own transient arrays (a few MB to
        # tens of MB at a large state) come back each round, and returning them every round
        # would only make the next round fault its pages in again.
        if base is None or rss - base >= max(self.trim_growth_bytes, base // 4):
            self._trim(0)
            self.trims += 1
            self.rss_after_trim = rss_bytes()
