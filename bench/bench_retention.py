"""Retention benchmark: python bench/bench_retention.py [--jobs 10,25] [--days 90] [--hot-days 35]

Runs a cluster day by day on a Redis of its own (a `redis-server` on a free port, no
persistence): every job books every 5-minute bucket of the day (the 5-minute buckets and the
rollup as agents write them) and a step every --step-s seconds; after each day the sealer seals
it and retention expires what lies before the hot window. The same days run without expiry
beside it (what a release without retention keeps). Prints, at each size:
  * Redis memory (INFO used_memory_dataset less the empty server's) at chosen days, with and without
    expiry (each on a server of its own), and the
    growth per day after the hot window (target: flat, ~0 bytes a day, with expiry);
  * Redis bytes per job-day hot (inside the window) and after expiry (what a finished day
    leaves behind: the base records);
  * the finance API's /allocation over the whole run (--year-days, read across the archive and
    Redis, over real HTTP), per job row, for a window of every day against one inside the hot
    window (target <= 1 s).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from costexporter.core.model import CATEGORIES
from costexporter.services.retention import Retention
from costexporter.services.sealer import Sealer
from costexporter.store import keys, ledger
from costexporter.store.archive import Archive
from costexporter.store.coldledger import ColdLedger
from costexporter.store.ledger_read import LedgerStore
from tests.api_helpers import served
from tests.redis_server import RedisServer

DAY0 = 1_767_225_600  # 2026-01-01
DAY_S = 86_400
BUSY = [CATEGORIES.index(c) for c in ("productive", "communication", "idle", "no_progress")]


def book_day(r: redis.Redis, prefix: str, job: str, day: int, step_s: int, rng: np.random.Generator) -> None:
    """One job-day as the agents' rounds leave it (`ledger.queue_amounts`: the 5-minute buckets,
    their hour, day and week rollups, the total and the job's rollup records), and the steps."""
    d0 = DAY0 + day * DAY_S
    by_bucket = {}
    for b in range(288):
        a = np.zeros((len(CATEGORIES), 3), np.int64)
        a[BUSY] = rng.integers(0, 2_400_000, (len(BUSY), 3))
        by_bucket[d0 + 300 * b] = a
    pipe = r.pipeline(transaction=False)
    ledger.queue_amounts(pipe, prefix, job, by_bucket, "pv1")
    n0 = day * DAY_S // step_s
    steps = {f"{n0 + k}:{(n0 + k + 1) * 1000}": d0 + k * step_s + 1.5 for k in range(DAY_S // step_s)}
    pipe.zadd(keys.steps_key(prefix, job), steps)
    pipe.set(keys.watermark_key(prefix, job, "n0"), json.dumps({"booked_until": (d0 + DAY_S) * 1000}))
    pipe.zadd(keys.jobs_key(prefix), {job: d0})
    pipe.execute()


def used(r: redis.Redis, base: int) -> int:
    """The server's memory for data: INFO's used_memory_dataset (the keys and their values, not
    the allocator's or the server's own overhead), less what it held empty."""
    return int(r.info("memory")["used_memory_dataset"]) - base


def run(jobs: int, days: int, hot_days: int, step_s: int, marks: list[int], root: Path) -> dict:
    """The same days on two servers: `keep` without expiry, `exp` sealed and expired daily."""
    servers = {k: RedisServer(root / f"redis-{k}-{jobs}").start() for k in ("keep", "exp")}
    try:
        r = {k: s.client() for k, s in servers.items()}
        base = {k: int(c.info("memory")["used_memory_dataset"]) for k, c in r.items()}
        archive = Archive.open(str(root / f"archive-{jobs}"))
        rng = np.random.default_rng(7)
        names = [f"team-{j % 5}/job-{j}" for j in range(jobs)]
        sealer = Sealer(r["exp"], "exp", archive, "bench", shards=4, delay_s=0)
        retention = Retention(sealer, hot_days)
        out: dict = {"keep": {}, "exp": {}, "seal_s": 0.0, "expire_s": 0.0}
        for d in range(days):
            for j in names:
                book_day(r["keep"], "keep", j, d, step_s, rng)
                book_day(r["exp"], "exp", j, d, step_s, rng)
            now = DAY0 + (d + 1) * DAY_S + 60
            t0 = time.perf_counter()
            sealer.seal(now)
            t1 = time.perf_counter()
            retention.expire(now)
            out["seal_s"] += t1 - t0
            out["expire_s"] += time.perf_counter() - t1
            if d + 1 in marks:
                for k in ("keep", "exp"):
                    out[k][d + 1] = used(r[k], base[k])
        out["servers"] = servers
        out["r"] = r["exp"]
        out["archive"] = archive
        return out
    except BaseException:
        for s in servers.values():
            s.stop()
        raise


def allocation_s(r: redis.Redis, archive: Archive, days: int, hot_days: int) -> tuple[float, float, int]:
    """Seconds of /allocation over every day and over the last week (the best of 3), over HTTP."""
    store = LedgerStore(r, "exp", cold=ColdLedger(archive, "bench"))
    iso = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
    whole = f"{iso(DAY0)},{iso(DAY0 + days * DAY_S)}"
    week = f"{iso(DAY0 + (days - 7) * DAY_S)},{iso(DAY0 + days * DAY_S)}"
    times = {}
    with served(store) as (url, _):
        for name, w in (("whole", whole), ("week", week)):
            best = 1e9
            for _ in range(3):
                t0 = time.perf_counter()
                got = httpx.get(
                    f"{url}/api/v1/allocation", params={"window": w, "aggregate": "job"}, timeout=120
                )
                best = min(best, time.perf_counter() - t0)
                assert got.status_code == 200, got.text
            times[name] = best
            rows = len(got.json()["rows"]) if "rows" in got.json() else len(got.json().get("allocations", []))
    return times["whole"], times["week"], rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="10,25", help="jobs running every day, one run per size")
    ap.add_argument("--days", type=int, default=90)
    ap.add_argument("--hot-days", type=int, default=35)
    ap.add_argument("--step-s", type=int, default=30, help="seconds between a job's steps")
    a = ap.parse_args()
    load = subprocess.run(["cat", "/proc/loadavg"], capture_output=True, text=True).stdout.split()[0]
    marks = sorted(
        ({10, a.hot_days} | set(range(a.hot_days + 5, a.days + 1, 10)) | {a.days}) & set(range(1, a.days + 1))
    )
    print(
        f"retention benchmark: {a.days} days, hot window {a.hot_days} days, a step every {a.step_s} s; "
        f"load average {load}"
    )
    root = Path(tempfile.mkdtemp())
    try:
        for n in (int(x) for x in a.jobs.split(",")):
            t0 = time.perf_counter()
            x = run(n, a.days, a.hot_days, a.step_s, marks, root)
            try:
                took = time.perf_counter() - t0
                print(
                    f"  {n} jobs a day ({took:.0f} s to run; seal {x['seal_s']:.1f} s,"
                    f" expire {x['expire_s']:.1f} s in all):"
                )
                for d in marks:
                    print(
                        f"    day {d:>3}: Redis without expiry {x['keep'][d] / 2**20:7.1f} MB,"
                        f" with expiry {x['exp'][d] / 2**20:7.1f} MB"
                    )
                # growth a day: the least-squares slope over the last days, two hot windows on
                # (the first weeks past the window the zsets' and the allocator's sizes settle)
                after = [d for d in marks if d >= 2 * a.hot_days] or [d for d in marks if d > a.hot_days]
                if len(after) >= 2:
                    d1 = after[-1]
                    grow_keep = float(np.polyfit(after, [x["keep"][d] for d in after], 1)[0])
                    grow_exp = float(np.polyfit(after, [x["exp"][d] for d in after], 1)[0])
                    hot_jd = x["keep"][d1] / (n * d1)
                    print(
                        f"    after the hot window: without expiry +{grow_keep / 2**20:.2f} MB a day"
                        f" ({hot_jd / 1024:.0f} KB a job-day), with expiry {grow_exp / 1024:+.1f} KB a day"
                    )
                    flat = abs(grow_exp) < 0.05 * grow_keep
                    print(
                        f"    target flat (under 5% of a day's bookings a day): {'MET' if flat else 'MISSED'}"
                    )
                    kept = x["exp"][d1] / (n * a.hot_days)
                    print(
                        f"    with expiry: {kept / 1024:.0f} KB per job-day of the hot window"
                        f" (base records included); a day past it leaves {grow_exp / n / 1024:+.1f} KB a job"
                    )
                whole, week, rows = allocation_s(x["r"], x["archive"], a.days, a.hot_days)
                print(
                    f"    /allocation over all {a.days} days {whole:.3f} s, over the last week {week:.3f} s"
                    f" ({rows} rows)   target <= 1 s: {'MET' if whole <= 1 else 'MISSED'}"
                )
            finally:
                for server in x["servers"].values():
                    server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
