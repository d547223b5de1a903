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

import numpy as np

from costexporter.core.archive import COLUMNS, DAY_S, STEPS_ROW, Entry, Manifest, day_start
from costexporter.core.model import CATEGORIES
from costexporter.store.archive import MANIFEST, Archive, ArchiveError

AMOUNTS = len(CATEGORIES) * 3  # the columns of `ledger.PACKED`
WIDTH = AMOUNTS + 4  # then completed steps, their tokens, voided steps, their tokens
_CAT = {c: i for i, c in enumerate(CATEGORIES)}
_NAMES = [n for n, _ in COLUMNS]
FILES_KEPT = 16  # files kept as columns (a window cuts at most its first and last day)


@dataclass
class ColdWindow:
    """Per job (the order asked): net amounts, then the four step figures; the price versions;
    the job's attributes as its latest day in the window was sealed (JSON; "" if none)."""

    jobs: list[str]
    sums: np.ndarray  # (jobs, WIDTH) int64
    versions: list[set[str]]
    attributes: list[str]


Part = tuple[np.ndarray, set[str], str]  # a job's sums, price versions and attributes


class _Sums:
    """One file's rows as columns: per row its job's index, its bucket and a WIDTH vector."""

    def __init__(
        self,
        jobs: list[str],
        job_at: np.ndarray,
        bucket: np.ndarray,
        vec: np.ndarray,
        pv: list[str],
        attrs: dict[str, str],
    ):
        self.jobs = jobs
        self.job_at = job_at
        self.bucket = bucket
        self.vec = vec
        self.pv = pv  # per row
        self.attrs = attrs  # per job: its attributes (JSON) as the day was sealed

    @classmethod
    def of(cls, data: object) -> _Sums:
        t = data  # a pyarrow Table in COLUMNS' layout
        col = {n: t.column(n).to_numpy(zero_copy_only=False) for n in _NAMES}  # type: ignore[attr-defined]
        names = col["job"].astype(object)
        jobs, job_at = np.unique(names, return_inverse=True)
        n = len(names)
        vec = np.zeros((n, WIDTH), np.int64)
        cats = col["category"]
        steps = cats == STEPS_ROW
        for c, i in _CAT.items():
            rows = cats == c
            if rows.any():
                for u, (plain, voided) in enumerate(
                    (
                        ("gpu_ms", "voided_gpu_ms"),
                        ("energy_mj", "voided_energy_mj"),
                        ("cost_micro", "voided_cost_micro"),
                    )
                ):
                    vec[rows, 3 * i + u] = col[plain][rows] - col[voided][rows]
        for k, name in enumerate(("steps", "step_tokens", "voided_steps", "voided_tokens")):
            vec[steps, AMOUNTS + k] = col[name][steps]
        pv = [str(x) for x in col["price_version"].tolist()]
        attrs = dict(zip(names.tolist(), col["attributes"].tolist(), strict=True))
        job_list = [str(j) for j in jobs]
        return cls(job_list, job_at.reshape(-1), col["bucket_start"].astype(np.int64), vec, pv, attrs)

    def window(self, start: int, end: int) -> dict[str, Part]:
        """Each job's sums over the buckets starting in [start, end), its price versions and
        attributes."""
        inside = (self.bucket >= start) & (self.bucket < end)
        out: dict[str, Part] = {}
        if not inside.any():
            return out
        acc = np.zeros((len(self.jobs), WIDTH), np.int64)
        np.add.at(acc, self.job_at[inside], self.vec[inside])
        seen = np.zeros(len(self.jobs), bool)
        seen[self.job_at[inside]] = True
        versions: dict[int, set[str]] = {}
        for i in np.flatnonzero(inside).tolist():
            if self.pv[i]:
                versions.setdefault(int(self.job_at[i]), set()).add(self.pv[i])
        for i in np.flatnonzero(seen).tolist():
            j = self.jobs[i]
            out[j] = (acc[i], versions.get(i, set()), self.attrs.get(j) or "")
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
        else:
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
        got = _Sums.of(self.archive.table(self.cluster, entry))
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
