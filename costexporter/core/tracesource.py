"""Where replay reads a trace's samples from: memory (`MemoryTrace`, a `Samples`), or a directory
the trace was spilled to as it was read (`SpilledTrace`, written by `tracestore.SpillStore`).

Replay asks a trace for what it knows of each GPU (how many samples, the first and the last),
and a job's samples in time windows (`JobSamples.between`, `JobSamples.take`): a spilled trace
reads only a window's rows from disk, so replay's memory follows the window, not the trace.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from costexporter.core import bands as bands_mod
from costexporter.core import idle, profiles
from costexporter.core.booking import NEG_INF
from costexporter.core.model import GpuId, Samples

# A job's window of columns: its GPU (0..n-1 in member order), ts_ms, power_w, util_pct, energy_mj.
Cols = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

# What the sampling interval and phase are taken from: the first samples in (GPU, time) order.
PREFIX_ROWS = 200_001


@dataclass(slots=True)
class PowerLevels:
    """What a job's profile is derived and checked from (`replay.job_profile`): each GPU's idle
    level (`idle.trace_levels`), the readings at or above `profiles.TRACE_BUSY_UTIL_PCT` (read
    only where a profile is derived from the trace), the highest reading, and every reading
    (read only where the highest is past a model's limit)."""

    idle_w: list[float | None]
    busy_w: Callable[[], np.ndarray]
    max_w: float
    all_w: Callable[[], np.ndarray]

    @classmethod
    def of(
        cls, gpu: np.ndarray, power_w: np.ndarray, util_pct: np.ndarray, limits: list[float | None]
    ) -> PowerLevels:
        return cls(
            idle.trace_levels(gpu, power_w, util_pct, limits),
            lambda: profiles.busy_readings(power_w, util_pct),
            float(np.nanmax(power_w, initial=0.0)),
            lambda: power_w,
        )


class JobSamples(ABC):
    """A job's samples, its member GPUs numbered 0..n-1, grouped by GPU in time order; a row is a
    position in that order."""

    size: int
    ts_range: tuple[int, int] | None  # its first and last sample
    trace_rows: np.ndarray | None  # each row's position in the trace (None: the trace's own order)

    @abstractmethod
    def between(self, lo_ms: int, hi_ms: int) -> np.ndarray:
        """Per GPU, its rows in [lo_ms, hi_ms], the last one before lo_ms (its slice reaches into
        the window) and the first one after hi_ms (its slice, or its gap, ends there): in order."""

    @abstractmethod
    def take(self, rows: np.ndarray) -> Cols:
        """The columns of `rows` (in order, as `between` gives them)."""

    @abstractmethod
    def ts_prefix(self) -> np.ndarray:
        """The first PREFIX_ROWS stamps in row order (the sampling phase is taken from them)."""

    @abstractmethod
    def levels(self, limits: list[float | None]) -> PowerLevels:
        """What the job's profile is derived from; `limits` per member GPU."""


def _ranges(
    ts_of: Callable[[int], np.ndarray], n: int, offsets: np.ndarray, lo_ms: int, hi_ms: int
) -> np.ndarray:
    """`JobSamples.between` for GPUs whose stamps `ts_of(g)` gives, GPU g's rows numbered from
    `offsets[g]`: in row order, so that a window of every row is the rows as they are."""
    parts = []
    for g in np.argsort(offsets[:n], kind="stable").tolist():  # in row order
        seg = ts_of(g)
        if seg.size == 0:
            continue
        lo = max(int(np.searchsorted(seg, lo_ms, "left")) - 1, 0)
        hi = min(int(np.searchsorted(seg, hi_ms, "right")) + 1, seg.size)
        parts.append(np.arange(offsets[g] + lo, offsets[g] + hi))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def every_row(rows: np.ndarray, n: int) -> bool:
    """Whether `rows` are 0..n-1 in order."""
    return rows.size == n and (n == 0 or (rows[0] == 0 and bool((rows[1:] == rows[:-1] + 1).all())))


class MemoryJob(JobSamples):
    """A job's samples in memory, grouped by GPU in the trace's order of its GPUs."""

    def __init__(self, trace_rows: np.ndarray | None, cols: Cols, n_gpus: int) -> None:
        self.trace_rows, self.cols = trace_rows, cols
        lg, ts = cols[0], cols[1]
        self.size = int(ts.size)
        self.ts_range = (int(ts.min()), int(ts.max())) if ts.size else None
        # Each GPU's rows are one run: where it starts and ends.
        heads = np.flatnonzero(np.append(True, lg[1:] != lg[:-1])) if lg.size else np.zeros(0, np.int64)
        self.starts = np.zeros(n_gpus, np.int64)
        self.ends = np.zeros(n_gpus, np.int64)
        self.starts[lg[heads]] = heads
        self.ends[lg[heads]] = np.append(heads[1:], lg.size)
        self.n = n_gpus

    def between(self, lo_ms: int, hi_ms: int) -> np.ndarray:
        ts, a, b = self.cols[1], self.starts, self.ends
        return _ranges(lambda g: ts[a[g] : b[g]], self.n, a, lo_ms, hi_ms)

    def take(self, rows: np.ndarray) -> Cols:
        if every_row(rows, self.size):  # the whole job in one window: no copy
            return self.cols
        lg, ts, pw, ut, en = self.cols
        return lg[rows], ts[rows], pw[rows], ut[rows], en[rows]

    def ts_prefix(self) -> np.ndarray:
        return self.cols[1][:PREFIX_ROWS]

    def levels(self, limits: list[float | None]) -> PowerLevels:
        lg, _, pw, ut, _ = self.cols
        return PowerLevels.of(lg, pw, ut, limits)


class Trace(ABC):
    """A trace's GPUs and, per GPU, how many samples it has, its first and its last stamp."""

    gpus: list[GpuId]
    counts: np.ndarray  # int64 per GPU
    first_ms: np.ndarray  # int64 per GPU (where it has samples)
    last_ms: np.ndarray
    interval_ms: int  # the typical sampling interval (`bands.sampling_interval_ms` of the prefix)

    def __len__(self) -> int:
        return int(self.counts.sum())

    def extend(self, n_gpus: int) -> None:
        """GPUs registered but absent from the trace, appended (no samples)."""
        k = n_gpus - self.counts.size
        if k > 0:
            z = np.zeros(k, np.int64)
            self.counts, self.first_ms, self.last_ms = (
                np.append(a, z) for a in (self.counts, self.first_ms, self.last_ms)
            )

    @property
    def first_sample_ms(self) -> int:
        has = self.counts > 0
        return int(self.first_ms[has].min()) if has.any() else 0

    def last_end_ms(self) -> np.ndarray:
        """Per GPU, where its last sample's slice ends (NEG_INF: no sample)."""
        return np.where(self.counts > 0, self.last_ms + self.interval_ms, NEG_INF).astype(np.int64)

    @abstractmethod
    def job(self, member_gpus: np.ndarray) -> JobSamples:
        """The samples of `member_gpus` (trace GPU numbers, in member order)."""

    @abstractmethod
    def of_gpus(self, gpus: np.ndarray) -> Samples:
        """The samples of `gpus` (GPU numbers kept; others' may come too: a trace in memory gives
        them all): the few GPUs no job holds all of."""


class MemoryTrace(Trace):
    def __init__(self, samples: Samples) -> None:
        self.samples = samples
        self.gpus = list(samples.gpus)
        n_g = len(self.gpus)
        # Samples are sorted by GPU: each GPU's run is found by binary search.
        bounds = np.searchsorted(samples.gpu, np.arange(n_g + 1), "left")
        starts, self.counts = bounds[:-1], np.diff(bounds)
        has = self.counts > 0
        self.first_ms = np.zeros(n_g, np.int64)
        self.last_ms = np.zeros(n_g, np.int64)
        if len(samples):
            self.first_ms[has] = samples.ts_ms[starts[has]]
            self.last_ms[has] = samples.ts_ms[(starts + self.counts - 1)[has]]
        self.interval_ms = bands_mod.sampling_interval_ms(samples.gpu, samples.ts_ms)

    def job(self, member_gpus: np.ndarray) -> JobSamples:
        s = self.samples
        n_g = max(len(s.gpus), int(member_gpus.max(initial=-1)) + 1)
        local = np.full(n_g, -1, np.int64)
        local[member_gpus] = np.arange(member_gpus.size)
        cols = (s.ts_ms, s.power_w, s.util_pct, s.energy_mj)
        if (local[: len(s.gpus)] >= 0).all():  # the common case: the job holds every GPU
            return MemoryJob(None, (local[s.gpu], *cols), member_gpus.size)
        sel = local[s.gpu] >= 0
        rows = np.flatnonzero(sel)
        return MemoryJob(rows, (local[s.gpu[sel]], *(a[sel] for a in cols)), member_gpus.size)

    def of_gpus(self, gpus: np.ndarray) -> Samples:
        return self.samples


class SpilledTrace(Trace):
    """A trace on disk, a file per GPU and column (`tracestore`): read window by window."""

    def __init__(self, directory: Path) -> None:
        from costexporter.core import tracestore

        self.dir = directory
        index = tracestore.read_index(directory)
        self.gpus = index.gpus
        self.counts, self.first_ms, self.last_ms = index.counts, index.first_ms, index.last_ms
        self.interval_ms = bands_mod.sampling_interval_ms(*self.prefix(list(range(len(self.gpus)))))

    def prefix(self, gpus: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The first PREFIX_ROWS samples of `gpus`, GPU after GPU: (position in `gpus`, stamp)."""
        at, ts, left = [], [], PREFIX_ROWS
        for k, g in enumerate(gpus):
            if left <= 0:
                break
            t = self.column(g, "ts_ms", 0, min(left, int(self.counts[g])) if g < self.counts.size else 0)
            ts.append(t)
            at.append(np.full(t.size, k, np.int32))
            left -= t.size
        if not ts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        return np.concatenate(at), np.concatenate(ts)

    def column(self, g: int, name: str, start: int = 0, count: int = -1) -> np.ndarray:
        """`count` values (-1: all) of GPU `g`'s column from row `start`, read from disk."""
        from costexporter.core import tracestore

        if g >= self.counts.size or self.counts[g] == 0 or count == 0:
            return np.zeros(0, tracestore.DTYPES[name])
        return tracestore.read_column(self.dir, g, name, start, count)

    def job(self, member_gpus: np.ndarray) -> JobSamples:
        return SpilledJob(self, member_gpus)

    def of_gpus(self, gpus: np.ndarray) -> Samples:
        parts = [(int(g), [self.column(int(g), c) for c in _COLS]) for g in gpus if self.counts[g]]
        if not parts:
            return Samples(self.gpus, *(np.zeros(0, d) for d in (np.int32, np.int64, float, float, float)))
        return Samples(
            self.gpus,
            np.concatenate([np.full(c[0].size, g, np.int32) for g, c in parts]),
            *(np.concatenate([c[i] for _, c in parts]) for i in range(len(_COLS))),
        )


_COLS = ("ts_ms", "power_w", "util_pct", "energy_mj")
# A spilled job keeps every this-many-th stamp of each GPU in memory: a window's rows are found
# by reading only the blocks of stamps around its ends.
STRIDE = 4096


class SpilledJob(JobSamples):
    """A job's samples on disk, its rows numbered GPU after GPU in member order."""

    def __init__(self, trace: SpilledTrace, member_gpus: np.ndarray) -> None:
        self.trace, self.gpus = trace, [int(g) for g in member_gpus]
        self.counts = np.asarray(
            [trace.counts[g] if g < trace.counts.size else 0 for g in self.gpus], np.int64
        )
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.size = int(self.offsets[-1])
        self.trace_rows = None
        has = self.counts > 0
        idx = np.asarray(self.gpus, np.int64)[has]
        self.ts_range = (int(trace.first_ms[idx].min()), int(trace.last_ms[idx].max())) if has.any() else None
        self.sparse = [
            trace.column(g, "ts_ms")[::STRIDE] if n else np.zeros(0, np.int64)
            for g, n in zip(self.gpus, self.counts.tolist(), strict=True)
        ]

    def between(self, lo_ms: int, hi_ms: int) -> np.ndarray:
        parts = []
        for k, g in enumerate(self.gpus):
            n = int(self.counts[k])
            if n == 0:
                continue
            sp = self.sparse[k]
            # The rows that can hold the bounds: from the block before lo_ms's to hi_ms's.
            a = max(int(np.searchsorted(sp, lo_ms, "left")) - 1, 0) * STRIDE
            b = min(int(np.searchsorted(sp, hi_ms, "right")) * STRIDE + 1, n)
            seg = self.trace.column(g, "ts_ms", a, b - a)
            lo = max(a + int(np.searchsorted(seg, lo_ms, "left")) - 1, 0)
            hi = min(a + int(np.searchsorted(seg, hi_ms, "right")) + 1, n)
            parts.append(np.arange(self.offsets[k] + lo, self.offsets[k] + hi))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def take(self, rows: np.ndarray) -> Cols:
        """Rows come in runs, one per GPU (`between`): each run is read from its GPU's files."""
        if not rows.size:
            return (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0))
        g_of = np.searchsorted(self.offsets, rows, "right") - 1
        heads = np.flatnonzero(np.append(True, (g_of[1:] != g_of[:-1]) | (rows[1:] != rows[:-1] + 1)))
        ends = np.append(heads[1:], rows.size)
        out: list[list[np.ndarray]] = [[] for _ in range(5)]
        for h, e in zip(heads.tolist(), ends.tolist(), strict=True):
            k = int(g_of[h])
            a = int(rows[h] - self.offsets[k])
            out[0].append(np.full(e - h, k, np.int64))
            for i, c in enumerate(_COLS):
                out[i + 1].append(self.trace.column(self.gpus[k], c, a, e - h))
        lg, ts, pw, ut, en = (np.concatenate(x) for x in out)
        return lg, ts, pw, ut, en

    def ts_prefix(self) -> np.ndarray:
        return self.trace.prefix(self.gpus)[1]

    def levels(self, limits: list[float | None]) -> PowerLevels:
        """GPU by GPU: one GPU's readings in memory at a time, and the busy ones."""
        idle_w: list[float | None] = []
        top = 0.0
        for i, g in enumerate(self.gpus):
            pw, ut = self.trace.column(g, "power_w"), self.trace.column(g, "util_pct")
            idle_w += idle.trace_levels(np.zeros(pw.size, np.int64), pw, ut, [limits[i]])
            top = max(top, float(np.nanmax(pw, initial=0.0)))

        def busy() -> np.ndarray:
            got = [
                profiles.busy_readings(self.trace.column(g, "power_w"), self.trace.column(g, "util_pct"))
                for g in self.gpus
            ]
            return np.concatenate(got) if got else np.zeros(0)

        def every() -> np.ndarray:
            return np.concatenate([self.trace.column(g, "power_w") for g in self.gpus] or [np.zeros(0)])

        return PowerLevels(idle_w, busy, top, every)
