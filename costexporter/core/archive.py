"""The sealed ledger's shape, pure: rows of the archive, how they are partitioned, what a
manifest says of each file, and when a day can be sealed (docs/ledger.md, "The archive").

A sealed file holds, for one cluster, one UTC day and one shard of the jobs, one row per job,
5-minute bucket and category with amounts: GPU-milliseconds, millijoules, micro-units of the
currency, each with its rollback corrections (`voided_*`, which readers subtract), and the
bucket's price version; one row per job and bucket with steps (category ""): the steps
completed in it and their tokens, the steps voided in it and theirs; and one row per incident
an agent recorded (a wasted stretch: its category, the bucket it began in, its cause, GPU time
and cost in their own columns, the record itself as JSON), every amount column 0. A SQL `SUM`
over any column is then the window's figure, with no row kind to tell apart; `SUM(
incident_cost_micro) GROUP BY cause` is the waste by cause. The same content always
gives the same rows in the same order, so the same bytes (`store/archive.py` writes them), so
sealing again never adds a file: the manifest
keeps one file per (day, shard), by content hash; a day sealed again with other content is a new
version that supersedes the old one, and a reader reads only the files the manifest lists.

A day can be sealed once nothing can change it: every agent of the job booked past its end
(their watermarks), and the seal delay has passed since (corrections such as rollbacks are
booked in the bucket where they are seen, never back into a sealed day).
"""

from __future__ import annotations

import functools
import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from costexporter.core.model import CATEGORIES

SCHEMA_VERSION = 3  # 2: the step columns (a file of 1 reads with them 0); 3: the incidents
INCIDENTS_SCHEMA = 3  # the first that seals incidents
DAY_S = 86_400
UNITS = ("ms", "mj", "ucost")
VOIDED = "voided:"
# The columns of a sealed file, in order: (name, Arrow type name).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("schema", "int32"),
    ("cluster", "string"),
    ("date", "string"),
    ("job", "string"),
    ("bucket_start", "int64"),  # Unix seconds, a multiple of 300
    ("category", "string"),
    ("gpu_ms", "int64"),
    ("energy_mj", "int64"),
    ("cost_micro", "int64"),
    ("voided_gpu_ms", "int64"),
    ("voided_energy_mj", "int64"),
    ("voided_cost_micro", "int64"),
    ("price_version", "string"),
    ("steps", "int64"),  # completed in the bucket (by their completion time)
    ("step_tokens", "int64"),
    ("voided_steps", "int64"),  # voided in the bucket (by when the voiding resume was seen)
    ("voided_tokens", "int64"),
    ("team", "string"),  # the job's team as the API shows it ("" where it has none)
    ("attributes", "string"),  # the job's meta as the API shows it, a JSON object
    # An incident's row: {"agent", "field", "record"}, as the agent stored it ("" on other rows)
    ("incident", "string"),
    ("cause", "string"),  # hardware, network, storage, job, unknown ("" on other rows)
    ("incident_gpu_ms", "int64"),
    ("incident_cost_micro", "int64"),  # 0 where its cost was not kept
)
STEP_COLUMNS = ("steps", "step_tokens", "voided_steps", "voided_tokens")
META_COLUMNS = ("team", "attributes")
V1_COLUMNS = COLUMNS[:13]  # schema 1: neither steps nor the job's attributes
V2_COLUMNS = COLUMNS[:19]  # schema 2: no incidents
STEPS_ROW = ""  # the category of a bucket's steps row
BOOKED = 17  # a row's first columns: what was booked; then whose it is; then its incident
# After whose it is (team, attributes): an incident row's record ("" on every other row), then
# its GPU time and cost (literals: mypy types a row's field by them)
INCIDENT: Final = 19
INCIDENT_GPU_MS: Final = 21
INCIDENT_COST_MICRO: Final = 22
NO_INCIDENT = ("", "", 0, 0)
# A row, in COLUMNS' order.
Row = tuple[
    int,
    str,
    str,
    str,
    int,
    str,
    int,
    int,
    int,
    int,
    int,
    int,
    str,
    int,
    int,
    int,
    int,
    str,
    str,
    str,
    str,
    int,
    int,
]


