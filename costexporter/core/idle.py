"""Each GPU's idle power, learned from its own samples at 0% utilization (pure: no Redis).

A derived profile (no calibration for the model) used to put its idle edge at a fixed fraction
of the power limit. That misses what a GPU holding a CUDA context draws: on an H200 idle is
79.6 W without a context and 123.7 W with one, above the derived 112 W edge (measured with
NVML on an H200 under a PyTorch job).
The agent therefore learns each GPU's idle level from its own readings at 0% utilization and
derives the low band edges of a derived profile from it (`profiles.with_idle`).

Guards against learning from junk: only readings at 0% with a finite power count; the level is
the median of the newest `WINDOW` of them (a power tail after compute ends, or a few noisy
readings, do not move a median); no level before `MIN_SAMPLES` readings; and a level outside
[`MIN_FRACTION`, `MAX_FRACTION`] of the power limit (or `ABS_MIN_W`..`ABS_MAX_W` without one)
is discarded, never used.
"""

from __future__ import annotations

import math

import numpy as np

WINDOW = 600  # newest 0%-utilization readings kept per GPU (10 min at 1 Hz)
MIN_SAMPLES = 30  # readings at 0% before a level is used
ZERO_UTIL_PCT = 0.5  # "at 0%": NVML reports whole percents
MIN_FRACTION = 0.03  # a learned idle below 3% of the limit is a bad reading, not idle
# ... and above 40% it is not idle (a GPU busy at 0% reported utilization). An old board holding a
# CUDA context idles high: a 250 W TITAN X (Pascal) at 87-95 W, 35-38% of its limit.
MAX_FRACTION = 0.40
ABS_MIN_W, ABS_MAX_W = 5.0, 400.0  # the same bounds where the limit is unknown


def plausible(level_w: float, power_limit_w: float | None) -> bool:
    """Whether a learned idle level may be used for a GPU of this power limit."""
    if not math.isfinite(level_w):
        return False
    if power_limit_w:
        return MIN_FRACTION * power_limit_w <= level_w <= MAX_FRACTION * power_limit_w
    return ABS_MIN_W <= level_w <= ABS_MAX_W


class IdleLearner:
    """Per GPU key (its UUID): a ring of its newest readings at 0% utilization and the median."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self.window, self.min_samples = window, min_samples
        self._ring: dict[str, np.ndarray] = {}
        self._count: dict[str, int] = {}  # readings seen (not capped)
        self._seed: dict[str, tuple[float, int]] = {}  # stored level and its count, from Redis

    def add(self, key: str, power_w: np.ndarray, util_pct: np.ndarray) -> None:
        """Feed one GPU's new readings (any utilization; only those at 0% are kept)."""
        with np.errstate(invalid="ignore"):
            keep = (util_pct <= ZERO_UTIL_PCT) & (util_pct >= 0) & np.isfinite(power_w) & (power_w >= 0)
        p = np.asarray(power_w, np.float64)[keep][-self.window :]
        if p.size == 0:
            return
        ring = self._ring.get(key)
        ring = p if ring is None else np.concatenate([ring, p])[-self.window :]
        self._ring[key] = ring
        self._count[key] = self._count.get(key, 0) + int(p.size)

    def seed(self, key: str, level_w: float, n: int) -> None:
        """A level learned before (stored in Redis): used until this process has its own."""
        if math.isfinite(level_w) and n >= self.min_samples:
            self._seed[key] = (float(level_w), int(n))

    def level(self, key: str, power_limit_w: float | None = None) -> float | None:
        """The GPU's idle power (W), or None while too few readings say it (or it is implausible)."""
        ring = self._ring.get(key)
        if ring is not None and ring.size >= self.min_samples:
            lv = float(np.median(ring))
        elif key in self._seed:
            lv = self._seed[key][0]
        else:
            return None
        return lv if plausible(lv, power_limit_w) else None

    def count(self, key: str) -> int:
        """Readings at 0% the level stands on (this process's, else the stored level's)."""
        n = self._count.get(key, 0)
        return n if n >= self.min_samples else max(n, self._seed.get(key, (0.0, 0))[1])


def trace_levels(
    gpu: np.ndarray, power_w: np.ndarray, util_pct: np.ndarray, limits: list[float | None]
) -> list[float | None]:
    """Each GPU's idle level over a whole recorded trace, by the agent's rule (median of its
    readings at 0%, at least MIN_SAMPLES of them, plausible for its limit); `gpu` numbers the
    readings 0..len(limits)-1."""
    n = len(limits)
    with np.errstate(invalid="ignore"):
        keep = (util_pct <= ZERO_UTIL_PCT) & (util_pct >= 0) & np.isfinite(power_w) & (power_w >= 0)
    g, p = gpu[keep], power_w[keep]
    order = np.argsort(g, kind="stable")
    g, p = g[order], p[order]
    bounds = np.searchsorted(g, np.arange(n + 1))
    out: list[float | None] = []
    for i in range(n):
        part = p[bounds[i] : bounds[i + 1]]
        lv = float(np.median(part)) if part.size >= MIN_SAMPLES else None
        out.append(lv if lv is not None and plausible(lv, limits[i]) else None)
    return out
