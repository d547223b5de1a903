"""Pre-run gate benchmark: python bench/bench_preflight.py [--runs N]

A 16-rank pretokenized cache of R4's size (30,835-30,888 blocks of 2048 4-byte tokens
per rank, ~252 MB a file, ~4 GB in all; sparse files, so the disk holds almost nothing) with R4's
53-block spread, and the whole gate through the real command in a fresh process: cache, token
total, occupancy (the local Redis), master port, free space, interconnect probe. Prints the
median and max wall time of the command (interpreter start-up included) and of the checks alone.
Target: the whole gate under 3 s (R5 in docs/background.md: six checks in 2.7 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ = 2048


def make_cache(d: Path) -> str:
    for rank in range(16):
        blocks = 30_835 if rank == 3 else 30_888
        with (d / f"tokens_rank{rank}.bin").open("wb") as fh:
            fh.write(b"\x01\x00\x00\x00" * 1024)
            fh.truncate(blocks * SEQ * 4)
    return str(d / "tokens_rank*.bin")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = make_cache(Path(tmp))
        cmd = [
            sys.executable,
            "-m",
            "costexporter.cli",
            "preflight",
            "--job",
            "bench-preflight",
            "--prefix",
            "bench-preflight",
            "--cache",
            cache,
            "--expected-tokens",
            "1.01e9",
            "--node",
            "node0",
            "--node",
            "node1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            "29500",
            "--checkpoint-path",
            tmp,
            "--min-free-gb",
            "1",
            "--ib-probe",
            "--no-post",
            "--format",
            "json",
        ]
        walls, checks = [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            walls.append(time.perf_counter() - t)
            out = json.loads(r.stdout)
            checks.append(sum(c["seconds"] for c in out["checks"]))
        cache_check = next(c for c in out["checks"] if c["name"] == "cache")
        print(
            f"cache: 16 files, {sum(cache_check['detail']['blocks']) * SEQ * 4 / 1e9:.2f} GB, "
            f"spread {cache_check['detail']['spread_blocks']} blocks "
            f"(ranks {cache_check['detail']['shortest_rank']} and {cache_check['detail']['longest_rank']})"
        )
        for c in out["checks"]:
            print(f"  {c['name']:<12} {c['status']:<7} {c['seconds'] * 1000:7.1f} ms  {c['value'][:90]}")
        print(
            f"whole command (fresh process): median {statistics.median(walls):.2f} s, max {max(walls):.2f} s "
            f"(target < 3 s: {'MET' if statistics.median(walls) < 3 else 'MISSED'})"
        )
        print(f"checks alone: median {statistics.median(checks) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
