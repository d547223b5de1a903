"""The vocabulary (bands, categories, regimes, events, samples), as small integer codes the
vectorized core can index with.

Bands and categories are `IntEnum`s so that numpy arrays of them are plain int8 arrays and
lookup tables (band x regime -> category) are ordinary 2-D arrays.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class Band(IntEnum):
    """What a GPU's power/utilization shape says at a moment (docs/background.md, the power bands)."""

    COMPUTE = 0
    COMMUNICATION = 1
    STARVATION = 2
    CHECKPOINT = 3
    DEADLOCK = 4
    IDLE = 5
    UNKNOWN = 6


class Category(IntEnum):
    """Where a slice of GPU time is booked: valid, overhead, wasted, or outside a job
    (docs/accounting.md)."""

    PRODUCTIVE = 0
    COMMUNICATION = 1
    STARVED = 2
    OVERHEAD = 3
    STALLED = 4
    IDLE = 5
    NO_PROGRESS = 6
    ROLLED_BACK = 7
    UNASSIGNED = 8
    UNOBSERVED = 9


CATEGORIES: tuple[str, ...] = tuple(c.name.lower() for c in Category)

VALID_CATEGORIES = frozenset({Category.PRODUCTIVE, Category.COMMUNICATION, Category.STARVED})
WASTED_CATEGORIES = frozenset({Category.STALLED, Category.IDLE, Category.NO_PROGRESS, Category.ROLLED_BACK})
# Their codes in order, a list: numpy indexes with it (a tuple would index dimensions).
VALID_CODES: list[int] = sorted(int(c) for c in VALID_CATEGORIES)
WASTED_CODES: list[int] = sorted(int(c) for c in WASTED_CATEGORIES)
# Categories that belong to a job's bill (everything but `unassigned`).
JOB_CATEGORIES = tuple(c for c in Category if c is not Category.UNASSIGNED)
JOB_CODES: list[int] = [int(c) for c in JOB_CATEGORIES]
# Their names, in code order: the ledger's fields, the API's and the metrics' `category` label
# (the alert rules' and the dashboard's regexes join them).
VALID_NAMES: list[str] = [CATEGORIES[c] for c in VALID_CODES]
WASTED_NAMES: list[str] = [CATEGORIES[c] for c in WASTED_CODES]
JOB_CATEGORY_NAMES: list[str] = [CATEGORIES[c] for c in JOB_CATEGORIES]

# Band code for slices that have no sample behind them (unobserved gaps).
NO_BAND = -1

MS = 1000  # milliseconds per second: the core keeps time as int64 milliseconds so sums are exact.


@dataclass(frozen=True, slots=True)
class GpuId:
    """One GPU of a trace: identified by host and index, with its UUID where known. A slice of a
    shared GPU (a MIG instance, or a partitioned GPU's unpartitioned rest) names its parent's
    UUID, its GPU instance and profile, and the lanes of the GPU it holds (`core.shares`)."""

    host: str
    index: int
    uuid: str | None = None
    name: str | None = None
    power_limit_w: float | None = None
    parent_uuid: str | None = None
    instance: str | None = None  # dcgm-exporter's GPU_I_ID
    profile: str | None = None  # dcgm-exporter's GPU_I_PROFILE (1g.10gb)
    lanes: tuple[int, int, int] = (0, 1, 1)
    # A recorded trace's own idle level for this GPU (learned over the whole trace; a live source
    # learns it as it reads): what a played-back trace gives the agent so it bands as replay does.
    idle_w: float | None = None
    # `power_limit_w` is a recorded trace's own estimate (`profiles.from_trace`), not a reading:
    # a profile derived from it says `derived_from_trace`.
    limit_from_trace: bool = False


class GpuIndex:
    """Which GPU a registration names: by UUID first, else by host and index. One rule for the
    agent's discovery (its node's GPUs) and replay (a trace's)."""

    def __init__(self, gpus: Iterable[GpuId]) -> None:
        self._by_uuid: dict[str, int] = {}
        self._by_host_index: dict[tuple[str, int], int] = {}
        for i, g in enumerate(gpus):
            self.add(i, g)

    def add(self, i: int, gpu: GpuId) -> None:
        """GPU number `i` is `gpu` (a later one with the same UUID or host and index wins)."""
        if gpu.uuid:
            self._by_uuid[gpu.uuid] = i
        self._by_host_index[(gpu.host, gpu.index)] = i

    def find(self, uuid: str | None, host: str | None, index: int | None) -> int | None:
        g = self._by_uuid.get(uuid) if uuid else None
        if g is None and index is not None and host is not None:
            g = self._by_host_index.get((host, index))
        return g


