"""Replay's memory as the trace grows: python bench/bench_replay_memory.py [--runs N] [--baseline REV]

Three traces of nvidia-smi CSV at 1 s (a file per host of 8 GPUs) plus the job's events: 256 GPUs x
1 h (921,600 rows), 64 GPUs x 24 h (5.5M rows) and 256 GPUs x 24 h (22.1M rows), the last two a
day of one job with hourly checkpoints, a communication-bound and a starved stretch each hour and
a deadlock at the end (generated host by host and cached under bench/.data, ~2 GB, ~1.5 minutes
the first time). Each runs through the whole `costexporter replay` command in fresh processes;
printed: rows/s by wall clock (start-up included) and the command's peak RSS (VmHWM), with the
growth of each from the smallest trace (a log-log slope: 1 is linear, 0 flat).

Targets: peak <= 1.5 GB at 22M rows; rows/s at 5.5M and 22M rows no lower than the in-memory
replay of 921,600 rows (the baseline's where one is given, else this checkout's). With --baseline REV that
revision's command runs too, turn by turn, on the sizes it can hold (`--baseline-max-rows`,
default 6M: a whole-trace replay of 22M rows needs ~6 GB).
"""

from __future__ import annotations

import argparse
import compileall
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import data
from bench_replay import ROOT, _export, run_command

TARGET_PEAK_MB = 1536


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--baseline", metavar="REV", help="also run this git revision's command, side by side")
    ap.add_argument("--baseline-max-rows", type=int, default=6_000_000)
    a = ap.parse_args()
    traces = {  # name: (rows, files)
        "256 GPUs x 1 h": (256 * 3600, data.ensure()),
        "64 GPUs x 24 h": (64 * 86400, data.ensure_day(64)),
        "256 GPUs x 24 h": (256 * 86400, data.ensure_day(256)),
    }
    out: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        code = {"this checkout": ROOT}
        if a.baseline:
            code[a.baseline] = _export(a.baseline, Path(tmp))
        for where in code.values():
            compileall.compile_dir(where / "costexporter", quiet=1)
        for name, (rows, (csvs, events)) in traces.items():
            variants = {k: v for k, v in code.items() if k == "this checkout" or rows <= a.baseline_max_rows}
            out[name] = run_command(csvs, events, a.runs, variants)
            for k, v in out[name].items():
                rate = v["rows"] / v["wall_s"] / 1e6
                print(
                    f"  {name:<16} {k:<14} {v['rows']:>11,} rows  {rate:5.2f}M rows/s "
                    f"({v['wall_s']:.2f} s)  peak {v['peak_mb']:6.0f} MB",
                    flush=True,
                )
    load = os.getloadavg()[0]
    print(f"replay memory benchmark: medians of {a.runs} fresh processes; load average {load:.1f}")
    small = out["256 GPUs x 1 h"]
    for variant in code:
        got = [(n, v[variant]) for n, v in out.items() if variant in v]
        base_rows, base = got[0][1]["rows"], got[0][1]
        print(f"{variant}:")
        for n, v in got:
            grow = ""
            if v["rows"] > base_rows:
                r = math.log(v["rows"] / base_rows)
                mem = math.log(v["peak_mb"] / base["peak_mb"]) / r
                speed = math.log(v["wall_s"] / base["wall_s"]) / r
                grow = f"  slope: memory {mem:.2f}, time {speed:.2f}"
            rate = v["rows"] / v["wall_s"]
            peak = v["peak_mb"]
            print(f"  {n:<16} {v['rows']:>11,} rows  {rate / 1e6:5.2f}M rows/s  peak {peak:6.0f} MB{grow}")
    ours = {n: v["this checkout"] for n, v in out.items()}
    ref = a.baseline if a.baseline else "this checkout"
    floor = small[ref]["rows"] / small[ref]["wall_s"]
    slowest = min(v["rows"] / v["wall_s"] for n, v in ours.items() if n != "256 GPUs x 1 h")
    big = ours["256 GPUs x 24 h"]
    print(
        f"peak <= {TARGET_PEAK_MB} MB at {big['rows']:,} rows: "
        f"{'MET' if big['peak_mb'] <= TARGET_PEAK_MB else 'MISSED'} ({big['peak_mb']:.0f} MB)"
    )
    print(
        f"rows/s at 5.5M and 22M rows >= {ref}'s in-memory replay of {small[ref]['rows']:,} rows "
        f"({floor / 1e6:.2f}M rows/s): {'MET' if slowest >= floor else 'MISSED'} "
        f"(slowest {slowest / 1e6:.2f}M rows/s)"
    )


if __name__ == "__main__":
    main()
