"""NVIDIA GPUs through dcgm-exporter: scrape its /metrics and read the DCGM fields.

Fields: `DCGM_FI_DEV_POWER_USAGE` (W), `DCGM_FI_DEV_POWER_USAGE_INSTANT` (W, preferred for
classification where present), `DCGM_FI_DEV_GPU_UTIL` (%), `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`
(mJ, a counter without the `_total` suffix), `DCGM_FI_PROF_SM_ACTIVE` (ratio, where the profiling
fields are enabled). Labels: `gpu`, `UUID`, `Hostname` or `hostname`, `modelName`, `pod`,
`namespace`. The text is parsed with prometheus_client's parser.

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
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from ..model import GpuId
from .base import GpuSource, Reading

log = logging.getLogger("costexporter.sources.dcgm")

POWER = "DCGM_FI_DEV_POWER_USAGE"
POWER_INSTANT = "DCGM_FI_DEV_POWER_USAGE_INSTANT"
UTIL = "DCGM_FI_DEV_GPU_UTIL"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
FIELDS = (POWER, POWER_INSTANT, UTIL, ENERGY, SM_ACTIVE)
STALE_SCRAPES = 3  # consecutive unchanged scrapes of every GPU before warning


class DcgmSource(GpuSource):
    """GPUs behind one or more dcgm-exporter endpoints (`http://node:9400/metrics`)."""

    def __init__(self, urls: list[str], timeout_s: float = 2.0, host: str | None = None) -> None:
        super().__init__()
        if not urls:
            raise ValueError("DcgmSource needs at least one dcgm-exporter URL")
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.host = host or urllib.parse.urlparse(self.urls[0]).hostname or "localhost"
        self._gpus: list[GpuId] = []
        self._index: dict[tuple[str, str], int] = {}  # (host, gpu label or UUID) -> our index
        self.pod: dict[int, tuple[str, str]] = {}  # our index -> (namespace, pod) using the GPU
        self._last: dict[int, tuple[float, float]] = {}  # index -> (power, energy) last scrape
        self._changed_at: dict[int, float] = {}
        self._stale_runs = 0
        self.update_interval_s: float | None = None
        self._warned_coarse = False
        self.scrape_errors = 0

    def gpus(self) -> list[GpuId]:
        return list(self._gpus)

    def _gpu_of(self, labels: dict[str, str], endpoint_host: str) -> int:
        host = labels.get("Hostname") or labels.get("hostname") or endpoint_host
        key = (host, labels.get("UUID") or labels.get("gpu", ""))
        i = self._index.get(key)
        if i is None:
            gpu = labels.get("gpu", "")
            index = int(gpu) if gpu.isdigit() else len(self._gpus)
            self._gpus.append(GpuId(host, index, labels.get("UUID") or None, labels.get("modelName") or None))
            i = self._index[key] = len(self._gpus) - 1
        if labels.get("pod"):
            self.pod[i] = (labels.get("namespace", ""), labels["pod"])
        return i

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
            try:
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        # The parser names a counter's samples `<name>_total`; DCGM's energy
                        # counter has no such suffix on the wire.
                        name = s.name[:-6] if s.name.endswith("_total") and s.name[:-6] in FIELDS else s.name
                        if name in FIELDS:
                            i = self._gpu_of(s.labels, endpoint_host)
                            values.setdefault(i, {"ts": ts})[name] = float(s.value)
            except ValueError as e:  # not the Prometheus text format
                self.errors[(-1, "parse_failed")] += 1
                log.warning("dcgm-exporter %s: cannot parse: %s", url, e)
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
