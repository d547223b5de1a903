"""A recorded trace played as a live source, in real time or `speed` times faster."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from costexporter.core.model import GpuId, Samples
from costexporter.core.replay import recorded_gpus
from costexporter.sources.base import GpuSource, Reading


class ReplaySource(GpuSource):
    """Each read returns the trace's samples whose time has come since the previous read.

    Readings keep the trace's own timestamps, so the booking matches an offline replay.
    `clock` (seconds, monotonic) is injectable so tests need not wait.
    """

    def __init__(
        self,
        samples: Samples,
        speed: float = 1.0,
        host: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if speed <= 0:
            raise ValueError("speed must be > 0")
        order = np.argsort(samples.ts_ms, kind="stable")  # play in time order across GPUs
        self._ts = samples.ts_ms[order]
        self._gpu = samples.gpu[order]
        self._p = samples.power_w[order]
        self._u = samples.util_pct[order]
        self._e = samples.energy_mj[order]
        # Each GPU's idle level (and, for a trace naming no model or limit, the limit its levels
        # give) as offline replay learns them, so the agent bands the trace as replay does.
        self._gpus = recorded_gpus(samples)
        self.host = host or (self._gpus[0].host if self._gpus else "replay")
        self.speed = speed
        self._clock = clock
        self._t0 = clock()
        self._trace_t0 = int(self._ts[0]) if self._ts.size else 0
        self._pos = 0

    def gpus(self) -> list[GpuId]:
        return list(self._gpus)

    @property
    def done(self) -> bool:
        return self._pos >= self._ts.size

    def read(self) -> list[Reading]:
        now_trace = self._trace_t0 + (self._clock() - self._t0) * self.speed * 1000
        end = int(np.searchsorted(self._ts, now_trace, "right"))
        sl = slice(self._pos, end)
        self._pos = end
        return [
            Reading(int(g), t / 1000, float(p), float(u), float(e))
            for g, t, p, u, e in zip(
                self._gpu[sl].tolist(),
                self._ts[sl].tolist(),
                self._p[sl].tolist(),
                self._u[sl].tolist(),
                self._e[sl].tolist(),
                strict=True,
            )
        ]
