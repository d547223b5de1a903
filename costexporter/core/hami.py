"""HAMi fractional GPUs: pods that share a GPU by HAMi's core and memory limits, each booked by
its declared share of the GPU's time, every GPU-second once.

HAMi's scheduler writes its decision on the pod (`hami.io/vgpu-devices-to-allocate`, with the
node in `hami.io/vgpu-node`), and its device plugin keeps what it allocated in
`hami.io/vgpu-devices-allocated`: per container, terminated by `;`, the devices it holds, each
`<UUID>,<type>,<memory MB>,<core %>` terminated by `:` (HAMi's `EncodePodSingleDevice` and
`DecodeContainerDevices`, pkg/device/devices.go). A GPU's core share is a percentage: 100 is the
whole GPU, 0 "no core limit" (it competes for what the others leave).

A shared GPU's time is split on HAMi's own scale, `DEN` = 100 lanes (`core.shares`): each pod
holds as many consecutive lanes as its core percentage; pods without a core limit share the
lanes left equally; the lanes nobody holds stay the GPU's own (unassigned). Lanes add up to the
GPU's, so a GPU-second is booked once however its pods come and go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ALLOCATED = "hami.io/vgpu-devices-allocated"
DEN = 100
# A pod in these phases holds its devices (Pending: bound, containers starting).
HOLDING_PHASES = frozenset({"Running", "Pending"})


@dataclass(frozen=True)
class HamiDevice:
    uuid: str
    kind: str
    mem_mb: int
    cores: int


@dataclass(frozen=True)
class Holder:
    """A pod's claim on one GPU (its containers' claims on it summed)."""

    namespace: str
    pod: str
    container: str
    cores: int
    mem_mb: int


def decode(annotation: str) -> list[list[HamiDevice]]:
    """Each container's devices, in the pod's container order (an empty list for a container
    without any); ValueError naming what is wrong, as HAMi's decoder refuses it."""
    out: list[list[HamiDevice]] = []
    parts = annotation.split(";")
    if parts and parts[-1] == "":
        parts = parts[:-1]  # the trailing terminator
    for part in parts:
        devices = []
        for item in part.split(":"):
            if "," not in item:
                continue  # the terminator's empty tail
            fields = item.split(",")
            if len(fields) < 4:
                raise ValueError(f"HAMi device {item!r}: needs <UUID>,<type>,<memory MB>,<core %>")
            uuid, kind, mem, cores = (f.strip() for f in fields[:4])
            try:
                mem_mb, core_pct = int(mem), int(cores)
            except ValueError:
                raise ValueError(f"HAMi device {item!r}: memory and cores must be integers") from None
            if not uuid or mem_mb < 0 or not 0 <= core_pct <= DEN:
                raise ValueError(f"HAMi device {item!r}: no UUID, or memory < 0, or cores outside 0-100")
            devices.append(HamiDevice(uuid, kind, mem_mb, core_pct))
        out.append(devices)
    return out


def holders_of(pod: Mapping[str, Any]) -> dict[str, Holder]:
    """The GPUs a pod holds through HAMi, by UUID (empty: none, or not holding them now).
    ValueError for an annotation that cannot be read."""
    meta = pod.get("metadata") or {}
    annotation = (meta.get("annotations") or {}).get(ALLOCATED)
    phase = (pod.get("status") or {}).get("phase", "Running")
    if not annotation or phase not in HOLDING_PHASES:
        return {}
    names = [c.get("name", "") for c in (pod.get("spec") or {}).get("containers") or []]
    out: dict[str, Holder] = {}
    for k, devices in enumerate(decode(str(annotation))):
        for d in devices:
            prev = out.get(d.uuid)
            name = names[k] if k < len(names) else ""
            if prev is None:
                out[d.uuid] = Holder(meta.get("namespace", ""), meta.get("name", ""), name, d.cores, d.mem_mb)
            else:  # two containers of the pod on one GPU: one claim, their shares summed
                cores = min(prev.cores + d.cores, DEN) if prev.cores and d.cores else 0
                out[d.uuid] = Holder(prev.namespace, prev.pod, prev.container, cores, prev.mem_mb + d.mem_mb)
    return out


def by_gpu(pods: Iterable[Mapping[str, Any]]) -> tuple[dict[str, list[Holder]], list[str]]:
    """Every GPU's holders among `pods`, and one line per pod whose annotation was unreadable
    (that pod is left out; the others are not held back by it)."""
    out: dict[str, list[Holder]] = {}
    bad: list[str] = []
    for pod in pods:
        try:
            held = holders_of(pod)
        except ValueError as e:
            meta = pod.get("metadata") or {}
            bad.append(f"{meta.get('namespace', '')}/{meta.get('name', '')}: {e}")
            continue
        for uuid, h in held.items():
            out.setdefault(uuid, []).append(h)
    for hs in out.values():
        hs.sort(key=lambda h: (h.namespace, h.pod))
    return out, bad


def lanes(holders: list[Holder]) -> tuple[list[tuple[Holder, tuple[int, int, int]]], int]:
    """Each holder's lanes [lo, hi) of `DEN`, consecutive from 0 in the order given, and the
    lanes asked for past the GPU's (clipped: a claim over 100% in all never books more than the
    GPU). Core-limited pods hold their percentage; the others share what is left equally."""
    free = sum(1 for h in holders if h.cores == 0)
    asked = sum(h.cores for h in holders)
    width: dict[int, int] = {}
    left = DEN
    for k, h in enumerate(holders):
        if h.cores > 0:
            width[k] = min(h.cores, left)
            left -= width[k]
    if free:
        each, extra = divmod(left, free)
        j = 0
        for k, h in enumerate(holders):
            if h.cores == 0:
                width[k] = each + (1 if j < extra else 0)
                j += 1
    out = []
    lo = 0
    for k, h in enumerate(holders):
        out.append((h, (lo, lo + width[k], DEN)))
        lo += width[k]
    return out, max(asked - DEN, 0)
