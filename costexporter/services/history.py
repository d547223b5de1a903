"""Past DCGM readings for replay: what a Prometheus (or Thanos, Mimir) already holds, pulled by
range queries, and dcgm-exporter text dumps (its /metrics saved by `curl`, scrape after scrape).

Both give dcgm-exporter's series: `DCGM_FI_DEV_POWER_USAGE` (W; `..._INSTANT` where the average
is missing), `DCGM_FI_DEV_GPU_UTIL` (%), `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` (mJ, a counter),
labelled `gpu`, `UUID`, `Hostname` or `hostname`, `modelName`, and in Kubernetes the `pod` and
`namespace` holding the GPU (`exported_*` through a federation, `pod_name` in the old mode).
A GPU is (host, `gpu`); MIG instances' series (`GPU_I_ID`) are counted and skipped: replay books
whole GPUs. The pods become jobs (`PodSpan`s, `jobmap.py`): each pod's stretch on a GPU
is a registration of its job, a rank per GPU.

A dump's samples are dated by their own timestamps where the exposition carries them, else by
a line between scrapes that is a time (`date -Is; curl ...`), else by a `LogClock` (the first
scrape's time and the scrape interval: the k-th reading of a series at start + k x interval).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from costexporter.core import timeutil
from costexporter.core.diagnostics import Diagnostics, InputError
from costexporter.core.gpulogs import LogClock
from costexporter.core.tracefiles import MAX_POWER_W, SampleChunk, check_file
from costexporter.sources.dcgm import ENERGY, POWER, POWER_INSTANT, UTIL, PodRef, pod_of

log = logging.getLogger("costexporter.history")

FIELDS = {POWER: "power", POWER_INSTANT: "power_instant", UTIL: "util", ENERGY: "energy"}
HOST_LABELS = ("Hostname", "hostname")
MAX_POINTS = 10_000  # per series and query: Prometheus refuses more than 11,000
RETRIES = 4


@dataclass(frozen=True, slots=True)
class PodSpan:
    """A pod's stretch on a GPU: from its first to its last reading there (epoch ms)."""

    pod: PodRef
    host: str
    gpu: int
    uuid: str | None
    first_ms: int
    last_ms: int


@dataclass
class _Gpu:
    uuid: str | None = None
    model: str | None = None
    points: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    pods: list[tuple[np.ndarray, PodRef | None]] = field(default_factory=list)  # power points' pods


def _host_of(labels: Mapping[str, str], default: str) -> str:
    for k in HOST_LABELS:
        if labels.get(k):
            return labels[k]
    inst = labels.get("instance")
    if inst:
        return inst.rsplit(":", 1)[0] if not inst.startswith("[") else inst
    return default


