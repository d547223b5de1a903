"""Retention: Redis keeps the hot window of the ledger; what lies before it lives in the archive.

`expire` moves the ledger's start (`keys.hot_from_key`, a UTC day) up to the hot window's, as
far as every job's days before it are in the archive exactly as Redis holds them (the file read
back and its hash checked, the job's rows compared), then drops them: the buckets of every
resolution, the bucket indexes, the rollup records and the step members before the start,
keeping the last rollup record and step member before it (the base records: a window that
starts at the ledger's start subtracts them, so cumulative figures stay exact).

The start moves first, the drop comes after: a reader between the two reads the days before the
start from the archive (`store/coldledger.py`), which holds them, and Redis from the start on,
so a crash between the two, or a second expirer, leaves nothing half-read. A day that is not
sealed yet, or that Redis holds otherwise than the archive (booked into after its seal), holds
the start back, with a line saying which; nothing is dropped that the archive does not hold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from costexporter.core.archive import (
    DAY_S,
    INCIDENT,
    INCIDENTS_SCHEMA,
    Row,
    booked,
    day_start,
    entry_key,
    shard_of,
)
from costexporter.core.buckets import RESOLUTIONS
from costexporter.services.sealer import Sealer
from costexporter.store import keys
from costexporter.store.archive import MANIFEST, ArchiveError
from costexporter.store.ledger_read import hot_from

log = logging.getLogger("costexporter.retention")

DEFAULT_HOT_DAYS = 35  # the longest window finance reads of one month, and a few days over


@dataclass
class ExpireReport:
    """What one expiry did: the ledger's start before and after, the jobs trimmed, the keys and
    members dropped, and why the start could not move further (one line per job and day)."""

    before: int = 0
    hot_from: int = 0
    jobs: int = 0
    keys: int = 0
    members: int = 0
    held: list[str] = field(default_factory=list)

    def line(self) -> str:
        from costexporter.core.archive import day_of

        start = day_of(self.hot_from) if self.hot_from else "the first day"
        return (
            f"the ledger in Redis starts at {start}; {self.jobs} job(s) trimmed: {self.keys:,} key(s) "
            f"and {self.members:,} record(s) dropped; {len(self.held)} day(s) held it back"
        )


class Retention:
    """Drops what the archive holds from Redis, up to the hot window's start."""

    def __init__(self, sealer: Sealer, hot_days: int = DEFAULT_HOT_DAYS) -> None:
        if hot_days < 1:
            raise ValueError("the hot window is at least one day")
        self.sealer = sealer
        self.r = sealer.r
        self.prefix = sealer.prefix
        self.hot_days = hot_days

    def expire(self, now_s: int) -> ExpireReport:
        report = ExpireReport(before=hot_from(self.r, self.prefix))
        target = (now_s // DAY_S - self.hot_days) * DAY_S
        jobs = self.sealer.jobs()  # (one pass over the keyspace for both steps)
        cut = max(target, report.before)
        if target > report.before:
            cut = self._held_back(jobs, target, report)
        report.hot_from = max(cut, report.before)
        if report.hot_from > report.before:
            self._move_start(report.hot_from)
        if report.hot_from:
            for job in jobs:
                dropped = self.drop(job, report.hot_from)
                if dropped[0] or dropped[1]:
                    report.jobs += 1
                    report.keys += dropped[0]
                    report.members += dropped[1]
        return report

    def _held_back(self, jobs: list[str], target: int, report: ExpireReport) -> int:
        """How far the start can move towards `target`: to the first day of any job that the
        archive does not hold as Redis does."""
        archive, cluster = self.sealer.archive, self.sealer.cluster
        if archive.get(cluster, MANIFEST) is None:
            report.held.append(
                f"the archive holds no manifest of cluster {cluster!r}: run `archive seal` first"
            )
            return 0
        manifest = archive.manifest(cluster)
        files: dict[str, dict[str, list[Row]]] = {}  # entry key -> job -> its sealed rows
        damaged: set[str] = set()
        cut = target

        def kept(day: str) -> bool:  # the days before the start hold only base records
            return day_start(day) < report.before

        for job in jobs:
            shard = shard_of(job, self.sealer.shards)
            for day, rows in sorted(self.sealer.buckets(job, target, kept).items()):
                d0 = day_start(day)
                if d0 >= cut:
                    break
                key = entry_key(day, shard)
                if key not in files:
                    files[key] = {}
                    entry = manifest.entries.get(key)
                    if entry is not None:
                        try:
                            for r in archive.read(cluster, entry):
                                files[key].setdefault(r[3], []).append(r)
                        except ArchiveError as e:
                            report.held.append(f"{day} shard {shard}: {e}")
                            damaged.add(key)
                why = None
                if key in damaged:
                    why = "its file is damaged"
                elif job not in files[key]:
                    why = "not sealed"
                elif booked(files[key][job]) != booked(_as_sealed(rows, files[key][job])):
                    why = "booked into since it was sealed: seal again"
                if why is not None:
                    report.held.append(f"{job} {day}: {why}")
                    cut = d0
                    break
        return cut

    def _move_start(self, cut: int) -> None:
        """Set the ledger's start to `cut`, never back (two expirers at once: the later start)."""
        k = keys.hot_from_key(self.prefix)
        with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(k)
                    if hot_from(pipe, self.prefix) >= cut:  # type: ignore[arg-type]
                        pipe.unwatch()
                        return
                    pipe.multi()
                    pipe.set(k, str(cut))
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def drop(self, job: str, cut: int) -> tuple[int, int]:
        """Drop the job's ledger before `cut` but the base records; (keys, members) dropped. In
        one MULTI (the job's keys share its hash tag): a reader sees it before or after."""
        p = self.prefix
        pipe = self.r.pipeline(transaction=False)
        for res in RESOLUTIONS:
            pipe.zrangebyscore(keys.index_key(p, job, res), "-inf", f"({cut}")
        sets = (keys.rollup_key(p, job), keys.steps_key(p, job), keys.voids_key(p, job))
        for k in sets:
            pipe.zrevrangebyscore(k, f"({cut}", "-inf", start=0, num=1, withscores=True)
        got = pipe.execute(raise_on_error=False)
        olds = {res: got[i] for i, res in enumerate(RESOLUTIONS) if isinstance(got[i], list)}
        bases = got[len(RESOLUTIONS) :]
        if not any(olds.values()) and not any(isinstance(b, list) and b for b in bases):
            return 0, 0
        tx = self.r.pipeline(transaction=True)
        n_keys = 0
        for res, starts in olds.items():
            if starts:
                tx.delete(*(keys.bucket_key(p, job, res, s) for s in starts))
                tx.zremrangebyscore(keys.index_key(p, job, res), "-inf", f"({cut}")
                n_keys += len(starts)
        for k, base in zip(sets, bases, strict=True):
            if isinstance(base, list) and base:  # all below the base's score go; the base stays
                tx.zremrangebyscore(k, "-inf", f"({base[0][1]!r}")
        done = tx.execute()
        # first a DEL and an index's ZREMRANGEBYSCORE per resolution trimmed, then the sets'
        members = sum(done[2 * sum(1 for s in olds.values() if s) :])
        return n_keys, members


def _as_sealed(rows: list[Row], sealed: list[Row]) -> list[Row]:
    """What Redis holds of a job-day, as a file of the sealed rows' schema would hold it: a day
    sealed before incidents were (schema 1-2) is compared without them (they stay in Redis)."""
    if sealed and sealed[0][0] < INCIDENTS_SCHEMA:
        return [r for r in rows if not r[INCIDENT]]
    return rows
