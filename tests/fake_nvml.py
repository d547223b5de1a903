"""A stand-in for the NVML library behind the real `pynvml` module, for machines without a GPU.

It replaces pynvml's functions (same names, same argument shapes, same units: mW, mJ, %) and
raises pynvml's own exception classes, so the code under test runs the real pynvml paths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pynvml


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA B300"
    power_mw: int = 950_000
    util: int = 100
    limit_mw: int = 1_100_000
    instant: bool = True  # supports NVML_FI_DEV_POWER_INSTANT
    energy: bool = True  # supports nvmlDeviceGetTotalEnergyConsumption (Volta+)
    lost: bool = False
    energy_mj: float = 0.0
    last: float = 0.0


class FakeNvml:
    FUNCTIONS = (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetTotalEnergyConsumption",
    )

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.calls = 0

    def install(self, monkeypatch) -> FakeNvml:
        for name in self.FUNCTIONS:
            monkeypatch.setattr(pynvml, name, getattr(self, name))
        return self

    def _gpu(self, handle) -> FakeGpu:
        self.calls += 1
        g = self.gpus[handle]
        if g.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return g

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return i

    def nvmlDeviceGetUUID(self, h):
        return self._gpu(h).uuid

    def nvmlDeviceGetName(self, h):
        return self._gpu(h).name

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._gpu(h).limit_mw

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        g = self._gpu(h)
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):
            values[i].fieldId = fid
            if fid == pynvml.NVML_FI_DEV_POWER_INSTANT and g.instant:
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = g.power_mw
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, h):
        return self._gpu(h).power_mw

    def nvmlDeviceGetUtilizationRates(self, h):
        g = self._gpu(h)
        u = pynvml.c_nvmlUtilization_t()
        u.gpu, u.memory = g.util, 40
        return u

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        g = self._gpu(h)
        if not g.energy:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now = time.monotonic()
        if g.last:
            g.energy_mj += g.power_mw * (now - g.last)  # mW x s = mJ
        g.last = now
        return int(g.energy_mj)
