"""Replay from Prometheus history: python bench/bench_prometheus.py [--gpus 64] [--days 7] [--step 15]

Writes dcgm-exporter's power and utilization series of N GPUs (8 per host) over D days at one
sample per step, loads them into a real Prometheus (`promtool tsdb create-blocks-from
openmetrics`), and times `costexporter replay --prometheus` over the whole window as a user runs
it (a child process: range queries in chunks, the trace booked, the report), with its peak RSS.
Also at a quarter of the window, so the growth with history shows. Target: a week of 64 GPUs
at 15 s (~2.6M points a series family) in under a minute here, memory bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import prom_server  # noqa: E402

TARGET_S = 60.0
CMD = [sys.executable, "-m", "costexporter.cli", "replay", "--format", "json", "-q"]


def write_openmetrics(path: Path, gpus: int, t0: int, seconds: int, step: int) -> int:
    """Power (a day of training, an idle night, a hang now and then) and utilization series."""
    rng = np.random.default_rng(0)
    ts = np.arange(t0, t0 + seconds, step)
    hour = (ts - t0) // 3600 % 24
    points = 0
    with path.open("w") as f:
        for metric in ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_UTIL"):
            f.write(f"# TYPE {metric} gauge\n")
            for g in range(gpus):
                host, idx = f"node{g // 8:03d}", g % 8
                busy = hour < 20
                if metric.endswith("POWER_USAGE"):
                    v = np.where(busy, rng.normal(560 + idx * 3, 15, ts.size), rng.normal(90, 4, ts.size))
                else:
                    v = np.where(busy, 100.0, 0.0)
                labels = (
                    f'gpu="{idx}",UUID="GPU-{g:08x}-0000-4000-8000-000000000000",Hostname="{host}",'
                    f'modelName="NVIDIA H100 80GB HBM3",namespace="ml",pod="llama-worker-{g // 8}"'
                )
                head = f"{metric}{{{labels}}} "
                f.write("".join(f"{head}{x:.1f} {t}\n" for x, t in zip(v.tolist(), ts.tolist(), strict=True)))
                points += ts.size
        f.write("# EOF\n")
    return points


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_replay(url: str, start: int, end: int, step: int) -> tuple[float, float, dict]:
    """(wall s, peak RSS MiB, the report) of one `replay --prometheus` in a child process (its
    own rusage: `wait4`, not every child's)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        p = subprocess.Popen(
            [*CMD, "--prometheus", url, "--start", str(start), "--end", str(end), "--interval", str(step)],
            stdout=out,
            stderr=err,
            cwd=ROOT,
        )
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise SystemExit(err.read())
        return wall, usage.ru_maxrss / 1024, json.loads(out.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--days", type=float, default=7)
    ap.add_argument("--step", type=int, default=15)
    args = ap.parse_args()
    prom, promtool = prom_server.PROMETHEUS, prom_server.PROMTOOL
    if not prom or not promtool:
        print("needs prometheus and promtool (apt-get install prometheus)")
        return 2
    seconds = int(args.days * 86400)
    t0 = int(time.time()) // 86400 * 86400 - seconds - 86400
    with tempfile.TemporaryDirectory() as d:
        om = Path(d) / "dcgm.om"
        t = time.perf_counter()
        points = write_openmetrics(om, args.gpus, t0, seconds, args.step)
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(Path(d) / "tsdb")],
            check=True,
            capture_output=True,
        )
        load_s = time.perf_counter() - t
        om.unlink()
        (Path(d) / "prometheus.yml").write_text("global:\n  scrape_interval: 1m\n")
        port = free_port()
        proc = prom_server.start(Path(d) / "prometheus.yml", port, None, "--storage.tsdb.retention.time=100y")
        url = f"http://127.0.0.1:{port}"
        try:
            if not prom_server.wait_ready(url, 150.0):
                raise SystemExit("prometheus did not become ready")
            print(
                f"{args.gpus} GPUs x {args.days:g} days at {args.step} s: {points:,} points "
                f"({points // 2:,} a series family); written in {gen_s:.0f} s, promtool {load_s:.0f} s; "
                f"load average {os.getloadavg()[0]:.1f}\n"
            )
            print("| window | points | replay wall | peak RSS | GPU-h booked | target |")
            print("|---|---|---|---|---|---|")
            for share in (0.25, 1.0):
                end = t0 + int(seconds * share) - args.step
                wall, rss, rep = run_replay(url, t0, end, args.step)
                gpu_h = sum(j["gpu_hours_total"] for j in rep["jobs"].values())
                gpu_h += rep["unassigned"]["gpu_hours"]
                met = "" if share < 1 else f"< {TARGET_S:.0f} s: {'MET' if wall < TARGET_S else 'MISSED'}"
                print(
                    f"| {share * args.days:g} days | {int(points * share):,} | {wall:.1f} s | {rss:.0f} MiB "
                    f"| {gpu_h:,.0f} | {met} |"
                )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
