"""Finance API benchmark: python bench/bench_api.py [--redis-url URL]

Against the Redis of --redis-url (default $COSTEXPORTER_REDIS_URL, else 127.0.0.1:6379; a
prefix of its own, removed afterwards) and the real `costexporter api` in a process of its own,
pointed at that same Redis:
  * a 30-day series at 1 h for one job from 10 concurrent clients, each a process of its own (as
    ten dashboards or notebooks are): target p99 <= 50 ms;
  * /allocation over 1,000 jobs for 30 days: target <= 300 ms.
The API process is ended on every way out (a failed request included).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from costexporter.core.model import Category
from costexporter.store import keys, ledger

DAY = 86400
END = 1_764_547_200  # 2025-12-01T00:00:00Z
START = END - 30 * DAY
WINDOW = f"{START},{END}"


def populate(r: redis.Redis, prefix: str, n_jobs: int) -> None:
    rng = np.random.default_rng(0)
    pipe = r.pipeline(transaction=False)
    # One job with 30 days of hourly buckets (and their daily rollups).
    job = "series-job"
    pipe.zadd(keys.jobs_key(prefix), {job: END})
    pipe.hset(keys.meta_key(prefix, job), mapping={"team": "t0"})
    for h in range(START, END, 3600):
        a = rng.integers(0, 10**7, (len(Category), 3)).astype(np.int64)
        ledger.queue_amounts(pipe, prefix, job, {h: a}, "bench")
    pipe.execute()
    # 1,000 jobs, each with 30 days of amounts written through the ledger's own writer (so every
    # rollup exists), step sets and meta.
    for j in range(n_jobs):
        name = f"job-{j:04d}"
        pipe.zadd(keys.jobs_key(prefix), {name: END})
        pipe.hset(
            keys.meta_key(prefix, name), mapping={"team": f"team-{j % 20}", "cost_center": f"cc-{j % 7}"}
        )
        days = {
            d: rng.integers(0, 10**8, (len(Category), 3)).astype(np.int64) for d in range(START, END, DAY)
        }
        ledger.queue_amounts(pipe, prefix, name, days, "bench")
        pipe.zadd(
            keys.steps_key(prefix, name),
            {f"{i}:{i * 1000}": START + i * 60 for i in range(0, 30 * 24 * 60, 97)},
        )
        if j % 50 == 49:
            pipe.execute()
    pipe.execute()


def serve_api(prefix: str, redis_url: str) -> tuple[subprocess.Popen, str]:
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
            "--redis-url",
            redis_url,
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
    for _ in range(400):
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    raise RuntimeError("the API did not start")


def series_client(base: str, requests: int, start, ready) -> list[float]:
    """One client process: waits for the others, then `requests` series requests in a row."""
    lat = []
    with httpx.Client(base_url=base, timeout=30) as c:
        ready.wait()
        start.wait()
        for _ in range(requests):
            t0 = time.perf_counter()
            resp = c.get("/api/v1/jobs/series-job/series", params={"window": WINDOW, "step": "1h"})
            lat.append((time.perf_counter() - t0) * 1000)
            if resp.status_code != 200 or len(resp.content) <= 100_000:
                raise RuntimeError(f"series: {resp.status_code} {resp.text[:300]}")
    return lat


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=30, help="series requests per client")
    ap.add_argument("--clients", type=int, default=10, help="client processes")
    ap.add_argument(
        "--redis-url",
        default=os.environ.get("COSTEXPORTER_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="the Redis to seed and to point the API at [default: $COSTEXPORTER_REDIS_URL]",
    )
    a = ap.parse_args()
    r = redis.Redis.from_url(a.redis_url, decode_responses=True)
    prefix = f"bench-api-{uuid.uuid4().hex[:8]}"
    t = time.perf_counter()
    server = None
    try:
        populate(r, prefix, a.jobs)
        print(f"populated {a.jobs} jobs x 30 days in {time.perf_counter() - t:.1f} s ({a.redis_url})")
        server, base = serve_api(prefix, a.redis_url)
        uncached = []
        with httpx.Client(base_url=base, timeout=30) as c:
            for step in ("5m", "1h", "1d"):  # one cold request per step: nothing cached yet
                t0 = time.perf_counter()
                c.get("/api/v1/jobs/series-job/series", params={"window": WINDOW, "step": step})
                uncached.append((step, (time.perf_counter() - t0) * 1000))
        httpx.get(
            f"{base}/api/v1/jobs/series-job/series", params={"window": WINDOW, "step": "1h"}, timeout=30
        )
        # After that one warm-up request (the cold ones are above): the clients are processes,
        # started and connected first, then released together.
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as m:
            start, ready = m.Event(), m.Barrier(a.clients)
            with ctx.Pool(a.clients) as pool:
                jobs = [
                    pool.apply_async(series_client, (base, a.requests, start, ready))
                    for _ in range(a.clients)
                ]
                time.sleep(0.5)
                start.set()
                lat = sorted(x for j in jobs for x in j.get(timeout=600))
        alloc = []
        with httpx.Client(base_url=base, timeout=60) as c:
            for _ in range(5):
                t0 = time.perf_counter()
                resp = c.get("/api/v1/allocation", params={"window": WINDOW})
                alloc.append((time.perf_counter() - t0) * 1000)
                if resp.status_code != 200 or len(resp.json()["rows"]) != a.jobs + 2:
                    raise RuntimeError(f"/allocation: {resp.status_code} {resp.text[:300]}")
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
        keys = list(r.scan_iter(f"{prefix}:*", count=10_000))
        for i in range(0, len(keys), 10_000):
            r.delete(*keys[i : i + 10_000])
    p99 = lat[int(0.99 * len(lat))]
    med_alloc = statistics.median(alloc)
    print(f"api benchmark ({len(lat)} series requests from {a.clients} client processes; /allocation x5)")
    print(
        f"  30-day series at 1h   p50 {statistics.median(lat):6.1f} ms   p99 {p99:6.1f} ms"
        f"   target p99 <= 50 ms: {verdict(p99 <= 50)}"
    )
    print(
        "  uncached series (first request, each step): " + ", ".join(f"{s} {ms:.0f} ms" for s, ms in uncached)
    )
    print(
        f"  /allocation {a.jobs} jobs x 30 days   median {med_alloc:6.1f} ms   "
        f"max {max(alloc):6.1f} ms   target <= 300 ms: {verdict(med_alloc <= 300)}"
    )


if __name__ == "__main__":
    main()
