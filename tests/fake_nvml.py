"""A stand-in for the NVML library behind the real `pynvml` module, for machines without a GPU.

It replaces pynvml's functions (same names, same argument shapes, same units: mW, mJ, %) and
raises pynvml's own exception classes, so the code under test runs the real pynvml paths.

It counts calls per function (`counts`) and can charge a CPU cost per call (`cpu_cost_s`, spent
spinning, as the real library spends it), so tests can hold the source to a call budget. The
energy counter integrates each GPU's power as it is set (`set()` accrues first), and every
counter value handed out is logged in `energy_reads`.
"""

from __future__ import annotations

import collections
import threading
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
    instant_zero: bool = False  # the H200: the instant field "supported" but always 0
    counter_power_mw: int | None = None  # what the counter integrates, if not power_mw
    mig: tuple[str, ...] = ()  # the UUIDs of its MIG devices (MIG mode on)
    read_at: float = 0.0  # Unix s of the last call that answered (the last sample it gave)
    xid_events: bool = True  # reports nvmlEventTypeXidCriticalError (nvmlDeviceGetSupportedEventTypes)
    clocks_event_reasons: int = 0  # nvmlDeviceGetCurrentClocksEventReasons' bitmask


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
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetIndex",
        "nvmlDeviceIsMigDeviceHandle",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlEventSetCreate",
        "nvmlEventSetFree",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait_v2",
        "nvmlDeviceGetCurrentClocksEventReasons",
    )

    def __init__(self, gpus: list[FakeGpu], cpu_cost_s: dict[str, float] | None = None) -> None:
        self.gpus = gpus
        self.calls = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.cpu_cost_s = dict(cpu_cost_s or {})
        self.energy_reads: list[tuple[int, float, int]] = []  # (gpu, Unix s, mJ) handed out
        self._lock = threading.Lock()  # the sampler thread and the test both move the counter
        # Xids raised on the GPUs (inject_xid), waiting in every event set that registered them
        self._event_sets: list[tuple[set[int], collections.deque]] = []

    def install(self, monkeypatch) -> FakeNvml:
        for name in self.FUNCTIONS:
            monkeypatch.setattr(pynvml, name, getattr(self, name))
        return self

    def install_global(self) -> FakeNvml:
        """For a script or subprocess without pytest: replace pynvml's functions for good."""
        for name in self.FUNCTIONS:
            setattr(pynvml, name, getattr(self, name))
        return self

    def set(self, i: int, **fields) -> None:
        """Change a GPU's state, the counter first accruing its energy at the old power."""
        g = self.gpus[i]
        self._accrue(g)
        with self._lock:
            for k, v in fields.items():
                setattr(g, k, v)

    def _accrue(self, g: FakeGpu) -> None:
        with self._lock:
            now = time.monotonic()
            if g.last:
                p = g.power_mw if g.counter_power_mw is None else g.counter_power_mw
                g.energy_mj += p * (now - g.last)  # mW x s = mJ
            g.last = now

    def _charge(self, name: str) -> None:
        self.counts[name] += 1
        cost = self.cpu_cost_s.get(name, 0.0)
        if cost:
            end = time.thread_time() + cost
            while time.thread_time() < end:  # CPU, not sleep: the cost NVML really has
                pass

    def _gpu(self, handle, name: str = "") -> FakeGpu:
        self.calls += 1
        if name:
            self._charge(name)
        g = self.gpus[handle]
        if g.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        self._accrue(g)
        g.read_at = time.time()
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
        if isinstance(h, tuple):  # a MIG device's handle: ("mig", parent index, instance)
            return self.gpus[h[1]].mig[h[2]]
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetHandleByUUID(self, uuid):
        """A GPU's handle, or a MIG device's; NVML_ERROR_NOT_FOUND for any other (the real
        library takes only a whole UUID)."""
        for i, g in enumerate(self.gpus):
            if g.uuid == uuid:
                return i
            if uuid in g.mig:
                return ("mig", i, g.mig.index(uuid))
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, h):
        if isinstance(h, tuple):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a MIG device has no index
        self._gpu(h)
        return h

    def nvmlDeviceIsMigDeviceHandle(self, h):
        return isinstance(h, tuple)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h):
        if not isinstance(h, tuple):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return h[1]

    def nvmlDeviceGetName(self, h):
        return self._gpu(h, "nvmlDeviceGetName").name

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._gpu(h, "nvmlDeviceGetEnforcedPowerLimit").limit_mw

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        g = self._gpu(h, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for i, fid in enumerate(field_ids):
            values[i].fieldId = fid
            if fid == pynvml.NVML_FI_DEV_POWER_INSTANT and g.instant:
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = 0 if g.instant_zero else g.power_mw
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetPowerUsage(self, h):
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetUtilizationRates(self, h):
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        u = pynvml.c_nvmlUtilization_t()
        u.gpu, u.memory = g.util, 40
        return u

    def inject_xid(self, i: int, xid: int) -> None:
        """GPU `i` raises Xid `xid`: queued, as the driver queues it, in each event set that
        registered the GPU for nvmlEventTypeXidCriticalError."""
        with self._lock:
            for gpus, queue in self._event_sets:
                if i in gpus:
                    queue.append((i, xid))

    def nvmlEventSetCreate(self):
        self._charge("nvmlEventSetCreate")
        with self._lock:
            self._event_sets.append((set(), collections.deque()))
            return len(self._event_sets) - 1

    def nvmlEventSetFree(self, event_set):
        self._charge("nvmlEventSetFree")

    def nvmlDeviceGetSupportedEventTypes(self, h):
        g = self._gpu(h, "nvmlDeviceGetSupportedEventTypes")
        base = pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
        return base | (pynvml.nvmlEventTypeXidCriticalError if g.xid_events else 0)

    def nvmlDeviceRegisterEvents(self, h, event_types, event_set):
        g = self._gpu(h, "nvmlDeviceRegisterEvents")
        if event_types & pynvml.nvmlEventTypeXidCriticalError and not g.xid_events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            self._event_sets[event_set][0].add(h)

    def nvmlEventSetWait_v2(self, event_set, timeoutms):
        """The next queued event (c_nvmlEventData_t: device, eventType, eventData), or
        NVML_ERROR_TIMEOUT when none came within the wait (the fake never waits)."""
        self._charge("nvmlEventSetWait_v2")
        with self._lock:
            queue = self._event_sets[event_set][1]
            if not queue:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            i, xid = queue.popleft()
        data = pynvml.c_nvmlEventData_t()
        data.eventType, data.eventData = pynvml.nvmlEventTypeXidCriticalError, xid
        return _EventData(i, data)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons").clocks_event_reasons

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        g = self._gpu(h, "nvmlDeviceGetTotalEnergyConsumption")
        if not g.energy:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        value = int(g.energy_mj)
        self.energy_reads.append((h, time.time(), value))
        return value


class _EventData:
    """A c_nvmlEventData_t whose `device` is the fake's handle (the real one is a pointer to the
    device, which nvmlDeviceGetIndex turns into its index, as the fake's handle does)."""

    def __init__(self, device: int, data) -> None:
        self.device, self.eventType, self.eventData = device, data.eventType, data.eventData
        self.gpuInstanceId, self.computeInstanceId = data.gpuInstanceId, data.computeInstanceId


class FileDrivenFakeNvml(FakeNvml):
    """A fake whose GPUs' power and utilization come from a JSON file another process writes
    ({"0": {"power_mw": ..., "util": ...}, ...}), so a script and the agent it starts see one GPU.
    Used by bench/gpu_check.py --fake-nvml (tests only)."""

    def __init__(self, path: str, n: int = 1, cpu_cost_s: dict[str, float] | None = None) -> None:
        gpus = [
            FakeGpu(f"GPU-fa4e0000-0000-0000-0000-{i:012x}", name="NVIDIA H200", limit_mw=700_000)
            for i in range(n)
        ]
        super().__init__(gpus, cpu_cost_s)
        self.path = path
        self._mtime = 0.0

    def _gpu(self, handle, name: str = "") -> FakeGpu:
        import json
        import os

        try:
            m = os.stat(self.path).st_mtime
            if m != self._mtime:
                with open(self.path) as f:
                    state = json.load(f)
                self._mtime = m
                for k, v in state.items():
                    if 0 <= int(k) < len(self.gpus):
                        self.set(int(k), **v)
        except (OSError, ValueError):
            pass  # mid-write or not there yet: keep the last state
        return super()._gpu(handle, name)


ENV = "COSTEXPORTER_FAKE_NVML"
R9_ENERGY_CALL_CPU_S = 0.0039  # the H200's measured CPU cost of one energy-counter call


def boot_from_env() -> None:
    """Install a FileDrivenFakeNvml from $COSTEXPORTER_FAKE_NVML (the state file), if set."""
    import os

    path = os.environ.get(ENV)
    if path:
        FileDrivenFakeNvml(
            path, cpu_cost_s={"nvmlDeviceGetTotalEnergyConsumption": R9_ENERGY_CALL_CPU_S}
        ).install_global()
