"""Restore: the hot window of the ledger rebuilt in Redis from the archive, after Redis lost it
(restarted empty, a new Redis): `costexporter archive restore`.

Each sealed job-day from the window's start on is written back as the agents wrote it
(`ledger.queue_amounts`: the buckets of every resolution, the rollup, the total; the rollback
corrections as corrections, each bucket at its price version), its steps as members of the step
sets (one per step, at the middle of its bucket, carrying the job's cumulative tokens), and the
job's meta and attribution as sealed where Redis has none; the incidents of every sealed day
(Redis keeps them whatever its window) as each agent stored them, cause and cost included, where
Redis has none of that name. A job-day Redis already holds (the agents booked it again) is left
as it is and said: a restore never counts a bucket twice, and running it again changes nothing.
A job restored from nothing gets its days before the window in its all-time total too, and the
ledger's start is set to the window's: the API reads the older days from the archive.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from costexporter.core.archive import DAY_S, INCIDENT, STEPS_ROW, UNITS, Row, day_of, day_start, incident_of
from costexporter.core.attribution import GRANTABLE, Attribution
from costexporter.core.model import CATEGORIES
from costexporter.store import keys, ledger
from costexporter.store.archive import Archive
from costexporter.store.client import RedisClient
from costexporter.store.coldledger import AMOUNTS, ColdLedger
from costexporter.store.ledger_read import hot_from

log = logging.getLogger("costexporter.restore")

_CAT = {c: i for i, c in enumerate(CATEGORIES)}
SOURCE = "restored from the archive"


@dataclass
class RestoreReport:
    """What one restore wrote: job-days restored, those Redis already held (left as they
    were), the rows and steps written, and the ledger's start it set (0: none)."""

    restored: int = 0
    kept: list[str] = field(default_factory=list)
    rows: int = 0
    steps: int = 0
    incidents: int = 0
    hot_from: int = 0

    def line(self) -> str:
        start = f"; the ledger in Redis starts at {day_of(self.hot_from)}" if self.hot_from else ""
        return (
            f"restored {self.restored} job-day(s), {self.rows:,} rows, {self.steps:,} steps and "
            f"{self.incidents:,} incidents; "
            f"{len(self.kept)} job-day(s) Redis held already, left as they were{start}"
        )


