"""The finance API part of bench/bench_scale.py: /allocation and /jobs at 1,000 and 10,000 jobs.

Each size gets a private `redis-server` (a temporary directory, a free port, no persistence),
seeded through the ledger's own writer (`ledger.queue_amounts`, so every rollup exists as the
agents write it), and the real API under uvicorn (`costexporter api`) in a process of its own.
Figures: the median (and p99) of `rounds` requests after one warm-up, next to their targets (as
in docs/benchmarks.md) with MET or MISSED and the load average while timed; and the Redis bytes
per job (INFO used_memory before and after seeding).

`seed_dir`: the seeded Redis of each size is saved there (`seed-<jobs>.rdb`, with its seeding
figures beside it) and loaded instead of seeding again (seeding 10,000 jobs takes minutes).
`baseline`: a git revision (the previous release): its API serves a Redis of its own beside
this tree's, seeded with the same jobs by that revision's own writer (its keys, its layout), and
each round asks both, in alternating order, so the two are compared under the same load.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from costexporter.core.model import Category  # noqa: E402
from costexporter.store import keys, ledger  # noqa: E402

DAY = 86400
END = 1_764_547_200  # 2025-12-01T00:00:00Z
START = END - 30 * DAY
WINDOW = f"{START},{END}"  # 30 days, midnight to midnight
WINDOW_ODD = f"{START + 35 * 60},{END - 85 * 60}"  # not on an hour: the old path's worst case
TEAMS = 50
BUCKETS_PER_JOB = 12  # an hour of 5-minute buckets per job, spread over the 30 days
TARGET_ALLOCATION_MS = 300  # at up to 10,000 jobs
TARGET_P99_MS = 50


def private_redis(tmp: Path, rdb: Path | None = None) -> tuple[subprocess.Popen, redis.Redis]:
    """A redis-server of our own on a free port (nothing shared is touched or flushed); with
    `rdb`, started from a copy of that snapshot (never written back: no persistence)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if rdb is not None:
        shutil.copyfile(rdb, tmp / "dump.rdb")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    r = redis.Redis(port=port, decode_responses=True)
    for _ in range(3000):  # loading a 10,000-job snapshot takes a few seconds
        try:
            if r.ping() and r.info("persistence")["loading"] == 0:
                return proc, r
        except (redis.ConnectionError, redis.BusyLoadingError):
            pass
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def seed(r: redis.Redis, prefix: str, n_jobs: int, first: int = 0) -> None:
    """`n_jobs` jobs, each with its owner (team, cost center), BUCKETS_PER_JOB 5-minute buckets of six
    categories written by `ledger.queue_amounts`, and 40 completed steps."""
    rng = np.random.default_rng(first)
    cats = [Category.PRODUCTIVE, Category.COMMUNICATION, Category.OVERHEAD, Category.STALLED, Category.IDLE]
    pipe = r.pipeline(transaction=False)
    for j in range(first, first + n_jobs):
        name = f"job-{j:05d}"
        pipe.zadd(keys.jobs_key(prefix), {name: END})
        owner = {"team": f"team-{j % TEAMS}", "cost_center": f"cc-{j % 7}"}
        attr = getattr(ledger, "ATTR", None)
        if attr is not None:  # whose it is, as the agents book it from the operator's policy
            pipe.hset(keys.figures_key(prefix, name), mapping={attr + k: v for k, v in owner.items()})
        else:  # a release before the policy: the trainer's meta said it
            pipe.hset(keys.meta_key(prefix, name), mapping=owner)
        t0 = START + int(rng.integers(0, 29 * DAY // 300)) * 300
        by_bucket = {}
        for b in range(BUCKETS_PER_JOB):
            a = np.zeros((len(Category), 3), np.int64)
            for c in cats:
                a[c] = rng.integers(1, 10**6, 3)
            by_bucket[t0 + 300 * b] = a
        ledger.queue_amounts(pipe, prefix, name, by_bucket, "bench")
        pipe.zadd(
            keys.steps_key(prefix, name),
            {f"{i}:{(i + 1) * 1000}": t0 + 90 * i for i in range(40)},
        )
        if j % 100 == 99:
            pipe.execute()
    pipe.execute()


def job_day_bytes(r: redis.Redis, prefix: str, jobs: int = 20) -> tuple[float, float]:
    """Redis bytes of one job-day (288 five-minute buckets of six categories, written a round at
    a time as the agent does), and the rollup's share of them."""
    rng = np.random.default_rng(1)
    before = r.info("memory")["used_memory"]
    for j in range(jobs):
        pipe = r.pipeline(transaction=False)
        for b in range(288):
            a = np.zeros((len(Category), 3), np.int64)
            a[:6] = rng.integers(1, 10**6, (6, 3))
            ledger.queue_amounts(pipe, prefix, f"day-{j}", {START + 300 * b: a}, "bench")
        pipe.execute()
    after = r.info("memory")["used_memory"]
    for j in range(jobs):
        ledger.drop_rollup(r, prefix, f"day-{j}")
    without = r.info("memory")["used_memory"]
    return (after - before) / jobs, (after - without) / jobs


def serve_api(url: str, prefix: str, tree: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """`costexporter api` of the source tree `tree` as a user runs it, on a free port; returns
    (process, base URL)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "costexporter.cli",
            "api",
            "--redis-url",
            url,
            "--prefix",
            prefix,
            "--port",
            str(port),
            "--listen",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the API did not start")


def timed(
    clients: list[httpx.Client], path: str, rounds: int = 3, **params
) -> tuple[list[list[float]], httpx.Response]:
    """Milliseconds of `rounds` requests to each API after one warm-up each, the APIs asked in
    turn, in alternating order (the response cache is for series only); and this tree's last
    response."""
    for c in clients:
        c.get(path, params=params)
    times: list[list[float]] = [[] for _ in clients]
    resp = None
    for n in range(rounds):
        order = list(range(len(clients)))
        for i in order if n % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            got = clients[i].get(path, params=params)
            times[i].append((time.perf_counter() - t) * 1000)
            assert got.status_code == 200, (path, got.status_code, got.text[:300])
            if i == 0:
                resp = got
    assert resp is not None
    return times, resp


def seeded(r: redis.Redis, prefix: str, n_jobs: int, seed_dir: Path | None, tmp: Path) -> dict:
    """Seed the private Redis (or find it loaded from `seed_dir`); its seeding figures."""
    saved = seed_dir / f"seed-{n_jobs}.json" if seed_dir else None
    if saved is not None and saved.exists() and r.zcard(keys.jobs_key(prefix)) == n_jobs:
        figures: dict = json.loads(saved.read_text())
        return figures
    before = r.info("memory")["used_memory"]
    t = time.perf_counter()
    seed(r, prefix, n_jobs)
    figures = {
        "seed_s": time.perf_counter() - t,
        "bytes_per_job": (r.info("memory")["used_memory"] - before) / n_jobs,
    }
    if seed_dir is not None and saved is not None:
        seed_dir.mkdir(parents=True, exist_ok=True)
        r.save()
        shutil.copyfile(tmp / "dump.rdb", seed_dir / f"seed-{n_jobs}.rdb")
        saved.write_text(json.dumps(figures))
    return figures


# `seed` run by another tree's package (imported first, so this module's imports take it): a
# baseline's API reads the keys and the layout its own writer wrote.
SEED_IN_TREE = (
    "import sys; tree, bench, url, prefix, n = sys.argv[1:6]; sys.path.insert(0, tree)\n"
    "import costexporter, redis; sys.path.insert(1, bench)\n"
    "assert costexporter.__file__.startswith(tree), costexporter.__file__\n"
    "import scale_api; scale_api.seed(redis.Redis.from_url(url), prefix, int(n))\n"
)


def seed_with(tree: Path, url: str, prefix: str, n_jobs: int) -> None:
    """`seed` by the package of `tree` (a baseline's), in a process of its own."""
    args = [sys.executable, "-c", SEED_IN_TREE, str(tree), str(ROOT / "bench"), url, prefix, str(n_jobs)]
    subprocess.run(args, check=True, cwd=tree)


def measure(n_jobs: int, seed_dir: Path | None = None, against: Path | None = None, rounds: int = 3) -> dict:
    """Seed a private Redis with n_jobs jobs (or load it from `seed_dir`) and time the API over
    it; with `against` (a baseline's tree), its API beside it over a Redis of its own, seeded by
    its own code (the same jobs and amounts, written in its layout)."""
    prefix = "bench"
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as tmp_b:
        rdb = seed_dir / f"seed-{n_jobs}.rdb" if seed_dir else None
        proc, r = private_redis(Path(tmp), rdb if rdb is not None and rdb.exists() else None)
        redises = [proc]
        apis: list[subprocess.Popen] = []
        try:
            out = {"jobs": n_jobs, **seeded(r, prefix, n_jobs, seed_dir, Path(tmp))}
            out["job_day"], out["job_day_rollup"] = job_day_bytes(r, "day")
            port = r.connection_pool.connection_kwargs["port"]
            served = [(ROOT, f"redis://127.0.0.1:{port}/0")]
            if against is not None:
                proc_b, r_b = private_redis(Path(tmp_b))
                redises.append(proc_b)
                url_b = f"redis://127.0.0.1:{r_b.connection_pool.connection_kwargs['port']}/0"
                seed_with(against, url_b, prefix, n_jobs)
                served.append((against, url_b))
            bases = []
            for tree, url in served:
                api, base = serve_api(url, prefix, tree)
                apis.append(api)
                bases.append(base)
            clients = [httpx.Client(base_url=b, timeout=120) for b in bases]
            try:
                out["alloc_job"], resp = timed(clients, "/api/v1/allocation", rounds, window=WINDOW)
                assert len(resp.json()["rows"]) == n_jobs + 1
                out["alloc_job_odd"], _ = timed(clients, "/api/v1/allocation", rounds, window=WINDOW_ODD)
                out["alloc_team"], resp = timed(
                    clients, "/api/v1/allocation", rounds, window=WINDOW, aggregate="team"
                )
                assert len(resp.json()["rows"]) == TEAMS + 1
                out["jobs_page"], _ = timed(clients, "/api/v1/jobs", rounds, limit=100)
                out["jobs_team"], resp = timed(clients, "/api/v1/jobs", rounds, limit=100, team="team-7")
                assert len(resp.json()["jobs"]) == min(100, n_jobs // TEAMS)
                out["load"] = os.getloadavg()[0]  # the machine is shared: say how busy it was
            finally:
                for c in clients:
                    c.close()
            return out
        finally:
            for api in apis:
                api.terminate()
                api.wait(10)
            for p in redises:
                p.kill()
                p.wait(10)


def _figure(times: list[float]) -> str:
    """Median and p99 (nearest rank) of one API's requests."""
    ranked = sorted(times)
    p99 = ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))]
    return f"{statistics.median(times):7.0f} ms (p99 {p99:5.0f})"


def report(results: list[dict], baseline: str | None = None) -> None:
    """The API's figures, each next to its target (and the baseline's beside them)."""
    n_req = len(results[0]["alloc_job"][0]) if results else 0
    print(f"finance API (private redis-server; median and p99 of {n_req} requests after a warm-up)")
    if baseline:
        print(f"  each figure: this tree, then revision {baseline} (asked in turn, alternating)")
    for m in results:
        n = m["jobs"]

        def tgt(times: list[list[float]]) -> str:
            line = f"{_figure(times[0])}  target <= {TARGET_ALLOCATION_MS} ms "
            line += "MISSED" if statistics.median(times[0]) > TARGET_ALLOCATION_MS else "MET"
            return line + "".join(f"  | {_figure(t)}" for t in times[1:])

        def plain(times: list[list[float]]) -> str:
            return " | ".join(_figure(t) for t in times)

        print(
            f"  {n:>6} jobs (seeded in {m['seed_s']:.0f} s; load average {m['load']:.1f} while timed),"
            f" Redis {m['bytes_per_job']:,.0f} bytes/job"
        )
        print(
            f"    Redis bytes per job-day of 5-minute buckets: {m['job_day']:,.0f}"
            f" (the rollup {m['job_day_rollup']:,.0f})"
        )
        print(f"    /allocation 30 d, per job         {tgt(m['alloc_job'])}")
        print(f"    /allocation 30 d not hour-aligned {tgt(m['alloc_job_odd'])}")
        print(f"    /allocation 30 d, per team        {tgt(m['alloc_team'])}")
        print(f"    /jobs first page (100)            {plain(m['jobs_page'])}")
        print(f"    /jobs?team= (100 of one team)     {plain(m['jobs_team'])}")


def run(
    sizes: tuple[int, ...] = (1_000, 10_000),
    seed_dir: Path | None = None,
    baseline: str | None = None,
    rounds: int = 3,
) -> list[dict]:
    if baseline is None:
        results = [measure(n, seed_dir, None, rounds) for n in sizes]
    else:
        from bench_replay import _export

        with tempfile.TemporaryDirectory() as tmp:
            tree = _export(baseline, Path(tmp))
            results = [measure(n, seed_dir, tree, rounds) for n in sizes]
    report(results, baseline)
    return results
