"""NVIDIA GPUs through dcgm-exporter: scrape its /metrics and read the DCGM fields.

Fields: `DCGM_FI_DEV_POWER_USAGE` (W), `DCGM_FI_DEV_POWER_USAGE_INSTANT` (W, preferred for
classification where present), `DCGM_FI_DEV_GPU_UTIL` (%), `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`
(mJ, a counter without the `_total` suffix), `DCGM_FI_DEV_XID_ERRORS` and
`DCGM_FI_DEV_CLOCK_THROTTLE_REASONS` (or `..._CLOCKS_EVENT_REASONS`: the hardware events a wasted
stretch's cause is read from), `DCGM_FI_PROF_SM_ACTIVE` (ratio, where the profiling
fields are enabled). Labels: `gpu`, `UUID`, `Hostname` or `hostname`, `modelName`, `pod`,
`namespace`, `container` (dcgm-exporter's Kubernetes mode: the pod the device plugin gave the
GPU to), and with `--kubernetes-enable-pod-labels` the pod's own labels. `pods()` is the newest
scrape's attribution, for `costexporter.k8s`. The text is parsed with prometheus_client's parser.

MIG: dcgm-exporter labels a MIG instance's series with its parent's `UUID` and `gpu` plus
`GPU_I_ID` and `GPU_I_PROFILE`. Each instance is a device of its own, holding its profile's
compute slices of the GPU (`1g.10gb`: 1 of an H100's 7; `core.shares`), and the GPU's
unpartitioned rest is one more device (nobody's: `unassigned`). Its GPU-time is its slices'
share of the GPU's. Its utilization is its own `DCGM_FI_PROF_GR_ENGINE_ACTIVE` (the profiling
field: `DCGM_FI_DEV_GPU_UTIL` is not supported in MIG mode), or `DCGM_FI_DEV_GPU_UTIL` where
DCGM gives it per instance. DCGM measures power per GPU, not per instance: a fifth of the GPU's
power is shared by slice size (the idle draw every slice holds), the rest by slice size times
the instance's measured engine activity (all of it by size while no activity is known), so the
slices' power always adds up to the GPU's and a busy slice beside idle ones reads busy. Energy
is their power over time (the GPU's energy counter cannot be split).

HAMi: a GPU that pods share by HAMi's core limits (`allocations`: their claims by GPU UUID, as
the Kubernetes path reads them from the pods' `hami.io/vgpu-devices-allocated`) is split as
`core.hami` says: a device per pod holding its declared share of the GPU's lanes (named
`<UUID>::h<k>`), and the GPU itself keeps the lanes nobody holds. DCGM measures the GPU as one:
each pod's device reads the GPU's utilization and its share of the GPU's power by size.

dcgm-exporter collects every 30 s by default (`-c 30000`); scraping it every second then sees
the same values 30 times. The source notices (an energy counter that does not move while the GPU
draws power, or a power reading frozen to the milliwatt) and warns once, with the update
interval it observes.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families

from costexporter.core import causes, hami, shares
from costexporter.core.causes import HardwareEvent
from costexporter.core.model import GpuId
from costexporter.core.timeutil import to_ms
from costexporter.sources.base import GpuSource, Reading

log = logging.getLogger("costexporter.sources.dcgm")

POWER = "DCGM_FI_DEV_POWER_USAGE"
POWER_INSTANT = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
UTIL = "DCGM_FI_DEV_GPU_UTIL"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
GR_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
XID = "DCGM_FI_DEV_XID_ERRORS"  # the last Xid the GPU raised (0: none yet)
THROTTLE = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"  # NVML's clocks event reasons, a bitmask
CLOCKS_EVENTS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"  # its newer name (dcgm-exporter 3.3+)
HARDWARE_FIELDS = (XID, THROTTLE, CLOCKS_EVENTS)
FIELDS = (POWER, POWER_INSTANT, UTIL, ENERGY, SM_ACTIVE, GR_ACTIVE, *HARDWARE_FIELDS)
GPU_FIELDS = (POWER, POWER_INSTANT, ENERGY)  # measured per GPU: a slice gets its share
BASE_SHARE = 0.2  # of a MIG GPU's power, shared by slice size alone (the idle draw)
MAX_PENDING_EVENTS = 10_000
STALE_SCRAPES = 3  # consecutive unchanged scrapes of every GPU before warning
# dcgm-exporter's own labels; any other label on a GPU's series is one of its pod's labels.
DCGM_LABELS = frozenset(
    {"gpu", "UUID", "device", "modelName", "Hostname", "hostname", "pci_bus_id", "DCGM_FI_DRIVER_VERSION"}
    | {"pod", "namespace", "container", "GPU_I_ID", "GPU_I_PROFILE", "err_code", "err_msg", "instance", "job"}
    | {"pod_name", "pod_namespace", "container_name", "exported_pod", "exported_namespace"}
    | {"exported_container", "exported_instance", "exported_job", "vgpu"}
)
# Where dcgm-exporter puts the pod holding a GPU, in the order tried: `exported_*` when its
# series went through a Prometheus that renamed them (a federation URL), its default labels, and
# its `--kubernetes-use-old-namespace` ones.
POD_LABELS = (
    ("exported_pod", "exported_namespace", "exported_container"),
    ("pod", "namespace", "container"),
    ("pod_name", "pod_namespace", "container_name"),
)


@dataclass(frozen=True)
class PodRef:
    """The pod dcgm-exporter says holds a GPU, with the pod labels it exported (if any)."""

    namespace: str
    pod: str
    container: str = ""
    labels: dict[str, str] = field(default_factory=dict, compare=False)


def pod_of(labels: Mapping[str, str]) -> PodRef | None:
    """The pod a series' labels say holds its GPU, with the pod's own labels dcgm-exporter
    exported (every label that is not its own); None where no pod holds it."""
    for pod, ns, container in POD_LABELS:
        if labels.get(pod):
            extra = {k: v for k, v in labels.items() if k not in DCGM_LABELS}
            return PodRef(labels.get(ns, ""), labels[pod], labels.get(container, ""), extra)
    return None


class DcgmSource(GpuSource):
    """GPUs behind one or more dcgm-exporter endpoints (`http://node:9400/metrics`)."""

    wall_clock = True

    def __init__(
        self, urls: list[str], timeout_s: float = 2.0, host: str | None = None, replicas: int = 0
    ) -> None:
        super().__init__()
        if not urls:
            raise ValueError("DcgmSource needs at least one dcgm-exporter URL")
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.host = host or urllib.parse.urlparse(self.urls[0]).hostname or "localhost"
        self._node = host  # the node this agent runs on, when told: its exporter must be this one's
        self.foreign_hosts: set[str] = set()
        self._gpus: list[GpuId] = []
        # (host, gpu label or UUID, GPU_I_ID or "") -> our index
        self._index: dict[tuple[str, str, str], int] = {}
        self._slices: dict[tuple[str, str], list[int]] = {}  # a MIG GPU -> its instances' indexes
        self._rest: dict[tuple[str, str], int] = {}  # a MIG GPU -> its unpartitioned rest's index
        self.pod: dict[int, PodRef] = {}  # our index -> the pod holding it, as of the newest scrape
        self._last: dict[int, tuple[float, float]] = {}  # index -> (power, energy) last scrape
        self._changed_at: dict[int, float] = {}
        self._stale_runs = 0
        self.update_interval_s: float | None = None
        self._warned_coarse = False
        self.scrape_errors = 0
        self.shared_warned: set[int] = set()
        # The device plugin's time-slicing replicas per GPU (its `replicas`); 0: not configured.
        self.replicas = int(replicas)
        self._bad_vgpu: set[tuple[str, str]] = set()
        self._power_share: dict[int, float] = {}
        # HAMi: the pods' claims by GPU UUID (set by the Kubernetes path; read, never waited on),
        # and per shared GPU its pods' devices by (namespace, pod).
        self.allocations: Callable[[], Mapping[str, list[hami.Holder]]] | None = None
        self._hami: dict[tuple[str, str], dict[tuple[str, str], int]] = {}
        self._hami_over: set[tuple[str, str]] = set()
        # Hardware events: each GPU's last Xid and slowdown bits seen (the first scrape's are a
        # baseline: an Xid raised before the agent started is not this stretch's), and the events
        # read since `hardware_events` last handed them out.
        self._xid_seen: dict[int, int] = {}
        self._slowdown: dict[int, int] = {}
        self._hardware: list[HardwareEvent] = []

    def gpus(self) -> list[GpuId]:
        return list(self._gpus)

    def pods(self) -> dict[int, PodRef]:
        """GPU index -> the pod holding it, from the newest scrape of its endpoint."""
        return dict(self.pod)

    def _gpu_of(self, labels: dict[str, str], endpoint_host: str) -> int:
        named = labels.get("Hostname") or labels.get("hostname")
        if named and self._node and named != self._node and named not in self.foreign_hosts:
            self.foreign_hosts.add(named)
            log.warning(
                "dcgm-exporter reports GPUs of node %r, not this agent's node %r: --dcgm-url must reach "
                "the exporter on the agent's own node (a Service with internalTrafficPolicy: Local, or "
                "a hostPort), or another node's GPUs are booked here",
                named,
                self._node,
            )
        host = named or endpoint_host
        parent = labels.get("UUID") or labels.get("gpu", "")
        instance = labels.get("GPU_I_ID", "")
        vgpu = labels.get("vgpu", "")
        if vgpu and self.replicas and not instance:
            return self._replica_of(labels, host, parent, vgpu)
        key = (host, parent, instance)
        i = self._index.get(key)
        if i is None:
            gpu = labels.get("gpu", "")
            index = int(gpu) if gpu.isdigit() else len(self._gpus)
            uuid, model = labels.get("UUID") or None, labels.get("modelName") or None
            if instance:
                g = GpuId(host, index, f"MIG-{parent}/{instance}", model, None, uuid, instance)
                g = replace(g, profile=labels.get("GPU_I_PROFILE") or None)
            else:
                g = GpuId(host, index, uuid, model)
            self._gpus.append(g)
            i = self._index[key] = len(self._gpus) - 1
            if instance:
                self._slices.setdefault((host, parent), []).append(i)
        return i

    def _replica_of(self, labels: dict[str, str], host: str, parent: str, vgpu: str) -> int:
        """A time-sliced GPU's replica (dcgm-exporter --kubernetes-virtual-gpus names it `vgpu`):
        the first time the GPU is seen, every one of its `replicas` becomes a device holding one
        lane of it, named as the device plugin names it (`<UUID>::<k>`); the GPU itself keeps no
        time of its own."""
        key = (host, parent)
        if key not in self._slices:
            gpu = labels.get("gpu", "")
            index = int(gpu) if gpu.isdigit() else len(self._gpus)
            uuid, model, r = labels.get("UUID") or None, labels.get("modelName") or None, self.replicas
            members = []
            for k in range(r):
                g = GpuId(host, index, f"{parent}::{k}", model, None, uuid, None, None, (k, k + 1, r))
                self._gpus.append(g)
                members.append(len(self._gpus) - 1)
                self._index[(host, parent, f"::{k}")] = members[-1]
            self._slices[key] = members
            whole = self._index.get((host, parent, ""))
            if whole is None:
                self._gpus.append(GpuId(host, index, uuid, model))
                whole = self._index[(host, parent, "")] = len(self._gpus) - 1
            self._gpus[whole] = replace(self._gpus[whole], lanes=(r, r, r))
            self._rest[key] = whole
        i = self._index.get((host, parent, f"::{vgpu}"))
        if i is None:  # a replica past the configured count: the configuration is wrong
            if key not in self._bad_vgpu:
                self._bad_vgpu.add(key)
                log.warning(
                    "GPU %s of %s: dcgm-exporter names replica %s, but --time-slicing-replicas is %d: "
                    "set it to the device plugin's replicas; that replica's pod is booked to replica 0",
                    parent,
                    host,
                    vgpu,
                    self.replicas,
                )
            self.errors[(self._slices[key][0], "replica_out_of_range")] += 1
            i = self._slices[key][0]
        return i

    def _share_out(self) -> None:
        """Lanes for the MIG instances first seen in this scrape, and the GPU's rest the lanes
        left: consecutive from 0, so that each device holds one range of lanes (`core.shares`)."""
        for (host, parent), members in self._slices.items():
            fresh = [i for i in members if self._gpus[i].lanes == shares.WHOLE]
            rest = self._rest.get((host, parent))
            if not fresh and rest is not None:
                continue  # laned already (a time-sliced GPU's replicas are laned when made)
            first = self._gpus[members[0]]
            den = shares.mig_slices(first.name)
            used = max((self._gpus[i].lanes[1] for i in members if i not in fresh), default=0)
            for i in sorted(
                fresh,
                key=lambda i: (
                    int(self._gpus[i].instance or 0) if (self._gpus[i].instance or "").isdigit() else 0
                ),
            ):
                g = self._gpus[i]
                try:
                    n = shares.profile_slices(g.profile or "")
                except ValueError as e:
                    n = 1
                    self.errors[(i, "bad_mig_profile")] += 1
                    log.warning(
                        "dcgm-exporter GPU %s instance %s: %s; counted as 1 slice", parent, g.instance, e
                    )
                if used + n > den:
                    self.errors[(i, "mig_over_capacity")] += 1
                    log.warning(
                        "GPU %s: MIG instances hold more than its %d slices; instance %s gets none",
                        parent,
                        den,
                        g.instance,
                    )
                    n = max(den - used, 0)
                self._gpus[i] = replace(g, lanes=(used, used + n, den))
                used += n
            key = (host, parent, "")
            if key not in self._index:  # the GPU itself: its rest, the lanes no instance holds
                self._gpus.append(GpuId(host, first.index, first.parent_uuid, first.name))
                self._index[key] = len(self._gpus) - 1
            r = self._rest[(host, parent)] = self._index[key]
            self._gpus[r] = replace(self._gpus[r], lanes=(min(used, den), den, den))

    def _hami_out(self, allocations: Mapping[str, list[hami.Holder]], pods: dict[int, PodRef]) -> None:
        """The HAMi-shared GPUs' devices: one per pod, holding its lanes now; the GPU keeps the
        rest. A pod that let go keeps its device with no lanes (its booked time stays its own).
        `pods` (device -> pod) is updated in place."""
        for (host, parent, instance), i in list(self._index.items()):
            if instance or (host, parent) in self._slices or self._gpus[i].lanes[2] not in (1, hami.DEN):
                continue  # MIG and time-sliced GPUs are split by their own rules
            if i in self._rest.values() and (host, parent) not in self._hami:
                continue
            holders = allocations.get(self._gpus[i].uuid or parent, [])
            devices = self._hami.get((host, parent))
            if not holders and devices is None:
                continue
            devices = self._hami.setdefault((host, parent), {})
            cut, over = hami.lanes(holders)
            if over and (host, parent) not in self._hami_over:
                self._hami_over.add((host, parent))
                self.errors[(i, "hami_over_capacity")] += 1
                log.warning("GPU %s: HAMi pods claim %d%% of its cores past 100%%; clipped", parent, over)
            seen = set()
            for h, lanes in cut:
                key = (h.namespace, h.pod)
                seen.add(key)
                d = devices.get(key)
                if d is None:
                    g = self._gpus[i]
                    uuid = f"{g.uuid or parent}::h{len(devices)}"
                    self._gpus.append(GpuId(host, g.index, uuid, g.name, None, g.uuid or parent))
                    d = devices[key] = len(self._gpus) - 1
                self._gpus[d] = replace(self._gpus[d], lanes=lanes)
                pods[d] = PodRef(h.namespace, h.pod, h.container)
            for key, d in devices.items():
                if key not in seen:  # released: no more time of its own
                    self._gpus[d] = replace(self._gpus[d], lanes=(0, 0, hami.DEN))
                    pods.pop(d, None)
            used = cut[-1][1][1] if cut else 0
            self._gpus[i] = replace(self._gpus[i], lanes=(used, hami.DEN, hami.DEN))
            self._rest[(host, parent)] = i
            if holders:  # the pod-resources view of a shared GPU names one of its pods
                pods.pop(i, None)

    def _scrape(self, url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:  # the operator's URL
                return str(resp.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, OSError, ValueError) as e:
            self.scrape_errors += 1
            self.errors[(-1, "scrape_failed")] += 1
            log.warning("dcgm-exporter %s: %s", url, e)
            return None

    def read(self) -> list[Reading]:
        values: dict[int, dict[str, float]] = {}
        current = dict(self.pod)
        claims = self.allocations() if self.allocations is not None else None
        for url in self.urls:
            text = self._scrape(url)
            if text is None:
                continue
            endpoint_host = urllib.parse.urlparse(url).hostname or self.host
            ts = time.time()
            pods: dict[int, PodRef | None] = {}
            sharing: dict[int, dict[tuple[str, str], PodRef]] = {}
            try:
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        # The parser names a counter's samples `<name>_total`; DCGM's energy
                        # counter has no such suffix on the wire.
                        name = s.name[:-6] if s.name.endswith("_total") and s.name[:-6] in FIELDS else s.name
                        if name in FIELDS:
                            i = self._gpu_of(s.labels, endpoint_host)
                            v = values.setdefault(i, {"ts": ts})
                            if name not in v:  # fanned out per pod (time-slicing): the first
                                v[name] = float(s.value)
                            pod = pod_of(s.labels)
                            if pod is not None:
                                held = sharing.setdefault(i, {})
                                held.setdefault((pod.namespace, pod.pod), pod)
                            pods[i] = pods.get(i) or pod
            except ValueError as e:  # not the Prometheus text format
                self.errors[(-1, "parse_failed")] += 1
                log.warning("dcgm-exporter %s: cannot parse: %s", url, e)
                continue
            self._share_out()
            for i, held in sharing.items():
                if claims and self._gpus[i].uuid in claims:
                    continue  # HAMi's: each pod booked by its share (`_hami_out`)
                if len(held) > 1 and i not in self.shared_warned:
                    self.shared_warned.add(i)
                    self.errors[(i, "time_sliced")] += 1
                    log.warning(
                        "GPU %s of %s is shared by %d pods at once (time-slicing): it is booked to "
                        "the first one's job (%s/%s); give each job whole GPUs or MIG instances",
                        self._gpus[i].index,
                        self._gpus[i].host,
                        len(held),
                        *next(iter(held)),
                    )
            # A GPU this endpoint reported without a pod has been released: its pod is gone.
            current = {i: p for i, p in current.items() if i not in pods}
            current.update({i: p for i, p in pods.items() if p is not None})
        if claims is not None:
            self._hami_out(claims, current)
        self._note_hardware(values)
        self.pod = current  # replaced once, not mutated: the k8s sync reads it from another thread
        out = []
        self._power_share = self._power_shares(values)
        # A rest runs nothing of its own: a MIG GPU's, and a HAMi GPU's while pods hold shares
        # (a HAMi GPU no pod shares any more is a whole GPU again, its engine its own).
        # (Pods hold shares exactly when the GPU's own lanes no longer start at 0.)
        rests = {r for key, r in self._rest.items() if key not in self._hami or self._gpus[r].lanes[0] > 0}
        for i, v in sorted(values.items()):
            lo, hi, _den = self._gpus[i].lanes
            if hi == lo:
                continue  # a slice of no lanes (a fully partitioned GPU's rest): no time of its own
            # The rest of a MIG GPU runs nothing: the GPU-level engine activity is the instances'.
            out.append(self._reading(i, {**v, UTIL: 0.0} if i in rests else v, values))
        # A MIG GPU's rest, a time-sliced GPU's replicas no pod holds: their share of the GPU's
        # power, no engine of their own.
        for (host, parent), r in sorted(self._rest.items()):
            hami_devices = set(self._hami.get((host, parent), {}).values())
            for i in [r, *self._slices.get((host, parent), []), *sorted(hami_devices)]:
                g = self._gpus[i]
                if i in values or g.lanes[1] == g.lanes[0]:
                    continue
                gv = self._gpu_values(host, parent, values)
                if gv:
                    # A HAMi pod's device runs on the whole GPU: the GPU's utilization is its.
                    util = values.get(r, {}).get(UTIL, 0.0) if i in hami_devices else 0.0
                    out.append(self._reading(i, {**gv, UTIL: util}, values))
        out.sort(key=lambda x: x.gpu)
        self._watch_staleness(out)
        return out

    def _note_hardware(self, values: dict[int, dict[str, float]]) -> None:
        """A GPU's Xid field that moves to a new Xid, and hardware slowdown bits that newly
        appear in its clocks event reasons, as hardware events."""
        for i, v in values.items():
            ts_ms = to_ms(v["ts"])
            if XID in v and math.isfinite(v[XID]):
                xid = int(v[XID])
                if i in self._xid_seen and xid and xid != self._xid_seen[i]:
                    self._hardware.append(HardwareEvent(ts_ms, i, "xid", xid))
                self._xid_seen[i] = xid
            reasons = v.get(CLOCKS_EVENTS, v.get(THROTTLE))
            if reasons is not None and math.isfinite(reasons):
                self._slowdown[i], began = causes.slowdown(ts_ms, i, self._slowdown.get(i, 0), int(reasons))
                if began is not None:
                    self._hardware.append(began)
        del self._hardware[:-MAX_PENDING_EVENTS]  # a storm between two reads keeps its newest

    def hardware_events(self) -> list[HardwareEvent]:
        out, self._hardware = self._hardware, []
        return out

    def _power_shares(self, values: dict[int, dict[str, float]]) -> dict[int, float]:
        """Each slice's share of its GPU's power this scrape (they add up to 1 per GPU)."""
        out: dict[int, float] = {}
        for key, held in self._hami.items():  # one engine for all: by declared size
            for i in [*held.values(), self._rest[key]]:
                out[i] = shares.fraction(self._gpus[i].lanes)
        for key, members in self._slices.items():
            devs = [*members, *([self._rest[key]] if key in self._rest else [])]
            size = {i: shares.fraction(self._gpus[i].lanes) for i in devs}
            act: dict[int, float] = {}
            for i in members:
                v = values.get(i)
                if v is None:  # a replica no pod holds: nothing runs on it
                    act[i] = 0.0
                    continue
                a = v.get(GR_ACTIVE, v.get(UTIL, math.nan) / 100)
                if not math.isnan(a):
                    act[i] = min(max(a, 0.0), 1.0)
            busy = sum(size[i] * a for i, a in act.items())
            if len(act) < len(members) or busy <= 0:  # activity unknown, or none: by size
                out.update(size)
                continue
            for i in devs:
                out[i] = BASE_SHARE * size[i] + (1 - BASE_SHARE) * size[i] * act.get(i, 0.0) / busy
        return out

    def _gpu_values(self, host: str, parent: str, values: dict[int, dict[str, float]]) -> dict[str, float]:
        """The GPU-level fields (power, energy) of a MIG GPU: its own row's, else any instance's
        (dcgm-exporter may copy them onto the instances' series)."""
        for i in [self._index.get((host, parent, "")), *self._slices.get((host, parent), [])]:
            v = values.get(i) if i is not None else None
            if v and any(f in v for f in GPU_FIELDS):
                return {"ts": v["ts"], **{f: v[f] for f in GPU_FIELDS if f in v}}
        return {}

    def _reading(self, i: int, v: dict[str, float], values: dict[int, dict[str, float]]) -> Reading:
        g = self._gpus[i]
        util = v.get(UTIL, math.nan)
        if math.isnan(util) and GR_ACTIVE in v:  # MIG: GPU_UTIL is not supported, the engine's is
            util = 100.0 * v[GR_ACTIVE]
        if g.lanes != shares.WHOLE:  # a slice: its share of what DCGM measures for the GPU
            f = self._power_share.get(i, shares.fraction(g.lanes))
            gv = self._gpu_values(g.host, g.parent_uuid or g.uuid or "", values) or v
            power = gv.get(POWER_INSTANT, gv.get(POWER, math.nan)) * f
            return Reading(i, v["ts"], power, util, math.nan, v.get(SM_ACTIVE, math.nan))
        power = v.get(POWER_INSTANT, v.get(POWER, math.nan))
        return Reading(i, v["ts"], power, util, v.get(ENERGY, math.nan), v.get(SM_ACTIVE, math.nan))

    def _watch_staleness(self, readings: list[Reading]) -> None:
        """Warn once when the exporter's data is coarser than the scrapes."""
        if not readings:
            return
        stale = True
        for r in readings:
            cur = (r.power_w, r.energy_mj)
            prev = self._last.get(r.gpu)
            moved = prev is None or any(
                not (a == b or (math.isnan(a) and math.isnan(b))) for a, b in zip(cur, prev, strict=True)
            )
            if moved:
                stale = False
                last_change = self._changed_at.get(r.gpu)
                if last_change is not None and prev is not None:
                    self.update_interval_s = r.ts - last_change
                self._changed_at[r.gpu] = r.ts
            self._last[r.gpu] = cur
        self._stale_runs = self._stale_runs + 1 if stale else 0
        if self._stale_runs >= STALE_SCRAPES and not self._warned_coarse:
            self._warned_coarse = True
            log.warning(
                "dcgm-exporter data is coarser than the scrapes (the same values %d times in a row%s): "
                "run dcgm-exporter with a shorter collect interval (-c 1000) for per-second bands",
                self._stale_runs,
                f"; it updated every {self.update_interval_s:.1f} s" if self.update_interval_s else "",
            )

    @property
    def coarse(self) -> bool:
        return self._warned_coarse