@dataclass(slots=True)
class Samples:
    """Columnar samples of many GPUs, sorted by (gpu, ts).

    `gpu` indexes into `gpus`; `ts_ms` is Unix time in milliseconds; `energy_mj` is the
    cumulative energy counter (NaN where the source has none).
    """

    gpus: list[GpuId]
    gpu: np.ndarray  # int32
    ts_ms: np.ndarray  # int64
    power_w: np.ndarray  # float64
    util_pct: np.ndarray  # float64
    energy_mj: np.ndarray  # float64
    # Where each sample was read: input file number << 32 | its line in that file (header = 1);
    # None where the samples did not come from files.
    src: np.ndarray | None = None  # int64

    def __len__(self) -> int:
        return int(self.ts_ms.shape[0])

    @classmethod
    def empty(cls) -> Samples:
        return cls(
            gpus=[],
            gpu=np.zeros(0, np.int32),
            ts_ms=np.zeros(0, np.int64),
            power_w=np.zeros(0),
            util_pct=np.zeros(0),
            energy_mj=np.zeros(0),
        )

    def sort(self) -> Samples:
        """Sort by (gpu, ts) and drop exact duplicate timestamps of one GPU (keep the last).

        Traces arrive in time order per file, so a stable sort by GPU (a radix sort for small
        integer keys) is usually enough; a full lexsort runs only when time order is broken.
        """
        key = self.gpu.astype(np.int16) if len(self.gpus) < 2**15 else self.gpu
        order = np.argsort(key, kind="stable")
        gpu, ts = self.gpu[order], self.ts_ms[order]
        if gpu.size > 1 and ((ts[1:] < ts[:-1]) & (gpu[1:] == gpu[:-1])).any():
            order = np.lexsort((self.ts_ms, self.gpu))
            gpu, ts = self.gpu[order], self.ts_ms[order]
        keep = np.ones(len(order), bool)
        if len(order) > 1:
            keep[:-1] = (gpu[1:] != gpu[:-1]) | (ts[1:] != ts[:-1])
        order = order[keep]
        return Samples(
            gpus=self.gpus,
            gpu=self.gpu[order],
            ts_ms=self.ts_ms[order],
            power_w=self.power_w[order],
            util_pct=self.util_pct[order],
            energy_mj=self.energy_mj[order],
            src=None if self.src is None else self.src[order],
        )


@dataclass(slots=True)
class Event:
    """One trainer event of protocol v1 (docs/protocol.md), already validated. Its time is
    integer Unix milliseconds, rounded once where it was parsed (`timeutil.to_ms`)."""

    type: str
    job: str
    ts_ms: int
    rank: int
    session: str = ""
    seq: int = -1
    fields: dict[str, object] = field(default_factory=dict)

    @property
    def ts(self) -> float:
        """Unix seconds, for what people read (an exported file, the watcher's status)."""
        return self.ts_ms / 1000

    def get(self, key: str, default: object = None) -> object:
        return self.fields.get(key, default)

    # Typed payload accessors: `fields` holds what `events.parse_event` validated, so these only
    # say so to the type checker (and fail loudly on an event built by hand with the wrong type).
    def int_field(self, key: str) -> int:
        """An integer field that must be there (a step's `step`)."""
        v = self.fields.get(key)
        if type(v) is int:
            return v
        return _as_int(self, key, v)

    def opt_int_field(self, key: str) -> int | None:
        """An optional integer field (`tokens`, a phase's or resume's `step`): None when absent."""
        v = self.fields.get(key)
        if v is None or type(v) is int:
            return v
        return _as_int(self, key, v)

    def str_field(self, key: str) -> str:
        """A text field that must be there (a phase's `name`)."""
        v = self.fields.get(key)
        if type(v) is str:
            return v
        raise TypeError(f"{self.type} event field {key!r} must be a string, got {v!r}")

    def opt_str_field(self, key: str) -> str | None:
        """An optional text field (`state`, `gpu_uuid`): None when absent."""
        v = self.fields.get(key)
        if v is None or type(v) is str:
            return v
        raise TypeError(f"{self.type} event field {key!r} must be a string, got {v!r}")


def _as_int(ev: Event, key: str, v: object) -> int:
    """The slow path of the integer accessors: numpy integers pass, anything else is an error."""
    if isinstance(v, int | np.integer) and not isinstance(v, bool):
        return int(v)
    raise TypeError(f"{ev.type} event field {key!r} must be an integer, got {v!r}")