def day_of(start_s: int) -> str:
    """The UTC date (YYYY-MM-DD) a bucket starting at `start_s` belongs to."""
    return _date(start_s - start_s % DAY_S)


@functools.lru_cache(maxsize=4096)
def _date(day_s: int) -> str:
    return datetime.fromtimestamp(day_s, UTC).strftime("%Y-%m-%d")


def day_start(date: str) -> int:
    return int(datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=UTC).timestamp())


def shard_of(job: str, shards: int) -> int:
    """The job's shard: a stable hash of its name (the same in every process and release)."""
    return zlib.crc32(job.encode("utf-8", "surrogatepass")) % shards


# An amounts hash's field -> (category, its place in a row's six amounts), as str and as bytes.
_FIELD_AT: dict[str | bytes, tuple[str, int]] = {
    f"{v}{c}:{u}": (c, i + (3 if v else 0))
    for c in CATEGORIES
    for i, u in enumerate(UNITS)
    for v in ("", VOIDED)
}
_FIELD_AT.update({k.encode(): at for k, at in list(_FIELD_AT.items()) if isinstance(k, str)})
_VERSION = ("price_version", b"price_version")


def rows_of_bucket(
    cluster: str, job: str, start_s: int, fields: Mapping[str | bytes, str | int | bytes]
) -> list[Row]:
    """One 5-minute bucket's amounts hash as rows: a row per category with any amount (a field
    the ledger does not write is not the archive's)."""
    amounts: dict[str, list[int]] = {}
    version = ""
    for k, v in fields.items():
        at = _FIELD_AT.get(k)
        if at is None:
            if k in _VERSION:
                version = v.decode() if isinstance(v, bytes) else str(v)
            continue
        a = amounts.get(at[0])
        if a is None:
            a = amounts[at[0]] = [0, 0, 0, 0, 0, 0]
        a[at[1]] = int(v)
    date = day_of(start_s)
    rows: list[Row] = [
        (SCHEMA_VERSION, cluster, date, job, start_s, c, *a, version, 0, 0, 0, 0, "", "", *NO_INCIDENT)  # type: ignore[misc]
        for c, a in sorted(amounts.items())
        if any(a)
    ]
    if not rows and version:  # a bucket booked with nothing in it still has its price
        rows.append(
            (
                SCHEMA_VERSION,
                cluster,
                date,
                job,
                start_s,
                STEPS_ROW,
                0,
                0,
                0,
                0,
                0,
                0,
                version,
                0,
                0,
                0,
                0,
                "",
                "",
                *NO_INCIDENT,
            )
        )
    return rows


# A step set's members as the API reads them: (score in seconds, cumulative tokens), in the
# set's order (score, then member).
Marks = list[tuple[float, int]]


