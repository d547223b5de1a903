"""Trainer hot-path benchmark: python bench/bench_client.py [--n N]

Against the local Redis (127.0.0.1:6379, or COSTEXPORTER_REDIS_URL), side by side in one run:
  * `StepReporter.step()` latency, p50 / p99 / max, while the sender thread ships in background,
    with plain ints (the hot path) and with numpy integers (converted at the call);
  * a synchronous `XADD` per step (what a naive trainer would do), p50 / p99;
  * sustained events/s: N steps posted as fast as possible until all are in the stream.
Targets (docs/benchmarks.md): step() p99 <= 10 us, and >= 10x faster than a synchronous XADD at the median.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid

import numpy as np
import redis

from costexporter.store import keys, protocol
from costexporter.trainer.reporter import StepReporter


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000  # ns -> us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="steps per measurement")
    a = ap.parse_args()
    url = os.environ.get("COSTEXPORTER_REDIS_URL", protocol.DEFAULT_REDIS_URL)
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(url)
    spool = tempfile.mkdtemp()
    try:
        # 1. step(): the reporter's hot path, with its sender thread working at the same time.
        rep = StepReporter("bench-latency", url, prefix=prefix, rank=0, spool_dir=spool, heartbeat_s=3600)
        lat = []
        for s in range(a.n):
            t = time.perf_counter_ns()
            rep.step(s, tokens=4096)
            lat.append(time.perf_counter_ns() - t)
            if s % 1000 == 999:
                time.sleep(0.001)  # a trainer does work between steps; let the sender run
        rep.close(timeout=30)

        # 1b. The same with numpy integers, which step() converts at the call.
        rep = StepReporter("bench-numpy", url, prefix=prefix, rank=0, spool_dir=spool, heartbeat_s=3600)
        steps, tokens = np.arange(a.n, dtype=np.int64), np.int64(4096)
        lat_np = []
        for s in range(a.n):
            x = steps[s]
            t = time.perf_counter_ns()
            rep.step(x, tokens=tokens)
            lat_np.append(time.perf_counter_ns() - t)
            if s % 1000 == 999:
                time.sleep(0.001)
        rep.close(timeout=30)

        # 2. A synchronous XADD per step, on the same Redis.
        key = keys.stream_key(prefix, "bench-sync")
        sync = []
        for s in range(min(a.n, 20_000)):
            fields = {
                "v": "1",
                "type": "step",
                "job": "bench-sync",
                "ts": f"{time.time():.6f}",
                "rank": "0",
                "session": "x",
                "seq": str(s),
                "step": str(s),
                "tokens": "4096",
            }
            t = time.perf_counter_ns()
            r.xadd(key, fields)
            sync.append(time.perf_counter_ns() - t)

        # 3. Sustained throughput: post as fast as possible, until everything is in the stream.
        rep = StepReporter(
            "bench-rate", url, prefix=prefix, rank=0, spool_dir=spool, heartbeat_s=3600, buffer_size=a.n * 2
        )
        t = time.perf_counter()
        for s in range(a.n):
            rep.step(s)
        rep.flush(timeout=120)
        rate = a.n / (time.perf_counter() - t)
        rep.close()
        in_stream = r.xlen(keys.stream_key(prefix, "bench-rate"))
    finally:
        found = list(r.scan_iter(f"{prefix}:*"))
        if found:
            r.delete(*found)

    p50, p99, mx = pct(lat, 0.5), pct(lat, 0.99), max(lat) / 1000
    n50, n99 = pct(lat_np, 0.5), pct(lat_np, 0.99)
    s50, s99 = pct(sync, 0.5), pct(sync, 0.99)
    print(f"client benchmark against {url.split('@')[-1]}, {a.n:,} steps")
    print(
        f"  step()            p50 {p50:6.2f} us   p99 {p99:6.2f} us   max {mx:8.1f} us   "
        f"target p99 <= 10 us: {'MET' if p99 <= 10 else 'MISSED'}"
    )
    print(f"  step(np.int64)    p50 {n50:6.2f} us   p99 {n99:6.2f} us   (converted at the call)")
    print(f"  synchronous XADD  p50 {s50:6.2f} us   p99 {s99:6.2f} us")
    print(
        f"  step() vs XADD at the median: {s50 / p50:.0f}x faster (target >= 10x: "
        f"{'MET' if s50 / p50 >= 10 else 'MISSED'})"
    )
    print(f"  sustained: {rate:,.0f} events/s into the stream ({in_stream:,} entries)")


if __name__ == "__main__":
    main()
