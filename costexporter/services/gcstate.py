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
"""

from __future__ import annotations

import gc


class FrozenState:
    """Call `after_round()` after each round of the service's loop."""

    def __init__(self, refresh_rounds: int = 720) -> None:  # 720 polls: an hour at 5 s
        if refresh_rounds < 1:
            raise ValueError("refresh_rounds must be >= 1")
        self.refresh_rounds = refresh_rounds
        self.rounds = 0

    def after_round(self) -> None:
        self.rounds += 1
        if self.rounds == 1 or self.rounds % self.refresh_rounds == 0:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
