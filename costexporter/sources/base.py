"""One small interface for every live GPU source (NVML, dcgm-exporter, replay, simulation).

A source knows its node's GPUs and reads them all at once. Errors of one GPU (lost, a field
not supported, no permission) are mapped by each vendor module, in one place, to the
exceptions below; the source counts them per GPU and keeps reading the others.
"""

from __future__ import annotations

import abc
import collections
import math
from dataclasses import dataclass

from costexporter.core.causes import HardwareEvent
from costexporter.core.model import GpuId


class GpuSourceError(Exception):
    """Base of the errors a GPU source raises."""


class GpuInitError(GpuSourceError):
    """The library is missing or would not initialize: this source cannot run here."""


class GpuLostError(GpuSourceError):
    """The GPU fell off the bus (NVML's GPU_IS_LOST): its time books `unobserved`."""


class GpuNotSupportedError(GpuSourceError):
    """This GPU does not support a query (e.g. the energy counter before Volta)."""


class GpuNoPermissionError(GpuSourceError):
    """The process may not make this query."""


@dataclass(frozen=True, slots=True)
class Reading:
    """One sample of one GPU at one time: board power in W, utilization in %, and the energy
    counter in mJ where the source has one."""

    gpu: int  # index into the source's gpus()
    ts: float  # Unix seconds
    power_w: float
    util_pct: float
    energy_mj: float = math.nan
    sm_active: float = math.nan  # 0..1 where the source has it (DCGM profiling)


class GpuSource(abc.ABC):
    """The node's GPUs, read all at once."""

    host: str
    # The energy counter costs real CPU to read (NVML: ~3.9 ms a call on an H200). Where True,
    # the source also offers `read(energy=False)`, `read_energy()` and `energy_gpus()`, and the
    # sampler reads the counter only at anchors, sharing it out between them by power.
    costly_energy: bool = False
    # Samples are stamped with this host's wall clock, so event timestamps can be compared with
    # their arrival (clock skew); a replay or a simulation plays its own time.
    wall_clock: bool = False

    def __init__(self) -> None:
        # (gpu index, error kind) -> count; exported as a metric by the agent.
        self.errors: collections.Counter[tuple[int, str]] = collections.Counter()

    @property
    def event_lag_s(self) -> float:
        """How far behind the newest sample the trainers' events may still be on their way, in
        the samples' own time; the agent books no closer to its newest sample than this. Zero for
        a real node: a reporter flushes every 50 ms, well inside one sampling interval."""
        return 0.0

    @abc.abstractmethod
    def gpus(self) -> list[GpuId]:
        """The GPUs this source reads, in a fixed order (`Reading.gpu` indexes it)."""

    @abc.abstractmethod
    def read(self) -> list[Reading]:
        """One reading per GPU that answered; failures are counted in `errors`, not raised."""

    def read_energy(self) -> dict[int, tuple[float, float]]:
        """Costly-counter sources: each GPU's counter, index -> (Unix seconds, mJ)."""
        return {}

    def energy_gpus(self) -> set[int]:
        """Costly-counter sources: the GPUs that have the counter."""
        return set()

    def hardware_events(self) -> list[HardwareEvent]:
        """The GPUs' hardware events since the last call (Xids, hardware clock slowdowns): what
        a wasted stretch's cause is read from (`core/causes.py`). None where the source has none."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the library."""
