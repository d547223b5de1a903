"""The sealer: writes each day of the ledger that can no longer change to the archive, as Parquet
(`core/archive.py`, `store/archive.py`). Its own role: it reads the ledger and the watermarks
(`costexporter acl --role sealer`) and writes nothing in Redis, so running it twice, two at once
or after a crash half-way only writes the same files again.

A day of a job is sealed once every agent that books the job has booked past the day's end and
the seal delay has passed, or, its agents having stopped short of it, once the longest wait has
(`archive.sealable_before`). A (day, shard) file is written again only when its content changed
(a job whose agents were behind the first time, a late booking): the manifest then supersedes the
earlier file with the new version. Every file written is read back and its hash checked before
the manifest names it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from costexporter.core.archive import (
    DAY_S,
    Entry,
    Incident,
    Manifest,
    Row,
    Totals,
    day_of,
    day_start,
    entry_key,
    file_path,
    incident_rows,
    rows_of_bucket,
    sealable_before,
    shard_of,
    step_rows,
    with_attributes,
)
from costexporter.store import keys, ledger_read, redisconn, untrusted
from costexporter.store.archive import MANIFEST, Archive, ArchiveError, parquet_bytes, sha256
from costexporter.store.client import Pipeline, RedisClient

log = logging.getLogger("costexporter.sealer")

DEFAULT_SHARDS = 16
# An incident is closed once every agent of its job booked this far past its end: an agent
# extends an open stretch by a piece within seconds of it, never this late. A day holding an
# incident not yet closed is sealed as it stands, and again until it is (never final before).
CLOSED_MS = 15 * 60 * 1000
DEFAULT_DELAY_S = 3600  # past every watermark: a late agent's catch-up, an event lag
DEFAULT_MAX_WAIT_S = 2 * 86400  # a job whose agents stopped short of a day's end (it ended)
DEFAULT_ORPHAN_AGE_S = 3600.0  # a file no manifest names, this old, is no sealer's in flight


@dataclass
class SealReport:
    """What one seal did: files written (new or new versions), files already sealed as they
    are, jobs left for later (their agents behind), and the rows written."""

    written: list[str] = field(default_factory=list)
    unchanged: int = 0
    waiting: list[str] = field(default_factory=list)
    rows: int = 0
    swept: list[str] = field(default_factory=list)  # files no manifest named, removed

    def line(self) -> str:
        return (
            f"sealed {len(self.written)} file(s), {self.rows:,} rows; {self.unchanged} already sealed; "
            f"{len(self.waiting)} job(s) waiting for their agents"
            + (f"; {len(self.swept)} file(s) no manifest named removed" if self.swept else "")
        )


class Sealer:
    def __init__(
        self,
        client: RedisClient,
        prefix: str,
        archive: Archive,
        cluster: str,
        *,
        shards: int = DEFAULT_SHARDS,
        delay_s: int = DEFAULT_DELAY_S,
        max_wait_s: int = DEFAULT_MAX_WAIT_S,
        orphan_age_s: float = DEFAULT_ORPHAN_AGE_S,
    ) -> None:
        self.r = client
        self.prefix = prefix
        self.archive = archive
        self.cluster = cluster
        self.shards = shards
        self.delay_s = delay_s
        self.max_wait_s = max_wait_s
        self.orphan_age_s = orphan_age_s
        self._dirty = False  # the manifest changed without a file written (a job now final)

    def jobs(self) -> list[str]:
        """Every job with a ledger (the time of no job's too): found by its 5-minute bucket
        index or its steps, in one pass over the keyspace, not by the trainers' jobs index
        (which a trainer can write: no job hides from the seal that way)."""
        tails = (keys.index_key("", "", "5m").split("}", 1)[1], keys.steps_key("", "").split("}", 1)[1])
        found = self._by_tag(keys.ledger_key(self.prefix, "*", "[is][nt]*"))  # index:*, steps, incidents...
        return sorted(j for j, ks in found.items() if any(_name(k).endswith(tails) for k in ks))

    def _by_tag(self, pattern: str) -> dict[str, list[Any]]:
        """The keys matching `pattern`, by the job in their hash tag."""
        out: dict[str, list[Any]] = {}
        for k in self.r.scan_iter(match=pattern, count=1000):
            name = _name(k)
            out.setdefault(name[name.index("{") + 1 : name.rindex("}")], []).append(k)
        return out

    def watermarks_ms(self) -> dict[str, list[int]]:
        """Every agent's booked-until of every job (their watermarks), in one pass over the
        keyspace (not one per job: that would grow with jobs times keys)."""
        out: dict[str, list[int]] = {}
        for job, found in self._by_tag(keys.watermark_key(self.prefix, "*", "*")).items():
            out[job] = [self._booked_until(raw) for raw in redisconn.mget(self.r, found)]
        return out

    @staticmethod
    def _booked_until(raw: object) -> int:
        """A watermark's booked-until (ms); one that cannot be read counts as 0: its job waits
        (its agent rewrites it)."""
        try:
            wm = untrusted.loads(raw) if raw is not None else None
        except ValueError:
            wm = None
        until = wm.get("booked_until") if isinstance(wm, dict) else None
        return int(until) if isinstance(until, int | float) else 0

    def buckets(
        self,
        job: str,
        before_s: int,
        skip: Callable[[str], bool],
        booked_ms: int = 0,
        open_days: set[str] | None = None,
    ) -> dict[str, list[Row]]:
        """The job's 5-minute buckets before `before_s`, and the steps and incidents of their
        days, as rows by day; not read for the days `skip` says are sealed for good. `open_days`
        (given) gets the days holding an incident not closed (CLOSED_MS) by `booked_ms` (the
        job's slowest agent's watermark)."""
        index = keys.index_key(self.prefix, job, "5m")
        sets = (keys.steps_key(self.prefix, job), keys.voids_key(self.prefix, job))
        pipe = self.r.pipeline(transaction=False)
        pipe.smembers(keys.incident_index_key(self.prefix, job))
        pipe.zrangebyscore(index, "-inf", f"({before_s}")
        for k in sets:  # the first step (void): a step in a day with no bucket is sealed too
            pipe.zrange(k, 0, 0, withscores=True)
        wrote, found, *firsts = _replies(pipe)
        agents = sorted(_name(a) for a in wrote) if isinstance(wrote, set | list) else []
        starts = [int(float(s)) for s in found] if isinstance(found, list) else []
        lows = [int(f[0][1]) for f in firsts if isinstance(f, list) and f]
        lo = min([*starts[:1], *lows], default=before_s)
        days = [d for d in range(lo - lo % DAY_S, before_s, DAY_S) if not skip(day_of(d))]
        read = set(days)  # (asked once a day, not once a bucket)
        starts = [s for s in starts if s - s % DAY_S in read]
        if not days:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for s in starts:
            pipe.hgetall(keys.bucket_key(self.prefix, job, "5m", s))
        for d in days:
            for k in sets:
                pipe.zrangebyscore(k, d, f"({d + DAY_S}", withscores=True)
                pipe.zrevrangebyscore(k, f"({d}", "-inf", start=0, num=1)
        for a in agents:
            pipe.hgetall(keys.incidents_key(self.prefix, job, a))
        got = _replies(pipe)
        incidents = self._incidents(
            job, agents, got[len(got) - len(agents) :], read, before_s, booked_ms - CLOSED_MS, open_days
        )
        got = got[: len(got) - len(agents)]
        by_day: dict[str, list[Row]] = {}
        for s, h in zip(starts, got, strict=False):
            rows = rows_of_bucket(self.cluster, job, s, h if isinstance(h, dict) else {})
            if rows:
                by_day.setdefault(day_of(s), []).extend(rows)
        marks = got[len(starts) :]
        for i, d in enumerate(days):
            done, done_before, voided, voided_before = marks[4 * i : 4 * i + 4]
            rows = step_rows(
                self.cluster,
                job,
                _marks(done),
                _base(done_before),
                _marks(voided),
                _base(voided_before),
            )
            if rows:
                by_day.setdefault(day_of(d), []).extend(rows)
        for day, rows in incidents.items():
            by_day.setdefault(day, []).extend(rows)
        return by_day

    def _incidents(
        self,
        job: str,
        agents: list[str],
        hashes: list[Any],
        days: set[int],
        before_s: int,
        closed_ms: int,
        open_days: set[str] | None,
    ) -> dict[str, list[Row]]:
        """The job's incidents that began in `days` before `before_s`, as rows by day: each as its
        agent stored it (a record the API would skip is not sealed either); the days of those
        ending after `closed_ms` into `open_days`."""
        by_day: dict[str, list[tuple[str, str, dict[str, object], Incident]]] = {}
        for agent, h in zip(agents, hashes, strict=True):
            for k, v in (h if isinstance(h, dict) else {}).items():
                try:
                    record = untrusted.loads(v)
                except untrusted.UntrustedValue:
                    continue
                inc = ledger_read.incident(record)
                if inc is None or not isinstance(record, dict):
                    continue
                start_s = int(inc["start"]) // 1000
                if start_s >= before_s or start_s - start_s % DAY_S not in days:
                    continue
                cost = inc["cost_micro"]
                said = Incident(
                    inc["category"], int(inc["start"]), inc["cause"], round(inc["gpu_ms"]), cost or 0
                )
                by_day.setdefault(day_of(start_s), []).append((agent, _name(k), record, said))
                if open_days is not None and inc["end"] > closed_ms:
                    open_days.add(day_of(start_s))
        return {d: incident_rows(self.cluster, job, xs) for d, xs in by_day.items()}

    def seal(self, now_s: int) -> SealReport:
        """Seal every day that can be. Each (day, shard) with a sealable job in the ledger is
        built again from it and written only if its content changed (the same content, the
        same hash: nothing new); so a day sealed before and booked into since comes in as a new
        version, and one that did not change costs a read. The jobs of a file that are no
        longer in the ledger stay in it, as they were sealed."""
        report = SealReport()
        manifest = self.archive.manifest(self.cluster)
        new = self.archive.get(self.cluster, MANIFEST) is None  # written even empty: sealed once
        cells: dict[tuple[str, int], dict[str, list[Row]]] = {}  # (day, shard) -> job -> rows
        final: dict[tuple[str, int], set[str]] = {}  # ... the jobs sealed past every watermark
        skipped: set[tuple[str, int]] = set()  # cells of a job sealed for good: not read again
        marks = self.watermarks_ms()
        # Days before the ledger's start left Redis for the archive: sealed for good (a booking
        # into one now would be a bucket alone, not the day).
        start = ledger_read.hot_from(self.r, self.prefix)
        for job in self.jobs():
            before = sealable_before(marks.get(job, []), now_s, self.delay_s, self.max_wait_s)
            by_marks = sealable_before(marks.get(job, []), now_s, self.delay_s, now_s)  # without the wait
            if before <= 0:
                report.waiting.append(job)
                continue
            shard = shard_of(job, self.shards)

            def done(day: str, job: str = job, shard: int = shard) -> bool:
                if day_start(day) < start:
                    return True
                if job in manifest.final_jobs(entry_key(day, shard)):
                    skipped.add((day, shard))
                    return True
                return False

            open_days: set[str] = set()
            booked = min(marks.get(job) or [0])
            for day, rows in self.buckets(job, before, done, booked, open_days).items():
                cells.setdefault((day, shard), {})[job] = rows
                if day_start(day) + DAY_S <= by_marks and day not in open_days:
                    final.setdefault((day, shard), set()).add(job)
        # whose each row is: the jobs' meta as the API shows it, read once for every job sealed
        metas = ledger_read.LedgerStore(self.r, self.prefix).meta_many(
            sorted({j for c in cells.values() for j in c})
        )
        for jobs in cells.values():
            for job, rows in jobs.items():
                jobs[job] = with_attributes(rows, metas.get(job, {}))
        replaced: list[str] = []
        self._dirty = False
        for (day, shard), jobs in sorted(cells.items()):
            key = entry_key(day, shard)
            kept = self._sealed_rows(manifest, key, exclude=set(jobs))
            rows = [r for rs in jobs.values() for r in rs] + kept
            old = manifest.entries.get(key)
            still = (manifest.final_jobs(key) - set(jobs)) | final.get((day, shard), set())
            if self._write(manifest, key, day, shard, rows, still):
                report.written.append(manifest.entries[key].path)
                report.rows += len(rows)
                if old is not None:
                    replaced.append(old.path)
            else:
                report.unchanged += 1
        report.unchanged += len(skipped - set(cells))
        if report.written or self._dirty or new:
            self.archive.save_manifest(manifest)
        # Once the manifest names their successors: a glob over the archive (DuckDB, Athena) then
        # reads each day once too. A reader of the manifest before it changed fails closed on a
        # file gone, and reads again.
        for path in replaced:
            self.archive.delete(self.cluster, path)
        report.swept = self.sweep(manifest, time.time())
        return report

    def _sealed_rows(self, manifest: Manifest, key: str, exclude: set[str]) -> list[Row]:
        """The rows of the jobs of a sealed file that are not read again (`exclude`)."""
        e = manifest.entries.get(key)
        if e is None or set(e.jobs) <= exclude:  # (all read again: a lost file is no matter)
            return []
        return [r for r in self.archive.read(self.cluster, e) if r[3] not in exclude]

    def _write(
        self, manifest: Manifest, key: str, day: str, shard: int, rows: list[Row], final: set[str]
    ) -> bool:
        data = parquet_bytes(rows)
        digest = sha256(data)
        old = manifest.entries.get(key)
        path = file_path(day, shard, digest)
        if old is not None and old.sha256 == digest:
            keep = tuple(sorted(final & set(old.jobs)))
            if keep != old.final:  # the same rows, now past every watermark too
                manifest.entries[key] = dataclasses.replace(old, final=keep)
                self._dirty = True
            if not self.archive.exists(self.cluster, old.path):  # lost: written again, the same
                self._put(path, data, digest)
            return False
        self._put(path, data, digest)
        totals = Totals.of(rows).to_json()
        jobs = tuple(sorted({r[3] for r in rows}))
        return manifest.put(
            key, Entry(path, digest, len(rows), totals, jobs, final=tuple(sorted(final & set(jobs))))
        )

    def _put(self, path: str, data: bytes, digest: str) -> None:
        """Write a file and read it back: the manifest names only a file that holds its hash."""
        self.archive.put(self.cluster, path, data)
        back = self.archive.get(self.cluster, path)
        if back is None or sha256(back) != digest:
            raise ArchiveError(f"{path} read back from {self.archive.url} is not what was written")

    def sweep(self, manifest: Manifest, now_s: float) -> list[str]:
        """Remove the files the manifest does not name that are older than `orphan_age_s`: a
        file written by a sealer that stopped before its manifest named it, a superseded one it
        stopped before removing, a temporary one. Younger ones may be another sealer's, about to
        be named. A glob over the archive (DuckDB, Athena) then counts each day once."""
        named = {e.path for e in manifest.entries.values()}
        gone = []
        for rel, mtime in self.archive.files(self.cluster):
            if rel not in named and now_s - mtime >= self.orphan_age_s:
                self.archive.delete(self.cluster, rel)
                gone.append(rel)
        return gone


def _replies(pipe: Pipeline) -> list[Any]:
    """A pipeline's replies; a key of the wrong type answers its error in place (read as none,
    as the API reads it), any other error (a refused command, an outage) raises."""
    got = pipe.execute(raise_on_error=False)
    for x in got:
        if isinstance(x, redis.RedisError) and not untrusted.is_wrong_type(x):
            raise x
    return got


def _name(k: object) -> str:
    return k.decode() if isinstance(k, bytes) else str(k)


def _tokens(member: object) -> int:
    """A step member's cumulative tokens (`<record>:<cumulative tokens>`), 0 where it has none,
    as the API counts them."""
    text = member.decode() if isinstance(member, bytes) else str(member)
    tail = text.rpartition(":")[2]
    if tail.isascii() and tail.isdigit() and len(tail) < 19:  # the agents' members: a plain count, read fast
        return int(tail)
    return ledger_read.number(tail) or 0


def _marks(reply: object) -> list[tuple[float, int]]:
    """ZRANGEBYSCORE ... WITHSCORES as (score, tokens); a set of the wrong type (the API skips
    its steps too): none."""
    if not isinstance(reply, list):
        return []
    return [(float(score), _tokens(m)) for m, score in reply]


def _base(reply: object) -> int:
    return _tokens(reply[0]) if isinstance(reply, list) and reply else 0


@dataclass
class Check:
    files: int = 0
    rows: int = 0
    problems: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)  # files no manifest names (the next seal's)


def verify(archive: Archive, clusters: Iterable[str] | None = None) -> Check:
    """Read every file the manifests name back: present, its hash, its rows and totals; and
    list the files no manifest names (a sealer stopped half-way: the next seal removes them)."""
    out = Check()
    for c in clusters or archive.clusters():
        m = archive.manifest(c)
        named = {e.path for e in m.entries.values()}
        out.orphans += [rel for rel, _ in archive.files(c) if rel not in named]
        for e in m.entries.values():
            try:
                out.rows += len(archive.read(c, e))
                out.files += 1
            except ArchiveError as err:
                out.problems.append(str(err))
    return out


def window_totals(
    archive: Archive, start_s: int, end_s: int, clusters: Iterable[str] | None = None
) -> dict[tuple[str, str], Totals]:
    """Net amounts by (cluster, job) over the 5-minute buckets starting in [start_s, end_s), read
    from the files the manifests name (each checked)."""
    out: dict[tuple[str, str], Totals] = {}
    for c in clusters or archive.clusters():
        m = archive.manifest(c)
        for key, e in m.entries.items():
            d0 = day_start(key.split("/", 1)[0])
            if d0 + DAY_S <= start_s or d0 >= end_s:
                continue
            for r in archive.read(c, e):
                if start_s <= r[4] < end_s:
                    out.setdefault((c, r[3]), Totals()).add_row(r)
    return out
