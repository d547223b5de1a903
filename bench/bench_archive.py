"""Archive benchmark: python bench/bench_archive.py [--jobs 10,40] [--days 7]

Seeds a ledger as agents write it (`ledger.queue_amounts`: every 5-minute bucket of every day,
four categories busy) on a Redis of its own (a `redis-server` on a free port, no persistence),
then seals it to a local directory and prints, at each size side by side:
  * seal throughput, job-days per second (the sealer's whole run: reading the buckets, building
    rows, writing and reading back the Parquet files, the manifest);
  * a second seal of the same ledger (every day sealed for good: its buckets not read again);
  * Redis bytes per job-day (MEMORY USAGE over every key of the ledger) against the archive's
    bytes per job-day (the Parquet files).
Targets: seal >= 100 job-days/s here; the archive's bytes per job-day a small part of Redis's.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costexporter.core.model import CATEGORIES
from costexporter.services.sealer import Sealer
from costexporter.store import keys, ledger
from costexporter.store.archive import Archive
from tests.redis_server import RedisServer

DAY0 = 1_767_225_600
DAY_S = 86_400


def seed(r: redis.Redis, prefix: str, jobs: int, days: int) -> None:
    rng = np.random.default_rng(7)
    busy = [CATEGORIES.index(c) for c in ("productive", "communication", "idle", "no_progress")]
    for j in range(jobs):
        job = f"team-{j % 5}/job-{j}"
        for d in range(days):
            by_bucket = {}
            for b in range(288):
                a = np.zeros((len(CATEGORIES), 3), np.int64)
                for c in busy:
                    a[c] = rng.integers(0, 2_400_000, 3)
                by_bucket[DAY0 + d * DAY_S + 300 * b] = a
            pipe = r.pipeline(transaction=True)
            ledger.queue_amounts(pipe, prefix, job, by_bucket, "pv1")
            pipe.execute()
        r.zadd(keys.jobs_key(prefix), {job: DAY0})
        r.set(
            keys.watermark_key(prefix, job, "n0"), f'{{"booked_until": {(DAY0 + (days + 1) * DAY_S) * 1000}}}'
        )


def redis_bytes(r: redis.Redis, prefix: str) -> int:
    return sum(int(r.memory_usage(k) or 0) for k in r.scan_iter(f"{prefix}:*", count=1000))


def run(size: int, days: int) -> dict:
    tmp = Path(tempfile.mkdtemp())
    server = RedisServer(tmp / "redis").start()
    try:
        r = server.client()
        seed(r, "b", size, days)
        hot = redis_bytes(r, "b")
        archive = Archive.open(str(tmp / "archive"))
        sealer = Sealer(r, "b", archive, "bench", shards=16, delay_s=0)
        now = DAY0 + (days + 2) * DAY_S
        t0 = time.perf_counter()
        first = sealer.seal(now)
        seal_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = sealer.seal(now)
        again_s = time.perf_counter() - t0
        cold = sum(p.stat().st_size for p in (tmp / "archive").rglob("*.parquet"))
        job_days = size * days
        assert not again.written and first.rows
        return {
            "job_days": job_days,
            "seal_s": seal_s,
            "again_s": again_s,
            "hot_per_jd": hot / job_days,
            "cold_per_jd": cold / job_days,
            "files": len(first.written),
        }
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="10,40")
    ap.add_argument("--days", type=int, default=7)
    a = ap.parse_args()
    load = subprocess.run(["cat", "/proc/loadavg"], capture_output=True, text=True).stdout.split()[0]
    print(f"archive benchmark: {a.days} days of 5-minute buckets per job; load average {load}")
    rows = [(n, run(n, a.days)) for n in (int(x) for x in a.jobs.split(","))]
    for n, x in rows:
        rate = x["job_days"] / x["seal_s"]
        print(
            f"  {n:>4} jobs x {a.days} days: seal {rate:7.1f} job-days/s "
            f"({x['seal_s']:.2f} s, {x['files']} files)"
            f"   target >= 100: {'MET' if rate >= 100 else 'MISSED'};"
            f" again {x['again_s']:.2f} s (nothing written);"
            f" Redis {x['hot_per_jd'] / 1024:.0f} KB / job-day,"
            f" archive {x['cold_per_jd'] / 1024:.1f} KB / job-day"
        )
    if len(rows) > 1:
        x0, x1 = rows[0][1], rows[-1][1]
        slope = np.log(x1["seal_s"] / x0["seal_s"]) / np.log(x1["job_days"] / x0["job_days"])
        print(f"  seal time grows with job-days at a log-log slope of {slope:.2f} (1.0: linear)")


if __name__ == "__main__":
    main()