def step_rows(
    cluster: str, job: str, done: Marks, done_base: int, voided: Marks, voided_base: int
) -> list[Row]:
    """A job's steps as one row per 5-minute bucket: the steps completed (voided) in it, by their
    score, and their tokens, the cumulative tokens of its last member less those of the last
    member before it (`*_base`: that of the last member before the first given). Summed over
    any run of buckets this is the API's figure: a ZCOUNT, and the cumulative tokens at the
    ends subtracted."""
    per: dict[int, list[int]] = {}
    for marks, base, at in ((done, done_base, 0), (voided, voided_base, 2)):
        last: dict[int, int] = {}
        for score, cum in marks:
            b = int(score // 300 * 300)
            per.setdefault(b, [0, 0, 0, 0])[at] += 1
            last[b] = cum
        prev = base
        for b in sorted(last):
            per[b][at + 1] = last[b] - prev
            prev = last[b]
    return [
        (
            SCHEMA_VERSION,
            cluster,
            day_of(b),
            job,
            b,
            STEPS_ROW,
            0,
            0,
            0,
            0,
            0,
            0,
            "",
            *v,
            "",
            "",
            *NO_INCIDENT,
        )  # type: ignore[misc]
        for b, v in sorted(per.items())
    ]


def incident_rows(
    cluster: str, job: str, stored: Iterable[tuple[str, str, dict[str, object], Incident]]
) -> list[Row]:
    """A job's incidents as rows, one each: (agent, field, the record as stored, what it says)
    -> the record under the 5-minute bucket its stretch began in, its category, cause, GPU time
    and cost in their columns, every amount 0."""
    out: list[Row] = []
    for agent, name, record, inc in stored:
        b = inc.start_ms // 1000 // 300 * 300
        text = json.dumps(
            {"agent": agent, "field": name, "record": record},
            sort_keys=True,
            separators=(",", ":"),
            default=str,
        )
        out.append(
            (
                SCHEMA_VERSION,
                cluster,
                day_of(b),
                job,
                b,
                inc.category,
                0,
                0,
                0,
                0,
                0,
                0,
                "",
                0,
                0,
                0,
                0,
                "",
                "",
                text,
                inc.cause,
                inc.gpu_ms,
                inc.cost_micro,
            )
        )
    return out


@dataclass(frozen=True)
class Incident:
    """What an incident's row says of it beside the record: where it sorts and what it sums to."""

    category: str
    start_ms: int
    cause: str
    gpu_ms: int
    cost_micro: int  # 0 where its cost was not kept


def incident_of(row: Row) -> tuple[str, str, dict[str, object]] | None:
    """An incident row's (agent, field, record as stored); None for any other row."""
    if not row[INCIDENT]:
        return None
    d = json.loads(row[INCIDENT])
    return str(d["agent"]), str(d["field"]), dict(d["record"])


def with_attributes(rows: Iterable[Row], meta: Mapping[str, object]) -> list[Row]:
    """The rows with their job's team and attributes (`meta`: the job's meta as the API shows
    it), so the archive alone says whose a row is (one value per job: Parquet's dictionary
    encoding keeps it to a few bytes a file)."""
    team = meta.get("team")
    text = json.dumps(dict(meta), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    tail = (team if isinstance(team, str) else "", text)
    return [(*r[:BOOKED], *tail, *r[INCIDENT:]) for r in rows]  # type: ignore[misc]


def booked(rows: Iterable[Row]) -> list[tuple[object, ...]]:
    """What the rows booked and recorded, in their one order, without whose they are nor the
    schema they were written in: a day's rows compared with what Redis holds now (a job's meta
    may change after its day; its bookings and incidents may not)."""
    return [(*r[1:BOOKED], *r[INCIDENT:]) for r in ordered(rows)]


def ordered(rows: Iterable[Row]) -> list[Row]:
    """The one order a file's rows are written in: by job, bucket, category (steps first), the
    bucket's amounts before its incidents."""
    return sorted(rows, key=lambda r: (r[3], r[4], r[5], r[INCIDENT]))


STEPS_TOTAL = "_steps"  # Totals' key of the steps: [completed, tokens, voided, voided tokens]
INCIDENTS_TOTAL = "_incidents"  # ... of the incidents: [how many, GPU-ms, micro-cost]


@dataclass
class Totals:
    """Net amounts (valid minus voided) per category: [ms, mJ, micro-cost], exact integers; and
    the steps under `_steps`."""

    by_category: dict[str, list[int]] = field(default_factory=dict)

    def add_row(self, r: Row) -> None:
        if r[INCIDENT]:
            s = self.by_category.setdefault(INCIDENTS_TOTAL, [0, 0, 0])
            s[0] += 1
            s[1] += r[INCIDENT_GPU_MS]
            s[2] += r[INCIDENT_COST_MICRO]
            return
        if r[5] == STEPS_ROW:
            s = self.by_category.setdefault(STEPS_TOTAL, [0, 0, 0, 0])
            s[0] += r[13]
            s[1] += r[14]
            s[2] += r[15]
            s[3] += r[16]
            return
        t = self.by_category.setdefault(r[5], [0, 0, 0])
        t[0] += r[6] - r[9]
        t[1] += r[7] - r[10]
        t[2] += r[8] - r[11]

    @classmethod
    def of(cls, rows: Iterable[Row]) -> Totals:
        t = cls()
        for r in rows:
            t.add_row(r)
        return t

    def to_json(self) -> dict[str, list[int]]:
        return {c: list(v) for c, v in sorted(self.by_category.items()) if any(v)}


@dataclass(frozen=True)
class Entry:
    """One sealed file of the manifest: its path (relative to the cluster's root), content hash,
    rows, totals, the jobs it holds, its version and the paths it superseded."""

    path: str
    sha256: str
    rows: int
    totals: dict[str, list[int]]
    jobs: tuple[str, ...]
    version: int = 1
    superseded: tuple[str, ...] = ()
    # The jobs sealed once every agent had booked past the day: they cannot change, and are not
    # read from the ledger again (the others, sealed after the longest wait, are, in case).
    final: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "rows": self.rows,
            "totals": self.totals,
            "jobs": list(self.jobs),
            "final": list(self.final),
            "version": self.version,
            "superseded": list(self.superseded),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> Entry:
        totals = d.get("totals") or {}
        if not isinstance(totals, dict):
            raise ValueError(f"an entry's totals are a {type(totals).__name__}, not an object")
        return cls(
            path=str(d["path"]),
            sha256=str(d["sha256"]),
            rows=int(str(d["rows"])),
            totals={str(k): [int(x) for x in v] for k, v in totals.items()},
            jobs=tuple(str(j) for j in d.get("jobs") or ()),  # type: ignore[attr-defined]
            version=int(str(d.get("version", 1))),
            superseded=tuple(str(p) for p in d.get("superseded") or ()),  # type: ignore[attr-defined]
            final=tuple(str(j) for j in d.get("final") or ()),  # type: ignore[attr-defined]
        )


def entry_key(date: str, shard: int) -> str:
    return f"{date}/{shard:03d}"


def file_path(date: str, shard: int, sha256: str) -> str:
    """Where a sealed file lives under its cluster's root: `date=<day>/part-<shard>-<hash>.parquet`
    (the content hash in the name: a new version never overwrites the old one)."""
    return f"date={date}/part-{shard:03d}-{sha256[:16]}.parquet"


@dataclass
class Manifest:
    """A cluster's sealed files: one entry per (day, shard)."""

    cluster: str
    entries: dict[str, Entry] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    def put(self, key: str, entry: Entry) -> bool:
        """Record `entry` for `key`; the same content (hash) is no change (False). Other content
        is a new version superseding the one before."""
        old = self.entries.get(key)
        if old is not None and old.sha256 == entry.sha256:
            return False
        if old is not None:
            entry = Entry(
                entry.path,
                entry.sha256,
                entry.rows,
                entry.totals,
                entry.jobs,
                old.version + 1,
                (*old.superseded, old.path),
                entry.final,
            )
        self.entries[key] = entry
        return True

    def final_jobs(self, key: str) -> set[str]:
        e = self.entries.get(key)
        return set(e.final) if e is not None else set()

    def to_json(self) -> dict[str, object]:
        return {
            "schema": SCHEMA_VERSION,  # what this release writes (it reads the files of any before)
            "cluster": self.cluster,
            "entries": {k: e.to_json() for k, e in sorted(self.entries.items())},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> Manifest:
        schema = int(str(d.get("schema", SCHEMA_VERSION)))
        if schema > SCHEMA_VERSION:
            raise ValueError(
                f"the archive's manifest is schema {schema}, newer than this release's {SCHEMA_VERSION}: "
                "upgrade costexporter to read it"
            )
        entries = d.get("entries") or {}
        if not isinstance(entries, dict):
            raise ValueError(f"the manifest's entries are a {type(entries).__name__}, not an object")
        return cls(str(d["cluster"]), {str(k): Entry.from_json(v) for k, v in entries.items()}, schema)


def sealable_before(watermarks_ms: Iterable[int], now_s: int, delay_s: int, max_wait_s: int) -> int:
    """The start of the first UTC day of a job that cannot be sealed yet (seconds). A day can be
    once it ended `delay_s` ago and every agent's watermark of the job is past its end; or, its
    agents stopped short of it (the job ended that day, an agent is gone), once it ended
    `max_wait_s` ago. Whatever is booked into a sealed day after that is sealed again as a new
    version of its file."""
    open_from = now_s - delay_s
    marks = list(watermarks_ms)
    booked = min(marks) // 1000 if marks else 0
    until = max(min(booked, open_from), min(now_s - max_wait_s, open_from))
    return max(until - until % DAY_S, 0)
