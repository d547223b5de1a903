"""NVIDIA GPUs through NVML (nvidia-ml-py, imported as `pynvml`).

* power for classification: the instant field `NVML_FI_DEV_POWER_INSTANT` through
  `nvmlDeviceGetFieldValues` where supported, else `nvmlDeviceGetPowerUsage` (mW; a 1-s average
  on Ampere and newer). An instant reading of 0 W is taken as unsupported (an H200 reports the
  field supported and returns 0): the average is used instead;
* energy: `nvmlDeviceGetTotalEnergyConsumption` (mJ since driver load, Volta and newer), else
  the agent integrates power. The call is costly (~3.9 ms of CPU on an H200), so the sampler
  reads it through `read_energy()` once per round and `read(energy=False)` between;
* utilization: `nvmlDeviceGetUtilizationRates().gpu` (%);
* the profile: `nvmlDeviceGetName` and `nvmlDeviceGetEnforcedPowerLimit` (mW);
* hardware events (a wasted stretch's cause): Xid critical errors through an event set
  (`nvmlEventSetCreate`, `nvmlDeviceRegisterEvents`, `nvmlEventSetWait_v2` with a 0 ms wait),
  and the hardware bits of `nvmlDeviceGetCurrentClocksEventReasons`.
NVML's errors are mapped to costexporter's in `_mapped`, the one place that knows them.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Iterator
from typing import Any

from costexporter.core import causes
from costexporter.core.causes import HardwareEvent
from costexporter.core.model import GpuId
from costexporter.core.timeutil import to_ms
from costexporter.sources.base import (
    GpuInitError,
    GpuLostError,
    GpuNoPermissionError,
    GpuNotSupportedError,
    GpuSource,
    GpuSourceError,
    Reading,
)


def _pynvml() -> Any:  # nvidia-ml-py ships no types: Any at the boundary
    try:
        import pynvml
    except ImportError as e:
        raise GpuInitError("NVML source needs nvidia-ml-py (import pynvml)") from e
    return pynvml


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    """NVML errors as costexporter's; anything else NVML raises is a GpuSourceError."""
    nv = _pynvml()
    try:
        yield
    except nv.NVMLError_GpuIsLost as e:
        raise GpuLostError(str(e)) from e
    except nv.NVMLError_NotSupported as e:
        raise GpuNotSupportedError(str(e)) from e
    except nv.NVMLError_NoPermission as e:
        raise GpuNoPermissionError(str(e)) from e
    except (nv.NVMLError_LibraryNotFound, nv.NVMLError_DriverNotLoaded, nv.NVMLError_Uninitialized) as e:
        raise GpuInitError(str(e)) from e
    except nv.NVMLError as e:
        raise GpuSourceError(str(e)) from e


