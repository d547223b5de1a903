"""Finance API benchmark: python bench/bench_api.py

Against the local Redis (a prefix of its own, removed afterwards) and the real app under uvicorn:
  * a 30-day series at 1 h for one job, 10 concurrent clients: target p99 <= 50 ms;
  * /allocation over 1,000 jobs for 30 days: target <= 300 ms.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from costexporter.core.model import Category
from costexporter.store import ledger, protocol

DAY = 86400
END = 1_764_547_200  # 2025-12-01T00:00:00Z
START = END - 30 * DAY
WINDOW = f"{START},{END}"


def populate(r: redis.Redis, prefix: str, n_jobs: int) -> None:
    rng = np.random.default_rng(0)
    pipe = r.pipeline(transaction=False)
    # One job with 30 days of hourly buckets (and their daily rollups).
    job = "series-job"
    pipe.zadd(protocol.jobs_key(prefix), {job: END})
    pipe.hset(protocol.meta_key(prefix, job), mapping={"team": "t0"})
    for h in range(START, END, 3600):
        a = rng.integers(0, 10**7, (len(Category), 3)).astype(np.int64)
        ledger.queue_amounts(pipe, prefix, job, {h: a}, "bench")
    pipe.execute()
    # 1,000 jobs, each with 30 days of amounts written through the ledger's own writer (so every
    # rollup exists), step sets and meta.
    for j in range(n_jobs):
        name = f"job-{j:04d}"
        pipe.zadd(protocol.jobs_key(prefix), {name: END})
        pipe.hset(
            protocol.meta_key(prefix, name), mapping={"team": f"team-{j % 20}", "cost_center": f"cc-{j % 7}"}
        )
        days = {
            d: rng.integers(0, 10**8, (len(Category), 3)).astype(np.int64) for d in range(START, END, DAY)
        }
        ledger.queue_amounts(pipe, prefix, name, days, "bench")
        pipe.zadd(
            ledger.key(prefix, name, "ledger", "steps"),
            {f"{i}:{i * 1000}": START + i * 60 for i in range(0, 30 * 24 * 60, 97)},
        )
        if j % 50 == 49:
            pipe.execute()
    pipe.execute()


def serve_api(prefix: str) -> tuple[subprocess.Popen, str]:
    """`costexporter api` in a process of its own, as a user runs it."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "costexporter.cli",
            "api",
            "--prefix",
            prefix,
            "--port",
            str(port),
            "--listen",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("the API did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=30, help="series requests per client")
    a = ap.parse_args()
    r = redis.Redis(decode_responses=True)
    prefix = f"bench-api-{uuid.uuid4().hex[:8]}"
    t = time.perf_counter()
    populate(r, prefix, a.jobs)
    print(f"populated {a.jobs} jobs x 30 days in {time.perf_counter() - t:.1f} s")
    try:
        server, base = serve_api(prefix)
        uncached = []
        with httpx.Client(base_url=base, timeout=30) as c:
            for step in ("5m", "1h", "1d"):  # one cold request per step: nothing cached yet
                t0 = time.perf_counter()
                c.get("/api/v1/jobs/series-job/series", params={"window": WINDOW, "step": step})
                uncached.append((step, (time.perf_counter() - t0) * 1000))

        def series_client(_):
            lat = []
            with httpx.Client(base_url=base, timeout=30) as c:
                for _ in range(a.requests):
                    t0 = time.perf_counter()
                    resp = c.get("/api/v1/jobs/series-job/series", params={"window": WINDOW, "step": "1h"})
                    lat.append((time.perf_counter() - t0) * 1000)
                    assert resp.status_code == 200 and len(resp.content) > 100_000, (
                        resp.status_code,
                        resp.text[:300],
                    )
            return lat

        httpx.get(
            f"{base}/api/v1/jobs/series-job/series", params={"window": WINDOW, "step": "1h"}, timeout=30
        )
        with ThreadPoolExecutor(10) as pool:  # after that one warm-up request (the cold ones are above)
            lat = sorted(x for chunk in pool.map(series_client, range(10)) for x in chunk)
        alloc = []
        with httpx.Client(base_url=base, timeout=60) as c:
            for _ in range(5):
                t0 = time.perf_counter()
                resp = c.get("/api/v1/allocation", params={"window": WINDOW})
                alloc.append((time.perf_counter() - t0) * 1000)
                assert resp.status_code == 200 and len(resp.json()["rows"]) == a.jobs + 2
        server.terminate()
        server.wait(10)
    finally:
        keys = list(r.scan_iter(f"{prefix}:*", count=10_000))
        for i in range(0, len(keys), 10_000):
            r.delete(*keys[i : i + 10_000])
    p99 = lat[int(0.99 * len(lat))]
    print(f"api benchmark ({len(lat)} series requests from 10 concurrent clients; /allocation x5)")
    print(
        f"  30-day series at 1h   p50 {statistics.median(lat):6.1f} ms   p99 {p99:6.1f} ms"
        "   target p99 <= 50 ms"
    )
    print(
        "  uncached series (first request, each step): " + ", ".join(f"{s} {ms:.0f} ms" for s, ms in uncached)
    )
    print(
        f"  /allocation {a.jobs} jobs x 30 days   median {statistics.median(alloc):6.1f} ms   "
        f"max {max(alloc):6.1f} ms   target <= 300 ms"
    )


if __name__ == "__main__":
    main()
