"""NVIDIA GPUs through dcgm-exporter: scrape its /metrics and read the DCGM fields.

Fields: `DCGM_FI_DEV_POWER_USAGE` (W), `DCGM_FI_DEV_POWER_USAGE_INSTANT` (W, preferred for
classification where present), `DCGM_FI_DEV_GPU_UTIL` (%), `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`
(mJ, a counter without the `_total` suffix), `DCGM_FI_PROF_SM_ACTIVE` (ratio, where the profiling
fields are enabled). Labels: `gpu`, `UUID`, `Hostname` or `hostname`, `modelName`, `pod`,
`namespace`, `container` (dcgm-exporter's Kubernetes mode: the pod the device plugin gave the
GPU to), and with `--kubernetes-enable-pod-labels` the pod's own labels. `pods()` is the newest
scrape's attribution, for `costexporter.k8s`. The text is parsed with prometheus_client's parser.

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
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from costexporter.core.model import GpuId
from costexporter.sources.base import GpuSource, Reading

log = logging.getLogger("costexporter.sources.dcgm")

POWER = "DCGM_FI_DEV_POWER_USAGE"
POWER_INSTANT = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
UTIL = "DCGM_FI_DEV_GPU_UTIL"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
FIELDS = (POWER, POWER_INSTANT, UTIL, ENERGY, SM_ACTIVE)
STALE_SCRAPES = 3  # consecutive unchanged scrapes of every GPU before warning
# dcgm-exporter's own labels; any other label on a GPU's series is one of its pod's labels.
DCGM_LABELS = frozenset(
    {"gpu", "UUID", "device", "modelName", "Hostname", "hostname", "pci_bus_id", "DCGM_FI_DRIVER_VERSION"}
    | {"pod", "namespace", "container", "GPU_I_ID", "GPU_I_PROFILE", "err_code", "err_msg", "instance", "job"}
    | {"pod_name", "pod_namespace", "container_name", "exported_pod", "exported_namespace"}
    | {"exported_container", "exported_instance", "exported_job"}
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


class DcgmSource(GpuSource):
    """GPUs behind one or more dcgm-exporter endpoints (`http://node:9400/metrics`)."""

    wall_clock = True

    def __init__(self, urls: list[str], timeout_s: float = 2.0, host: str | None = None) -> None:
        super().__init__()
        if not urls:
            raise ValueError("DcgmSource needs at least one dcgm-exporter URL")
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.host = host or urllib.parse.urlparse(self.urls[0]).hostname or "localhost"
        self._node = host  # the node this agent runs on, when told: its exporter must be this one's
        self.foreign_hosts: set[str] = set()
        self._gpus: list[GpuId] = []
        self._index: dict[tuple[str, str], int] = {}  # (host, gpu label or UUID) -> our index
        self.pod: dict[int, PodRef] = {}  # our index -> the pod holding it, as of the newest scrape
        self._last: dict[int, tuple[float, float]] = {}  # index -> (power, energy) last scrape
        self._changed_at: dict[int, float] = {}
        self._stale_runs = 0
        self.update_interval_s: float | None = None
        self._warned_coarse = False
        self.scrape_errors = 0

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
        key = (host, labels.get("UUID") or labels.get("gpu", ""))
        i = self._index.get(key)
        if i is None:
            gpu = labels.get("gpu", "")
            index = int(gpu) if gpu.isdigit() else len(self._gpus)
            self._gpus.append(GpuId(host, index, labels.get("UUID") or None, labels.get("modelName") or None))
            i = self._index[key] = len(self._gpus) - 1
        return i

    @staticmethod
    def _pod_of(labels: dict[str, str]) -> PodRef | None:
        for pod, ns, container in POD_LABELS:
            if labels.get(pod):
                extra = {k: v for k, v in labels.items() if k not in DCGM_LABELS}
                return PodRef(labels.get(ns, ""), labels[pod], labels.get(container, ""), extra)
        return None

    def _scrape(self, url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:  # the operator's URL
                return resp.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError, ValueError) as e:
            self.scrape_errors += 1
            self.errors[(-1, "scrape_failed")] += 1
            log.warning("dcgm-exporter %s: %s", url, e)
            return None

    def read(self) -> list[Reading]:
        values: dict[int, dict[str, float]] = {}
        for url in self.urls:
            text = self._scrape(url)
            if text is None:
                continue
            endpoint_host = urllib.parse.urlparse(url).hostname or self.host
            ts = time.time()
            pods: dict[int, PodRef | None] = {}
            try:
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        # The parser names a counter's samples `<name>_total`; DCGM's energy
                        # counter has no such suffix on the wire.
                        name = s.name[:-6] if s.name.endswith("_total") and s.name[:-6] in FIELDS else s.name
                        if name in FIELDS:
                            i = self._gpu_of(s.labels, endpoint_host)
                            values.setdefault(i, {"ts": ts})[name] = float(s.value)
                            pods[i] = pods.get(i) or self._pod_of(s.labels)
            except ValueError as e:  # not the Prometheus text format
                self.errors[(-1, "parse_failed")] += 1
                log.warning("dcgm-exporter %s: cannot parse: %s", url, e)
                continue
            # A GPU this endpoint reported without a pod has been released: its pod is gone.
            new = {i: p for i, p in self.pod.items() if i not in pods}
            new.update({i: p for i, p in pods.items() if p is not None})
            self.pod = new  # replaced, not mutated: the k8s sync reads it from another thread
        out = []
        for i, v in sorted(values.items()):
            power = v.get(POWER_INSTANT, v.get(POWER, math.nan))
            out.append(
                Reading(
                    i,
                    v["ts"],
                    power,
                    v.get(UTIL, math.nan),
                    v.get(ENERGY, math.nan),
                    v.get(SM_ACTIVE, math.nan),
                )
            )
        self._watch_staleness(out)
        return out

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
