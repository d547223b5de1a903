"""NVIDIA GPUs through NVML (nvidia-ml-py, imported as `pynvml`).

* power for classification: the instant field `NVML_FI_DEV_POWER_INSTANT` through
  `nvmlDeviceGetFieldValues` where supported, else `nvmlDeviceGetPowerUsage` (mW; a 1-s average
  on Ampere and newer);
* energy: `nvmlDeviceGetTotalEnergyConsumption` (mJ since driver load, Volta and newer), else
  the agent integrates power;
* utilization: `nvmlDeviceGetUtilizationRates().gpu` (%);
* the profile: `nvmlDeviceGetName` and `nvmlDeviceGetEnforcedPowerLimit` (mW).
NVML's errors are mapped to costexporter's in `_mapped`, the one place that knows them.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Iterator

from ..model import GpuId
from .base import (
    GpuInitError,
    GpuLostError,
    GpuNoPermissionError,
    GpuNotSupportedError,
    GpuSource,
    GpuSourceError,
    Reading,
)


def _pynvml():
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

    def _probe_instant(self, h) -> bool:
        try:
            with _mapped():
                return self._instant_power(h) is not None
        except GpuSourceError:
            return False

    def _probe_energy(self, h) -> bool:
        try:
            with _mapped():
                self.nv.nvmlDeviceGetTotalEnergyConsumption(h)
            return True
        except GpuSourceError:
            return False

    def _instant_power(self, h) -> float | None:
        nv = self.nv
        [v] = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_POWER_INSTANT])
        if v.nvmlReturn != nv.NVML_SUCCESS:
            return None
        raw = v.value.dVal if v.valueType == nv.NVML_VALUE_TYPE_DOUBLE else v.value.uiVal
        return float(raw) / 1000.0  # mW

    def gpus(self) -> list[GpuId]:
        return list(self._gpus)

    def read(self) -> list[Reading]:
        out: list[Reading] = []
        nv = self.nv
        for i, h in enumerate(self._handles):
            try:
                with _mapped():
                    ts = time.time()
                    power = self._instant_power(h) if self._instant[i] else None
                    if power is None:
                        power = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
                    util = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                    energy = float(nv.nvmlDeviceGetTotalEnergyConsumption(h)) if self._energy[i] else math.nan
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
            out.append(Reading(i, ts, power, util, energy))
        return out

    def close(self) -> None:
        with contextlib.suppress(GpuSourceError), _mapped():
            self.nv.nvmlShutdown()
