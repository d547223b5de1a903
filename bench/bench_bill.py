"""One bill over a year of clusters: python bench/bench_bill.py [--clusters 3] [--days 365] [--jobs 10,30]

Writes an archive as the sealers of --clusters clusters leave it after --days days (each day of
each job: every 5-minute bucket, four categories busy, a step every 30 s; the files and the
manifests in the sealer's layout, built column-wise here so that a year takes seconds), then
serves the finance API over it (its own cluster's Redis holds no day: every day is read from
the archive) and times over real HTTP, at each size side by side:
  * /api/v1/allocation over the whole year by cluster: the first request (every file read
    once) and the next ones (the days' sums kept); target <= 1 s;
  * the same by job, and over the last 30 days;
  * OpenCost's /allocation over the year by cluster.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costexporter.core.archive import (
    COLUMNS,
    SCHEMA_VERSION,
    STEPS_TOTAL,
    Entry,
    Manifest,
    day_of,
    entry_key,
    file_path,
    shard_of,
)
from costexporter.store import keys
from costexporter.store.archive import Archive, sha256
from costexporter.store.coldledger import ColdLedger
from costexporter.store.ledger_read import LedgerStore
from tests.api_helpers import served
from tests.redis_server import RedisServer

DAY0 = 1_735_689_600  # 2025-01-01
DAY_S = 86_400
CATS = ("productive", "communication", "idle", "no_progress")
SHARDS = 4


def day_file(
    cluster: str, date: str, d0: int, jobs: list[str], rng: np.random.Generator
) -> tuple[bytes, dict]:
    """One (day, shard) file of `jobs`, and its totals, column-wise."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    n_b = 288
    per_job = n_b * (len(CATS) + 1)  # the amounts rows, then the steps row, per bucket
    n = per_job * len(jobs)
    job = np.repeat(np.array(jobs, dtype=object), per_job)
    bucket = np.tile(np.repeat(d0 + 300 * np.arange(n_b), len(CATS) + 1), len(jobs))
    cat = np.tile(np.array([*CATS, ""], dtype=object), n_b * len(jobs))
    amount_rows = cat != ""
    ms, mj, uc = (np.where(amount_rows, rng.integers(0, 2_400_000, n), 0) for _ in range(3))
    steps = np.where(amount_rows, 0, 10)
    tokens = np.where(amount_rows, 0, 10_000)
    zero = np.zeros(n, np.int64)
    cols = {
        "schema": np.full(n, SCHEMA_VERSION, np.int32),
        "cluster": np.full(n, cluster, dtype=object),
        "date": np.full(n, date, dtype=object),
        "job": job,
        "bucket_start": bucket,
        "category": cat,
        "gpu_ms": ms,
        "energy_mj": mj,
        "cost_micro": uc,
        "voided_gpu_ms": zero,
        "voided_energy_mj": zero,
        "voided_cost_micro": zero,
        "price_version": np.where(amount_rows, "pv1", ""),
        "steps": steps,
        "step_tokens": tokens,
        "voided_steps": zero,
        "voided_tokens": zero,
        "team": np.array([j.split("/")[0] for j in job], dtype=object),
        "attributes": np.array([f'{{"team":"{j.split("/")[0]}"}}' for j in job], dtype=object),
        "incident": np.full(n, "", dtype=object),  # (no incident: the bill reads none)
        "cause": np.full(n, "", dtype=object),
        "incident_gpu_ms": zero,
        "incident_cost_micro": zero,
    }
    table = pa.Table.from_arrays(
        [pa.array(cols[c], type=getattr(pa, t)()) for c, t in COLUMNS], names=[c for c, _ in COLUMNS]
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    totals = {c: [int(ms[cat == c].sum()), int(mj[cat == c].sum()), int(uc[cat == c].sum())] for c in CATS}
    totals[STEPS_TOTAL] = [int(steps.sum()), int(tokens.sum()), 0, 0]
    return buf.getvalue(), {"rows": n, "totals": dict(sorted(totals.items()))}


def write_archive(archive: Archive, clusters: list[str], days: int, jobs: int) -> int:
    rng = np.random.default_rng(7)
    files = 0
    for c in clusters:
        manifest = Manifest(c)
        names = [f"team-{j % 5}/job-{j}" for j in range(jobs)]
        by_shard: dict[int, list[str]] = {}
        for j in names:
            by_shard.setdefault(shard_of(j, SHARDS), []).append(j)
        for d in range(days):
            d0 = DAY0 + d * DAY_S
            date = day_of(d0)
            for shard, members in sorted(by_shard.items()):
                data, meta = day_file(c, date, d0, sorted(members), rng)
                digest = sha256(data)
                path = file_path(date, shard, digest)
                archive.put(c, path, data)
                manifest.put(
                    entry_key(date, shard),
                    Entry(
                        path,
                        digest,
                        meta["rows"],
                        meta["totals"],
                        tuple(sorted(members)),
                        final=tuple(members),
                    ),
                )
                files += 1
        archive.save_manifest(manifest)
    return files


def timed(get, *args, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = get(*args, **kw)
    assert r.status_code == 200, r.text[:300]
    return time.perf_counter() - t0, r.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--days", type=int, default=365)
    ap.add_argument("--jobs", default="10,30", help="jobs a day per cluster, one run per size")
    a = ap.parse_args()
    load = subprocess.run(["cat", "/proc/loadavg"], capture_output=True, text=True).stdout.split()[0]
    print(
        f"bill benchmark: {a.clusters} clusters x {a.days} days, {SHARDS} files a day each;"
        f" load average {load}"
    )
    names = ["east", *(f"c{i}" for i in range(1, a.clusters))]
    end = DAY0 + a.days * DAY_S
    iso = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
    year, month = f"{iso(DAY0)},{iso(end)}", f"{iso(end - 30 * DAY_S)},{iso(end)}"
    for n in (int(x) for x in a.jobs.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            archive = Archive.open(str(root / "archive"))
            t0 = time.perf_counter()
            files = write_archive(archive, names, a.days, n)
            made = time.perf_counter() - t0
            server = RedisServer(root / "redis").start()
            try:
                r = server.client()
                r.set(keys.hot_from_key("b"), str(end))  # every day left Redis: read from the archive
                for j in range(n):
                    r.zadd(keys.jobs_key("b"), {f"team-{j % 5}/job-{j}": DAY0})
                store = LedgerStore(
                    r,
                    "b",
                    cold=ColdLedger(archive, "east"),
                    others={c: ColdLedger(archive, c) for c in names[1:]},
                )
                with served(store, cluster="east") as (url, _):
                    alloc = f"{url}/api/v1/allocation"
                    first, got = timed(
                        httpx.get, alloc, params={"window": year, "aggregate": "cluster"}, timeout=600
                    )
                    warm = min(
                        timed(httpx.get, alloc, params={"window": year, "aggregate": "cluster"}, timeout=600)[
                            0
                        ]
                        for _ in range(3)
                    )
                    by_job = min(
                        timed(httpx.get, alloc, params={"window": year, "aggregate": "job"}, timeout=600)[0]
                        for _ in range(3)
                    )
                    last = min(
                        timed(
                            httpx.get, alloc, params={"window": month, "aggregate": "cluster"}, timeout=600
                        )[0]
                        for _ in range(3)
                    )
                    oc = min(
                        timed(
                            httpx.get,
                            f"{url}/allocation",
                            params={"window": year, "aggregate": "cluster"},
                            timeout=600,
                        )[0]
                        for _ in range(3)
                    )
                rows = [row["key"] for row in got["rows"]]  # type: ignore[index]
                assert sorted(k for k in rows if k != "unassigned") == sorted(names), rows
            finally:
                server.stop()
            jd = n * a.days * a.clusters
            print(
                f"  {n:>3} jobs a day per cluster ({jd:,} job-days, {files:,} files, made in {made:.0f} s):"
                f" /allocation by cluster over the year: first {first:.2f} s, then {warm:.3f} s"
                f"   target <= 1 s: {'MET' if warm <= 1 else 'MISSED'};"
                f" by job {by_job:.3f} s; the last 30 days {last:.3f} s; OpenCost by cluster {oc:.3f} s"
            )


if __name__ == "__main__":
    main()