class Gather:
    """Readings of many series, joined into one sample per GPU and time."""

    def __init__(self, default_host: str, where: str, diag: Diagnostics) -> None:
        self.default_host, self.where, self.diag = default_host, where, diag
        self.gpus: dict[tuple[str, int], _Gpu] = {}

    def add(self, metric: str, labels: Mapping[str, str], ts_ms: np.ndarray, values: np.ndarray) -> None:
        role = FIELDS.get(metric)
        if role is None:
            return
        if labels.get("GPU_I_ID"):
            self.diag.counts["mig_instance_series"] += 1
            self.diag.note(self.where, "MIG instances' series skipped: replay books whole GPUs")
            return
        try:
            index = int(labels.get("gpu", ""))
        except ValueError:
            self.diag.warn(self.where, None, "bad_value", f"a {metric} series without a numeric gpu label")
            return
        host = _host_of(labels, self.default_host)
        g = self.gpus.setdefault((host, index), _Gpu())
        g.uuid = g.uuid or labels.get("UUID") or None
        g.model = g.model or labels.get("modelName") or None
        g.points.setdefault(role, []).append((ts_ms.astype(np.int64), values.astype(np.float64)))
        if role in ("power", "power_instant"):
            g.pods.append((ts_ms.astype(np.int64), pod_of(labels)))

    def chunk(self) -> tuple[SampleChunk, list[PodSpan]]:
        """One SampleChunk of every GPU, and each pod's stretches on them."""
        if not self.gpus:
            raise InputError(f"{self.where}: no DCGM_FI_DEV_POWER_USAGE series of any GPU")
        hosts = sorted({h for h, _ in self.gpus})
        host_no = {h: i for i, h in enumerate(hosts)}
        cols: dict[str, list[np.ndarray]] = {k: [] for k in ("host", "index", "ts", "p", "u", "e")}
        spans: list[PodSpan] = []
        uuids, names = {}, {}
        for (host, index), g in sorted(self.gpus.items()):
            role = "power" if "power" in g.points else "power_instant"
            if role not in g.points:
                self.diag.warn(self.where, None, "gpu_missing", f"{host} GPU {index}: no power series")
                continue
            ts, pw = _joined(g.points[role])
            keep = np.isfinite(pw) & (pw >= 0) & (pw <= MAX_POWER_W)
            ts, pw = ts[keep], pw[keep]
            cols["host"].append(np.full(ts.size, host_no[host], np.int32))
            cols["index"].append(np.full(ts.size, index, np.int64))
            cols["ts"].append(ts)
            cols["p"].append(pw)
            cols["u"].append(_at(g.points.get("util"), ts))
            cols["e"].append(_at(g.points.get("energy"), ts))
            if g.uuid:
                uuids[(host, index)] = g.uuid
            if g.model:
                names[(host, index)] = g.model
            spans += _spans(g.pods, host, index, g.uuid)
        energy = np.concatenate(cols["e"])
        chunk = SampleChunk(
            hosts=hosts,
            host=np.concatenate(cols["host"]),
            index=np.concatenate(cols["index"]),
            ts_ms=np.concatenate(cols["ts"]),
            power_w=np.concatenate(cols["p"]),
            util_pct=np.concatenate(cols["u"]),
            energy_mj=None if np.isnan(energy).all() else energy,
            uuid=uuids,
            name=names,
            power_limit_w={},
        )
        return chunk, spans


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One series' points from several pieces (chunks, scrapes, label sets), in time order, one
    per time (the later piece's where two meet)."""
    ts = np.concatenate([p[0] for p in parts])
    v = np.concatenate([p[1] for p in parts])
    order = np.argsort(ts, kind="stable")
    ts, v = ts[order], v[order]
    last = np.ones(ts.size, bool)
    last[:-1] = ts[1:] != ts[:-1]
    return ts[last], v[last]


def _at(parts: list[tuple[np.ndarray, np.ndarray]] | None, ts: np.ndarray) -> np.ndarray:
    """A series' values at the power readings' times (NaN where it has none then)."""
    out = np.full(ts.size, np.nan)
    if not parts:
        return out
    t, v = _joined(parts)
    i = np.clip(np.searchsorted(t, ts), 0, max(t.size - 1, 0))
    hit = t[i] == ts if t.size else np.zeros(ts.size, bool)
    out[hit] = v[i[hit]]
    return out


def _spans(
    pods: list[tuple[np.ndarray, PodRef | None]], host: str, index: int, uuid: str | None
) -> list[PodSpan]:
    """Each pod's [first, last] reading on the GPU."""
    by_pod: dict[PodRef, list[int]] = {}
    for ts, pod in pods:
        if pod is None or ts.size == 0:
            continue
        lo, hi = by_pod.setdefault(pod, [int(ts.min()), int(ts.max())])
        by_pod[pod] = [min(lo, int(ts.min())), max(hi, int(ts.max()))]
    return [PodSpan(p, host, index, uuid, lo, hi) for p, (lo, hi) in by_pod.items()]


# --- dcgm-exporter text dumps ------------------------------------------------------------------

_SAMPLE_RE = re.compile(r"^[A-Za-z_:][A-Za-z0-9_:]*(\{|\s)")


def read_exporter_dump(
    path: Path, host: str, clock: LogClock, diag: Diagnostics, tz: str = "UTC"
) -> tuple[SampleChunk, list[PodSpan]]:
    """A file of dcgm-exporter /metrics scrapes, one after another (a time line without a zone
    in `tz`, as every zone-less time replay reads)."""
    check_file(path)
    where = str(path)
    zone = timeutil.tz_zone(tz)
    blocks: list[tuple[int | None, list[str]]] = [(None, [])]
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            s = line.strip()
            if not s or s.startswith("#") or _SAMPLE_RE.match(s):
                blocks[-1][1].append(line)
                continue
            try:
                at = timeutil.to_ms(timeutil.parse_instant(s, zone))
            except ValueError:
                diag.warn(where, None, "malformed_row", f"neither a metric nor a time: {s[:60]!r}")
                continue
            blocks.append((at, []))
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
    gather = Gather(host, where, diag)
    undated = 0
    for marker, lines in blocks:
        if not lines:
            continue
        try:
            families = list(text_string_to_metric_families("".join(lines)))
        except ValueError as e:
            diag.warn(where, None, "malformed_row", f"not Prometheus text: {e}")
            continue
        for fam in families:
            for smp in fam.samples:
                # (the parser names a counter's samples `<name>_total`: the energy counter's)
                name = smp.name[:-6] if smp.name.endswith("_total") else smp.name
                if name not in FIELDS:
                    continue
                key = (name, tuple(sorted(smp.labels.items())))
                k = seen.get(key, 0)
                seen[key] = k + 1
                if smp.timestamp is not None:
                    at = timeutil.to_ms(float(smp.timestamp))
                elif marker is not None:
                    at = marker
                else:
                    undated += 1
                    at = clock.need(path, "this dcgm-exporter dump") + k * clock.interval_ms
                gather.add(name, smp.labels, np.asarray([at]), np.asarray([float(smp.value)]))
    if undated:
        every = f"{clock.interval_ms / 1000:g} s"
        diag.note(where, f"scrapes without timestamps: dated from --start every {every}")
    return gather.chunk()


# --- Prometheus range queries ------------------------------------------------------------------


class PrometheusError(RuntimeError):
    """The Prometheus API refused a query or could not be reached (one line)."""


@dataclass
class Prometheus:
    """A Prometheus HTTP API (`/api/v1/query_range`, `/api/v1/query`): Prometheus, Thanos
    Query, Mimir or VictoriaMetrics. Retries what may pass (no connection, 5xx, 429)."""

    url: str
    timeout_s: float = 60.0
    headers: Mapping[str, str] = field(default_factory=dict)
    sleep: Callable[[float], None] = time.sleep
    queries: int = 0

    def _get(self, path: str, params: Mapping[str, str]) -> object:
        full = f"{self.url.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
        for attempt in range(RETRIES):
            self.queries += 1
            try:
                req = urllib.request.Request(full, headers=dict(self.headers))
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    body = json.loads(r.read())
                if body.get("status") != "success":
                    raise PrometheusError(f"{self.url}: {body.get('error', 'query failed')}")
                return body["data"]
            except urllib.error.HTTPError as e:
                if e.code < 500 and e.code != 429:
                    raise PrometheusError(f"{self.url}: HTTP {e.code}: {_error_text(e)}") from None
                why = f"HTTP {e.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                why = str(getattr(e, "reason", e))
            except (json.JSONDecodeError, KeyError):
                raise PrometheusError(f"{self.url}: not a Prometheus API answer") from None
            if attempt + 1 < RETRIES:
                log.warning("prometheus %s: %s; retrying", self.url, why)
                self.sleep(min(2.0**attempt, 10.0))
        raise PrometheusError(f"{self.url}: {why} after {RETRIES} tries")

    def range(
        self, query: str, start_s: float, end_s: float, step_s: float
    ) -> Iterable[tuple[dict[str, str], np.ndarray, np.ndarray]]:
        """(labels, epoch ms, values) per series, the window in chunks of at most MAX_POINTS steps
        (a series' pieces come one per chunk; `Gather` joins them)."""
        span = step_s * (MAX_POINTS - 1)
        t = start_s
        while t <= end_s:
            t_end = min(t + span, end_s)
            data = self._get(
                "/api/v1/query_range",
                {"query": query, "start": _num(t), "end": _num(t_end), "step": _num(step_s)},
            )
            for series in _matrix(data):
                vals = series.get("values") or []
                ts = np.asarray([float(v[0]) for v in vals])
                x = np.asarray([_value(v[1]) for v in vals])
                yield dict(series.get("metric") or {}), np.rint(ts * 1000).astype(np.int64), x
            t = t_end + step_s

    def instant(self, query: str, at_s: float) -> list[dict[str, str]]:
        """The label sets of an instant query's series."""
        data = self._get("/api/v1/query", {"query": query, "time": _num(at_s)})
        result = data.get("result", []) if isinstance(data, dict) else []
        return [dict(s.get("metric") or {}) for s in result]


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read()).get("error", e.reason))[:200]
    except (ValueError, OSError):
        return str(e.reason)