class Restore:
    def __init__(self, client: RedisClient, prefix: str, archive: Archive, cluster: str) -> None:
        self.r = client
        self.prefix = prefix
        self.archive = archive
        self.cluster = cluster

    def restore(self, from_s: int) -> RestoreReport:
        """Write every sealed job-day from `from_s` (a UTC day's start) on back into Redis."""
        report = RestoreReport()
        cold = ColdLedger(self.archive, self.cluster)
        manifest = cold.manifest()
        days = sorted((k, e) for k, e in manifest.entries.items() if day_start(k.split("/", 1)[0]) >= from_s)
        # Every job sealed, the window's or not: the API lists the jobs Redis's index holds.
        last: dict[str, int] = {}
        for k, e in manifest.entries.items():
            for j in e.jobs:
                last[j] = max(last.get(j, 0), day_start(k.split("/", 1)[0]) + DAY_S)
        jobs = sorted(last)
        # Before the window: each job's sums (its total and its steps' cumulative tokens so far)
        # and its attributes as last sealed.
        before = cold.window(jobs, 0, from_s) if jobs else None
        fresh = self._fresh(jobs)
        cum = {j: [0, 0] for j in jobs}  # the cumulative tokens of the steps and the voids
        attrs: dict[str, str] = {}
        if before is not None:
            for i, j in enumerate(jobs):
                cum[j] = [int(before.sums[i, AMOUNTS + 1]), int(before.sums[i, AMOUNTS + 3])]
                if before.attributes[i]:
                    attrs[j] = before.attributes[i]
        held = self._held_days(jobs, [day_start(k.split("/", 1)[0]) for k, _ in days])
        # Redis lost everything before the window: the window's start becomes the ledger's, and
        # each step set gets a base member just before it (its cumulative tokens so far), which
        # a window from the start on subtracts, as it would the last member before it.
        lost = self._nothing_before(jobs, from_s)
        # First the totals of the jobs restored from nothing (stopped after this, a second run
        # finds them not fresh: never added twice), then the days.
        pipe = self.r.pipeline(transaction=False)
        for i, job in enumerate(jobs):
            if job in fresh and before is not None and before.sums[i, :AMOUNTS].any():
                self._queue_total(pipe, job, before.sums[i, :AMOUNTS])
            if lost:
                for k, at in ((keys.steps_key(self.prefix, job), 0), (keys.voids_key(self.prefix, job), 1)):
                    if cum[job][at]:
                        pipe.zadd(k, {f"a{from_s}.base:{cum[job][at]}": from_s - 1})
            if job != ledger.UNASSIGNED_JOB:
                pipe.zadd(keys.jobs_key(self.prefix), {job: last[job]}, gt=True)
        pipe.execute()
        in_window = {k for k, _ in days}
        for key, entry in sorted(manifest.entries.items()):
            d0 = day_start(key.split("/", 1)[0])
            by_job: dict[str, list[Row]] = {}
            for r in self.archive.read(self.cluster, entry):
                by_job.setdefault(r[3], []).append(r)
            for job, rows in sorted(by_job.items()):
                # Incidents of every day: Redis keeps them whatever its window (retention).
                report.incidents += self._write_incidents(job, rows)
                if key not in in_window:
                    continue
                if (job, d0) in held:
                    report.kept.append(f"{job} {key.split('/', 1)[0]}")
                    continue
                report.steps += self._write_day(job, rows, cum[job])
                report.rows += len(rows)
                report.restored += 1
                attrs[job] = rows[-1][18] or attrs.get(job, "")
        for job, text in attrs.items():
            self._restore_meta(job, text)
        if lost and hot_from(self.r, self.prefix) < from_s:
            self.r.set(keys.hot_from_key(self.prefix), str(from_s))
            report.hot_from = from_s
        return report

    def _fresh(self, jobs: list[str]) -> set[str]:
        """The jobs of which Redis holds no ledger at all (no all-time total)."""
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.exists(keys.total_key(self.prefix, j))
        return {j for j, n in zip(jobs, pipe.execute(), strict=True) if not n}

    def _held_days(self, jobs: list[str], starts: list[int]) -> set[tuple[str, int]]:
        """(job, day) that Redis holds a bucket, a step or a void of already."""
        days = sorted(set(starts))
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            for d in days:
                pipe.zcount(keys.index_key(self.prefix, j, "5m"), d, f"({d + DAY_S}")
                pipe.zcount(keys.steps_key(self.prefix, j), d, f"({d + DAY_S}")
                pipe.zcount(keys.voids_key(self.prefix, j), d, f"({d + DAY_S}")
        got = iter(pipe.execute())
        return {(j, d) for j in jobs for d in days if next(got) + next(got) + next(got)}

    def _nothing_before(self, jobs: list[str], from_s: int) -> bool:
        pipe = self.r.pipeline(transaction=False)
        for j in jobs:
            pipe.zcount(keys.index_key(self.prefix, j, "5m"), "-inf", f"({from_s}")
        return not any(pipe.execute())

    def _write_incidents(self, job: str, rows: list[Row]) -> int:
        """A job-day's incidents as each agent stored them, where Redis has none of that name
        (the agents' own record, written since, wins). Returns how many were written."""
        incidents = [x for x in map(incident_of, rows) if x is not None]
        if not incidents:
            return 0
        pipe = self.r.pipeline(transaction=True)
        for agent, name, record in incidents:
            pipe.hsetnx(keys.incidents_key(self.prefix, job, agent), name, json.dumps(record))
            pipe.sadd(keys.incident_index_key(self.prefix, job), agent)
        return sum(1 for i, x in enumerate(pipe.execute()) if i % 2 == 0 and x)

    def _write_day(self, job: str, rows: list[Row], cum: list[int]) -> int:
        """One job-day in one MULTI: its amounts as the agents book them, its steps. Returns the
        steps written."""
        valid: dict[int, np.ndarray] = {}
        voided: dict[int, np.ndarray] = {}
        version: dict[int, str] = {}
        done: dict[str, float] = {}
        undone: dict[str, float] = {}
        for r in sorted(rows, key=lambda r: (r[4], r[5])):
            if r[INCIDENT]:  # an incident's row (`_write_incidents`): no amounts
                continue
            b = r[4]
            if r[12]:
                version[b] = r[12]
            if r[5] == STEPS_ROW:
                for n, tokens, members, at in ((r[13], r[14], done, 0), (r[15], r[16], undone, 1)):
                    for k in range(n):  # the bucket's last step carries the bucket's tokens
                        cum[at] += tokens if k == n - 1 else 0
                        members[f"a{b}.{k:07d}:{cum[at]}"] = b + 150
                continue
            i = _CAT.get(r[5])
            if i is None:
                continue
            valid.setdefault(b, np.zeros((len(CATEGORIES), len(UNITS)), np.int64))[i] = r[6:9]
            if any(r[9:12]):
                voided.setdefault(b, np.zeros((len(CATEGORIES), len(UNITS)), np.int64))[i] = r[9:12]
        for b in version.keys() - valid.keys():  # a bucket booked with nothing in it: its price
            valid[b] = np.zeros((len(CATEGORIES), len(UNITS)), np.int64)
        pipe = self.r.pipeline(transaction=True)
        price = lambda start: version.get(start, "")  # noqa: E731  (a price changes on a bucket's bound only)
        if valid:
            ledger.queue_amounts(pipe, self.prefix, job, valid, price)
        if voided:
            ledger.queue_amounts(pipe, self.prefix, job, voided, price, voided=True)
        if done:
            pipe.zadd(keys.steps_key(self.prefix, job), done)
        if undone:
            pipe.zadd(keys.voids_key(self.prefix, job), undone)
        pipe.execute()
        if job != ledger.UNASSIGNED_JOB and (valid or done):  # (across jobs: not in the MULTI)
            last = max([*valid, *(int(s) for s in done.values())]) + 300
            self.r.zadd(keys.jobs_key(self.prefix), {job: last}, gt=True)
        return len(done)

    def _queue_total(self, pipe: Any, job: str, net: np.ndarray) -> None:
        """A job restored from nothing: its days before the window into its all-time total
        (net of their corrections)."""
        k = keys.total_key(self.prefix, job)
        for c, i in _CAT.items():
            for u, unit in enumerate(UNITS):
                v = int(net[3 * i + u])
                if v:
                    pipe.hincrby(k, ledger.amount_field(c, unit), v)

    def _restore_meta(self, job: str, text: str) -> None:
        """The job's meta and attribution as sealed, where Redis has none (a trainer that posted
        again, an agent that attributed it again, win)."""
        if job == ledger.UNASSIGNED_JOB or not text:
            return
        try:
            meta = json.loads(text)
        except ValueError:
            return
        if not isinstance(meta, dict):
            return
        owners = {k: v for k, v in meta.items() if k in GRANTABLE and isinstance(v, str | int | float)}
        data = {k: str(v) for k, v in meta.items() if k not in GRANTABLE and isinstance(v, str | int | float)}
        figures = keys.figures_key(self.prefix, job)
        has_attr = any(self.r.hmget(figures, ledger.attribution_fields()))
        pipe = self.r.pipeline(transaction=True)
        if data and not self.r.exists(keys.meta_key(self.prefix, job)):
            pipe.hset(keys.meta_key(self.prefix, job), mapping=data)
        if owners and not has_attr:
            attr = Attribution(tuple(owners.items()), tuple((k, SOURCE) for k in owners))
            ledger.queue_attribution(pipe, self.prefix, job, attr)
        pipe.execute()