def _text(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class NvmlSource(GpuSource):
    """The node's NVIDIA GPUs (all of them, or `indices`)."""

    wall_clock = True

    def __init__(self, host: str | None = None, indices: list[int] | None = None) -> None:
        super().__init__()
        self.nv = _pynvml()
        self.host = host or socket.gethostname()
        try:
            with _mapped():
                self.nv.nvmlInit()
                count = self.nv.nvmlDeviceGetCount()
        except GpuInitError as e:
            raise GpuInitError(
                f"NVML is not available here ({e}): no NVIDIA driver? Use --source dcgm or --source replay"
            ) from e
        self._handles = []
        self._gpus: list[GpuId] = []
        self._instant: list[bool] = []
        self._energy: list[bool] = []
        for i in indices if indices is not None else range(count):
            with _mapped():
                h = self.nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(self.nv.nvmlDeviceGetUUID(h))
                name = _text(self.nv.nvmlDeviceGetName(h))
            limit = None
            with contextlib.suppress(GpuSourceError), _mapped():
                limit = self.nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            self._handles.append(h)
            self._gpus.append(GpuId(self.host, i, uuid, name, limit))
            self._instant.append(self._probe_instant(h))
            self._energy.append(self._probe_energy(h))
        self._index = {i: pos for pos, i in enumerate(indices if indices is not None else range(count))}
        self._events = self._register_xids()
        self._throttled = [0] * len(self._handles)  # the hardware slowdown bits last read

    def _register_xids(self) -> Any:
        """An event set with every GPU that reports Xid critical errors registered, or None
        (no GPU does, or the driver refuses: no Xids then, the stretches' causes stay unknown)."""
        nv = self.nv
        try:
            with _mapped():
                events = nv.nvmlEventSetCreate()
        except GpuSourceError:
            return None
        registered = 0
        for h in self._handles:
            with contextlib.suppress(GpuSourceError), _mapped():
                if nv.nvmlDeviceGetSupportedEventTypes(h) & nv.nvmlEventTypeXidCriticalError:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
                    registered += 1
        if not registered:
            with contextlib.suppress(GpuSourceError), _mapped():
                nv.nvmlEventSetFree(events)
            return None
        return events

    def hardware_events(self) -> list[HardwareEvent]:
        """The Xids NVML queued since the last call (waited for 0 ms), and each GPU's hardware
        clock slowdown where it newly began (`nvmlDeviceGetCurrentClocksEventReasons`)."""
        nv = self.nv
        out: list[HardwareEvent] = []
        now_ms = to_ms(time.time())
        if self._events is not None:
            for _ in range(1000):  # a storm of Xids is read over several calls
                try:
                    with _mapped():
                        data = nv.nvmlEventSetWait_v2(self._events, 0)
                        pos = self._index.get(nv.nvmlDeviceGetIndex(data.device))
                except GpuSourceError:  # NVML_ERROR_TIMEOUT: none left (or the set failed)
                    break
                if pos is not None and data.eventType & nv.nvmlEventTypeXidCriticalError:
                    out.append(HardwareEvent(now_ms, pos, "xid", int(data.eventData)))
        for pos, h in enumerate(self._handles):
            try:
                with _mapped():
                    reasons = int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))
            except GpuSourceError:
                continue
            self._throttled[pos], began = causes.slowdown(now_ms, pos, self._throttled[pos], reasons)
            if began is not None:
                out.append(began)
        return out

    def _probe_instant(self, h: Any) -> bool:
        try:
            with _mapped():
                instant = self._instant_power(h)
                if instant is None:
                    return False
                # "Supported" but 0 W beside a non-zero average (an H200): not a usable reading.
                return instant > 0 or self.nv.nvmlDeviceGetPowerUsage(h) <= 0
        except GpuSourceError:
            return False

    @property
    def costly_energy(self) -> bool:  # type: ignore[override]
        """Some GPU has the energy counter: the sampler reads it at anchors only."""
        return any(self._energy)

    def energy_gpus(self) -> set[int]:
        return {i for i, ok in enumerate(self._energy) if ok}

    def read_energy(self) -> dict[int, tuple[float, float]]:
        """The energy counter of each GPU that has one: index -> (Unix seconds, mJ)."""
        out: dict[int, tuple[float, float]] = {}
        for i, h in enumerate(self._handles):
            if not self._energy[i]:
                continue
            try:
                with _mapped():
                    ts = time.time()
                    out[i] = (ts, float(self.nv.nvmlDeviceGetTotalEnergyConsumption(h)))
            except GpuSourceError:
                self.errors[(i, "energy_error")] += 1
        return out

    def _probe_energy(self, h: Any) -> bool:
        try:
            with _mapped():
                self.nv.nvmlDeviceGetTotalEnergyConsumption(h)
            return True
        except GpuSourceError:
            return False

    def _instant_power(self, h: Any) -> float | None:
        nv = self.nv
        [v] = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_POWER_INSTANT])
        if v.nvmlReturn != nv.NVML_SUCCESS:
            return None
        raw = v.value.dVal if v.valueType == nv.NVML_VALUE_TYPE_DOUBLE else v.value.uiVal
        return float(raw) / 1000.0  # mW

    def gpus(self) -> list[GpuId]:
        return list(self._gpus)

    def read(self, energy: bool = True) -> list[Reading]:
        """One reading per GPU; `energy=False` skips the costly counter (energy NaN)."""
        out: list[Reading] = []
        nv = self.nv
        for i, h in enumerate(self._handles):
            try:
                with _mapped():
                    ts = time.time()
                    power = self._instant_power(h) if self._instant[i] else None
                    if not power:  # not supported, or the H200's 0 W: the 1-s average
                        power = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                    util = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                    mj = math.nan
                    if energy and self._energy[i]:
                        mj = float(nv.nvmlDeviceGetTotalEnergyConsumption(h))
            except GpuLostError:
                self.errors[(i, "gpu_lost")] += 1
                continue
            except GpuNotSupportedError:
                self.errors[(i, "not_supported")] += 1
                continue
            except GpuNoPermissionError:
                self.errors[(i, "no_permission")] += 1
                continue
            except GpuSourceError:
                self.errors[(i, "error")] += 1
                continue
            out.append(Reading(i, ts, power, util, mj))
        return out

    def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(GpuSourceError), _mapped():
                self.nv.nvmlEventSetFree(self._events)
        with contextlib.suppress(GpuSourceError), _mapped():
            self.nv.nvmlShutdown()