def _matrix(data: object) -> list[dict[str, Any]]:  # Any: the API's JSON
    if not isinstance(data, dict) or data.get("resultType") != "matrix":
        raise PrometheusError("a range query did not answer a matrix")
    return list(data.get("result") or [])


def _num(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


def _value(v: object) -> float:
    try:
        x = float(str(v))
    except ValueError:
        return math.nan
    return x if math.isfinite(x) else math.nan


def read_prometheus(
    prom: Prometheus,
    start_s: float,
    end_s: float,
    step_s: float,
    diag: Diagnostics,
    selector: str = "",
) -> tuple[SampleChunk, list[PodSpan]]:
    """The DCGM series of [start, end] at `step_s`, as one trace. `selector`: label matchers
    (`cluster="a",Hostname=~"node-1.*"`) added to every query.

    A plain range query repeats a series' last sample at each step for up to the lookback (5
    min) after the series ends where no staleness marker ended it (backfilled blocks, a
    remote-read store): a pod would seem to hold its GPU 5 minutes longer. So each step reads
    `last_over_time(...[step - 1 ms])`: a value only where a sample fell within that step (the
    1 ms: Prometheus 2 includes a range's left edge, so a sample exactly one step old would be
    read again)."""
    if end_s <= start_s:
        raise InputError("--end must be after --start")
    where = prom.url
    gather = Gather("prometheus", where, diag)
    sel = f"{{{selector}}}" if selector else ""
    window = f"{max(round(step_s * 1000) - 1, 1)}ms"
    for metric in FIELDS:
        for labels, ts, x in prom.range(f"last_over_time({metric}{sel}[{window}])", start_s, end_s, step_s):
            gather.add(metric, labels, ts, x)
    diag.note(where, f"{len(gather.gpus)} GPUs, {prom.queries} range queries at a {step_s:g} s step")
    return gather.chunk()


@dataclass
class PodFacts:
    """What kube-state-metrics knew of a pod: its labels (`label_*`) and owner references."""

    labels: dict[str, str] = field(default_factory=dict)
    owner_refs: list[dict[str, object]] = field(default_factory=list)


def pod_owners(prom: Prometheus, start_s: float, end_s: float) -> dict[tuple[str, str], PodFacts]:
    """(namespace, pod) -> its facts from kube-state-metrics' history in the same Prometheus
    (`kube_pod_labels`, `kube_pod_owner` over the window): pods that are gone since are known
    too, which the live Kubernetes API cannot say."""
    window = f"{max(int(end_s - start_s), 1)}s"
    out: dict[tuple[str, str], PodFacts] = {}
    for m in prom.instant(f"last_over_time(kube_pod_labels[{window}])", end_s):
        out.setdefault((m.get("namespace", ""), m.get("pod", "")), PodFacts()).labels = m
    for m in prom.instant(f"last_over_time(kube_pod_owner[{window}])", end_s):
        if not m.get("owner_name") or m.get("owner_name") == "<none>":
            continue
        ref: dict[str, object] = {"kind": m.get("owner_kind", ""), "name": m["owner_name"]}
        ref["controller"] = m.get("owner_is_controller") == "true"
        out.setdefault((m.get("namespace", ""), m.get("pod", "")), PodFacts()).owner_refs.append(ref)
    return out
