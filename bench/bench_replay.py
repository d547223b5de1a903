"""Replay benchmark: python bench/bench_replay.py [--runs N] [--skip-loop]

256 GPUs x 1 h at 1 s (921,600 nvidia-smi CSV rows in 32 files of 8 GPUs) plus events, and a
real-like 100 ms index-less trace of 8 GPUs (about 1.1M rows: early-stamped lines, ramps, gaps).
Prints, with the targets of issue 2:
  * the whole `costexporter replay` command, wall time including interpreter start-up;
  * parse + classify + book measured inside that process (its --timings);
  * peak memory of the command;
  * the accounting core alone on samples in memory, next to a per-sample Python loop doing
    the same work on the same data in this process, and their agreement on the totals.
Commands run several times in fresh processes; the median is reported (this machine is noisy).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import data
from loop_baseline import book_loop

from costexporter.diagnostics import Diagnostics
from costexporter.replay import ReplayConfig, book_trace, replay
from costexporter.sources import files


def run_command(csvs: list[Path], events: Path, runs: int) -> dict:
    args = [
        sys.executable,
        "-m",
        "costexporter.cli",
        "replay",
        "--events",
        str(events),
        "--format",
        "json",
        "--timings",
    ]
    for p in csvs:
        args += ["--samples", str(p)]
    walls, inproc, rows = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(runs):
            t = time.perf_counter()
            r = subprocess.run([*args, "-o", f"{tmp}/out.json"], capture_output=True, text=True, check=True)
            walls.append(time.perf_counter() - t)
            timing = json.loads(r.stderr.split("timings: ", 1)[1])
            rows = timing["rows"]
            inproc.append(timing["read_s"] + timing["book_s"])
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "rows": rows,
        "wall_s": statistics.median(walls),
        "inproc_s": statistics.median(inproc),
        "peak_mb": peak_mb,
        "walls": walls,
        "inprocs": inproc,
    }


def run_core(csvs: list[Path], events: Path, runs: int, loop: bool) -> dict:
    diag = Diagnostics(stream=None)
    samples = files.combine([files.read_samples(p, p.stem, "UTC", diag) for p in csvs])
    evs = files.read_events_jsonl(events, diag)
    cfg = ReplayConfig()
    replay(samples, evs, cfg)  # warm-up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        replay(samples, evs, cfg)
        times.append(time.perf_counter() - t)
    out = {"samples": len(samples), "core_s": statistics.median(times), "core_best_s": min(times)}
    if loop:
        [job] = book_trace(samples, evs, cfg)[0]
        t = time.perf_counter()
        loop_totals = book_loop(samples, evs, job.profile, cfg.booking)
        out["loop_s"] = time.perf_counter() - t
        report = replay(samples, evs, cfg)["jobs"]["bench"]
        worst = 0.0
        for cat, hours in report["gpu_hours"].items():
            other = loop_totals.get(cat, 0.0) / 3600
            worst = max(worst, abs(hours - other) / max(report["gpu_hours_total"], 1e-9))
        out["loop_max_diff_share"] = worst
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--skip-loop", action="store_true", help="skip the slow per-sample loop baseline")
    a = ap.parse_args()
    csvs, events = data.ensure()
    cmd = run_command(csvs, events, a.runs)
    core = run_core(csvs, events, a.runs, not a.skip_loop)
    rows = cmd["rows"]
    lines = [
        (
            "whole command (incl. start-up)",
            f"{rows / cmd['wall_s'] / 1e6:.2f}M rows/s",
            ">= 0.5M rows/s",
            f"median {cmd['wall_s']:.2f} s of {a.runs}",
        ),
        (
            "parse + classify + book, in-process",
            f"{rows / cmd['inproc_s'] / 1e6:.2f}M rows/s",
            ">= 1M rows/s",
            f"median {cmd['inproc_s']:.3f} s",
        ),
        ("peak memory of the command", f"{cmd['peak_mb']:.0f} MB", "<= 1024 MB", ""),
        (
            "core alone (samples in memory)",
            f"{core['samples'] / core['core_s'] / 1e6:.2f}M samples/s",
            ">= 10M samples/s",
            f"median {core['core_s'] * 1000:.0f} ms, best {core['core_best_s'] * 1000:.0f} ms",
        ),
    ]
    if "loop_s" in core:
        lines.append(
            (
                "per-sample Python loop, same data",
                f"{core['samples'] / core['loop_s'] / 1e6:.2f}M samples/s",
                "baseline",
                f"{core['loop_s']:.2f} s; core is {core['loop_s'] / core['core_s']:.0f}x faster; "
                f"totals differ by <= {100 * core['loop_max_diff_share']:.3f}% of GPU time",
            )
        )
    real_csvs, real_events = data.ensure_real()
    real = run_command(real_csvs, real_events, a.runs)
    lines.append(
        (
            "real-like 100 ms index-less, whole cmd",
            f"{real['rows'] / real['wall_s'] / 1e6:.2f}M rows/s",
            ">= 0.5M rows/s",
            f"{real['rows']:,} rows; in-process {real['rows'] / real['inproc_s'] / 1e6:.2f}M rows/s "
            f"(target >= 1M)",
        )
    )
    print(f"replay benchmark: {rows:,} rows, 256 GPUs x 1 h at 1 s, {len(csvs)} files")
    for name, fig, target, note in lines:
        print(f"  {name:<38} {fig:>20}   target {target:<16} {note}")
    print("json: " + json.dumps({"command": cmd, "core": core, "real_like": real}))


if __name__ == "__main__":
    main()
