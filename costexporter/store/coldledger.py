"""The ledger's sealed part, read for the API: a window's amounts and steps per job from the
archive's files, in the layout the API reads Redis in (a row per job, columns `ledger.PACKED`).

Only the files the manifest names are read, each checked against its hash (a damaged or missing
one raises `ArchiveError`: the API answers 503, never a short bill). A file holds one day: a day
inside the window is read once and kept as each job's day sums (by the file's hash, which names
its content), so a year's window costs the days' sums, not their rows; a day the window cuts is
summed from its rows, the 5-minute buckets inside.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from costexporter.core.archive import DAY_S, STEPS_ROW, Entry, Manifest, day_start
from costexporter.core.model import CATEGORIES
from costexporter.store.archive import MANIFEST, Archive, ArchiveError

AMOUNTS = len(CATEGORIES) * 3  # the columns of `ledger.PACKED`
WIDTH = AMOUNTS + 4  # then completed steps, their tokens, voided steps, their tokens
_CAT = {c: i for i, c in enumerate(CATEGORIES)}
FILES_KEPT = 16  # files kept as columns (a window cuts at most its first and last day)
# An incident is sealed in the day it began: a window's are read from this long before it
INCIDENT_LEAD_S = 2 * DAY_S


@dataclass
class ColdWindow:
    """Per job (the order asked): net amounts, then the four step figures; the price versions;
    the job's attributes as its latest day in the window was sealed (JSON; "" if none)."""

    jobs: list[str]
    sums: np.ndarray  # (jobs, WIDTH) int64
    versions: list[set[str]]
    attributes: list[str]


Part = tuple[np.ndarray, set[str], str]  # a job's sums, price versions and attributes


_NET = (("gpu_ms", "voided_gpu_ms"), ("energy_mj", "voided_energy_mj"), ("cost_micro", "voided_cost_micro"))
_STEPS = ("steps", "step_tokens", "voided_steps", "voided_tokens")


class _Sums:
    """One file's rows, summed by Arrow's group-by (in C++: a file of ~10,000 rows in about a
    millisecond) by job and category over any run of its buckets."""

    def __init__(self, table: Any) -> None:
        import pyarrow.compute as pc

        self.pc = pc
        t = table
        cols = {"job": t.column("job"), "category": t.column("category"), "bucket": t.column("bucket_start")}
        for u, (plain, voided) in enumerate(_NET):
            cols[f"n{u}"] = pc.subtract(t.column(plain), t.column(voided))
        for name in _STEPS:
            cols[name] = t.column(name)
        cols["pv"] = t.column("price_version")
        cols["attributes"] = t.column("attributes")
        self.t = type(t).from_pydict(cols)

    def window(self, start: int, end: int) -> dict[str, Part]:
        """Each job's sums over the buckets starting in [start, end), its price versions and
        attributes."""
        pc, t = self.pc, self.t
        bucket = t.column("bucket")
        mm = pc.min_max(bucket)  # a whole day's file inside the window: no filter
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if lo is None or not (start <= lo and hi < end):
            t = t.filter(pc.and_(pc.greater_equal(bucket, start), pc.less(bucket, end)))
        out: dict[str, Part] = {}
        if t.num_rows == 0:
            return out
        sums = [(f"n{u}", "sum") for u in range(3)] + [(n, "sum") for n in _STEPS]
        by = t.group_by(["job", "category"], use_threads=False).aggregate(sums).to_pydict()
        vecs: dict[str, np.ndarray] = {}
        for k, (job, cat) in enumerate(zip(by["job"], by["category"], strict=True)):
            v = vecs.get(job)
            if v is None:
                v = vecs[job] = np.zeros(WIDTH, np.int64)
            if cat == STEPS_ROW:
                for a, n in enumerate(_STEPS):
                    v[AMOUNTS + a] += by[f"{n}_sum"][k]
            elif cat in _CAT:
                at = 3 * _CAT[cat]
                for u in range(3):
                    v[at + u] += by[f"n{u}_sum"][k]
        meta = (
            t.group_by("job", use_threads=False)
            .aggregate([("pv", "distinct"), ("attributes", "max")])
            .to_pydict()
        )
        for job, pvs, attrs in zip(meta["job"], meta["pv_distinct"], meta["attributes_max"], strict=True):
            out[job] = (vecs[job], {x for x in pvs if x}, attrs or "")
        return out


class ColdLedger:
    """The archive of one cluster, as the API reads it. Thread-safe; keeps at most `max_days`
    days' sums (a day's sums are a few hundred bytes per job)."""

    def __init__(self, archive: Archive, cluster: str, max_days: int = 4096) -> None:
        self.archive = archive
        self.cluster = cluster
        self.max_days = max_days
        self._days: OrderedDict[str, dict[str, Part]] = OrderedDict()
        self._files: OrderedDict[str, _Sums] = OrderedDict()
        self._incidents: OrderedDict[str, dict[str, list[object]]] = OrderedDict()  # file -> job -> records
        self._manifest: tuple[bytes, Manifest] | None = None
        self._lock = threading.Lock()

    def manifest(self) -> Manifest:
        """The cluster's manifest, parsed again only when its bytes changed."""
        raw = self.archive.get(self.cluster, MANIFEST) or b""
        with self._lock:
            if self._manifest is not None and self._manifest[0] == raw:
                return self._manifest[1]
        if not raw:  # read only for days that left Redis: they must be here
            raise ArchiveError(
                f"the archive {self.archive.url} holds no manifest of cluster {self.cluster!r}: the days "
                "that left Redis cannot be read (is --cluster the name the sealer was given?)"
            )
        try:
            m = Manifest.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ArchiveError(
                f"the manifest of cluster {self.cluster!r} in {self.archive.url} is unreadable: {e}"
            ) from None
        with self._lock:
            self._manifest = (raw, m)
        return m

    def _sums(self, entry: Entry) -> _Sums:
        """A file's rows as columns, kept for the few files last cut by a window (a series at
        5-minute points cuts the same day many times)."""
        with self._lock:
            got = self._files.get(entry.sha256)
            if got is not None:
                self._files.move_to_end(entry.sha256)
                return got
        got = _Sums(self.archive.table(self.cluster, entry))
        with self._lock:
            self._files[entry.sha256] = got
            while len(self._files) > FILES_KEPT:
                self._files.popitem(last=False)
        return got

    def _day(self, entry: Entry) -> dict[str, Part]:
        with self._lock:
            got = self._days.get(entry.sha256)
            if got is not None:
                self._days.move_to_end(entry.sha256)
                return got
        d0 = day_start(entry.path.split("/", 1)[0].removeprefix("date="))
        got = self._sums(entry).window(d0, d0 + DAY_S)
        with self._lock:
            self._days[entry.sha256] = got
            while len(self._days) > self.max_days:
                self._days.popitem(last=False)
        return got

    def window(self, jobs: list[str], start: int, end: int) -> ColdWindow:
        """The jobs' sums over the 5-minute buckets starting in [start, end), from the archive."""
        return self._window(self.manifest(), jobs, start, end)

    def _window(self, manifest: Manifest, jobs: list[str], start: int, end: int) -> ColdWindow:
        at = {j: i for i, j in enumerate(jobs)}
        sums = np.zeros((len(jobs), WIDTH), np.int64)
        versions: list[set[str]] = [set() for _ in jobs]
        attributes = ["" for _ in jobs]
        if end <= start or not jobs:
            return ColdWindow(jobs, sums, versions, attributes)
        for key, entry in sorted(manifest.entries.items()):  # by day: the latest attributes win
            d0 = day_start(key.split("/", 1)[0])
            if d0 + DAY_S <= start or d0 >= end:
                continue
            if not at.keys() & set(entry.jobs):
                continue
            part = (
                self._day(entry)
                if start <= d0 and d0 + DAY_S <= end
                else self._sums(entry).window(start, end)
            )
            for j, (v, pv, attrs) in part.items():
                i = at.get(j)
                if i is not None:
                    sums[i] += v
                    versions[i] |= pv
                    attributes[i] = attrs or attributes[i]
        return ColdWindow(jobs, sums, versions, attributes)

    def warm(self) -> int:
        """Read every sealed day once (its sums kept, as a window reads them): at the API's
        start, off the request path, so the first bill over a year is not the one that waits.
        Returns the days read."""
        entries = list(self.manifest().entries.values())[-self.max_days :]
        for e in entries:
            self._day(e)
        return len(entries)

    def incidents(self, jobs: list[str], start: int, end: int) -> dict[str, list[object]]:
        """The jobs' incidents as their agents stored them, of the sealed days from INCIDENT_LEAD
        before `start` (a stretch that began earlier and runs into the window) to `end`: the
        records, per job, for the reader to check and merge as it does Redis's."""
        out: dict[str, list[object]] = {j: [] for j in jobs}
        wanted = set(jobs)
        for key, entry in sorted(self.manifest().entries.items()):
            d0 = day_start(key.split("/", 1)[0])
            if d0 + DAY_S <= start - INCIDENT_LEAD_S or d0 >= end or not wanted & set(entry.jobs):
                continue
            for job, records in self._day_incidents(entry).items():
                if job in wanted:
                    out[job] += records
        return out

    def _day_incidents(self, entry: Entry) -> dict[str, list[object]]:
        """A file's incident records by job, kept as its sums are (by the file's hash): a bill
        asked again reads no file again."""
        with self._lock:
            got = self._incidents.get(entry.sha256)
            if got is not None:
                self._incidents.move_to_end(entry.sha256)
                return got
        t = self.archive.table(self.cluster, entry)
        got = {}
        for job, text in zip(t.column("job").to_pylist(), t.column("incident").to_pylist(), strict=True):
            if text:
                got.setdefault(job, []).append(json.loads(text)["record"])
        with self._lock:
            self._incidents[entry.sha256] = got
            while len(self._incidents) > self.max_days:
                self._incidents.popitem(last=False)
        return got

    def jobs(self, start: int, end: int) -> list[str]:
        """The jobs sealed with a day in [start, end) (the manifest's lists: no file read)."""
        found: set[str] = set()
        for key, entry in self.manifest().entries.items():
            d0 = day_start(key.split("/", 1)[0])
            if d0 + DAY_S > start and d0 < end:
                found.update(entry.jobs)
        return sorted(found)

    def series(self, job: str, starts: list[int], secs: int, until: int) -> np.ndarray:
        """The job's sums per point [b, b + secs) of `starts`, cut at `until` (the ledger's start
        in Redis), from the archive: a row per point."""
        out = np.zeros((len(starts), WIDTH), np.int64)
        manifest = self.manifest()
        for n, b in enumerate(starts):
            if b >= until:
                break
            out[n] = self._window(manifest, [job], b, min(b + secs, until)).sums[0]
        return out
