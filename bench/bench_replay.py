"""Replay benchmark: python bench/bench_replay.py [--runs N] [--skip-loop] [--baseline REV]

256 GPUs x 1 h at 1 s (921,600 nvidia-smi CSV rows in 32 files of 8 GPUs) plus events, and a
real-like 100 ms index-less trace of 8 GPUs (about 1.1M rows: early-stamped lines, ramps, gaps).
Prints, with the targets of issues 2 and 15:
  * the whole `costexporter replay` command, wall time including interpreter start-up, and the
    CPU time it used (user + system: what the code costs, whatever else the machine runs);
  * parse + classify + book measured inside that process (its --timings);
  * peak memory of the command;
  * the accounting core alone on samples in memory, on both traces (the real-like one is the
    held-out style of data the target is judged on), next to a per-sample Python loop doing
    the same work on the same data in the same process, and their agreement on the totals;
    each in fresh processes (with --baseline, that revision's core too, turn by turn).
Commands run several times in fresh processes, their bytecode compiled first as an installed
package's is (an editable checkout under PYTHONDONTWRITEBYTECODE would compile every module at
every start); the median is reported (this machine is noisy).
With --baseline REV the command of that git revision runs too, interleaved run by run with this
checkout's, so both see the same load: before and after side by side.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import data
from loop_baseline import book_loop

from costexporter.cli.allocator import keep_freed_memory
from costexporter.core import tracefiles as files
from costexporter.core.diagnostics import Diagnostics
from costexporter.core.replay import ReplayConfig, book_trace, replay

ROOT = Path(__file__).resolve().parent.parent
TARGET_ROWS_S = 1e6  # the whole command, start-up included

# The command, started through `python -c` so that its own peak memory is known: the kernel's
# VmHWM of the process, read as it exits (a forked child's ru_maxrss would count the parent's
# pages at the fork, this benchmark's numpy and data included).
LAUNCH = (
    "import atexit, os, runpy, sys\n"
    "def _hwm():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            open(os.environ['BENCH_HWM_FILE'], 'w').write(line.split()[1])\n"
    "atexit.register(_hwm)\n"
    "sys.argv = ['costexporter', *sys.argv[1:]]\n"
    "runpy.run_module('costexporter.cli', run_name='__main__', alter_sys=True)\n"
)


def _export(rev: str, into: Path) -> Path:
    """The costexporter package of git revision `rev`, unpacked under `into`."""
    tar = into / "rev.tar"
    with tar.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev, "costexporter"], stdout=f, check=True)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into


def run_command(csvs: list[Path], events: Path, runs: int, code: dict[str, Path]) -> dict[str, dict]:
    """Each variant's command (name -> the directory its costexporter package is in), `runs`
    times, interleaved so that every variant sees the same load."""
    args = [sys.executable, "-c", LAUNCH, "replay", "--events", str(events)]
    args += ["--format", "json", "--timings"]
    for p in csvs:
        args += ["--samples", str(p)]
    out = {name: {"walls": [], "cpus": [], "inprocs": [], "peak_mb": 0.0} for name in code}
    rows = 0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(runs):
            for name, where in code.items():
                hwm = Path(tmp) / "hwm"
                env = {**os.environ, "PYTHONPATH": str(where), "BENCH_HWM_FILE": str(hwm)}
                err = Path(tmp) / "stderr"
                with err.open("w") as e:
                    t = time.perf_counter()
                    proc = subprocess.Popen(
                        [*args, "-o", f"{tmp}/out.json"],
                        stdout=subprocess.DEVNULL,
                        stderr=e,
                        cwd=where,
                        env=env,
                    )
                    _, status, ru = os.wait4(proc.pid, 0)  # this child's own CPU time
                    wall = time.perf_counter() - t
                    proc.returncode = os.waitstatus_to_exitcode(status)
                if proc.returncode:
                    raise SystemExit(f"{name}: the command failed:\n{err.read_text()}")
                o = out[name]
                o["walls"].append(wall)
                o["cpus"].append(ru.ru_utime + ru.ru_stime)
                o["peak_mb"] = max(o["peak_mb"], int(hwm.read_text()) / 1024)  # VmHWM is in kB
                r_stderr = err.read_text()
                timing = json.loads(r_stderr.split("timings: ", 1)[1])
                rows = timing["rows"]
                o["inprocs"].append(timing["read_s"] + timing["book_s"])
    for o in out.values():
        o.update(
            rows=rows,
            wall_s=statistics.median(o["walls"]),
            cpu_s=statistics.median(o["cpus"]),
            inproc_s=statistics.median(o["inprocs"]),
        )
    return out


def _rate(rows: int, s: float) -> str:
    return f"{rows / s / 1e6:.2f}M rows/s"


def run_core(csvs: list[Path], events: Path, runs: int, loop: bool) -> dict:
    """The core and the loop in this process, by wall clock and by this process's CPU time (both
    run on one thread; the CPU time is what the load of a shared machine moves least). The
    allocator is set as the replay command sets it. Only what every revision of the package
    has is used: a baseline's core runs this too."""
    keep_freed_memory()
    diag = Diagnostics(stream=None)
    samples = files.combine([files.read_samples(p, p.stem, "UTC", diag) for p in csvs])
    evs = files.read_events_jsonl(events, diag)
    cfg = ReplayConfig()
    replay(samples, evs, cfg)  # warm-up
    times, cpus = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        replay(samples, evs, cfg)
        times.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    out: dict = {"samples": len(samples), "walls": times, "cpus": cpus}
    if loop:
        [job] = book_trace(samples, evs, cfg)[0]
        t, c = time.perf_counter(), time.process_time()
        loop_totals = book_loop(samples, evs, job.profile, cfg.booking)
        out["loop_s"] = time.perf_counter() - t
        out["loop_cpu_s"] = time.process_time() - c
        [report] = replay(samples, evs, cfg)["jobs"].values()
        worst = 0.0
        for cat, hours in report["gpu_hours"].items():
            other = loop_totals.get(cat, 0.0) / 3600
            worst = max(worst, abs(hours - other) / max(report["gpu_hours_total"], 1e-9))
        out["loop_max_diff_share"] = worst
    return out


def core_runs(
    traces: dict[str, tuple[list[Path], Path]], runs: int, loop: bool, code: dict[str, Path]
) -> dict[str, dict[str, dict]]:
    """trace -> variant -> `run_core`'s figures: each variant's core in fresh processes (its
    package first on the path), the variants taking turns over two rounds so that both see the
    same load; the loop runs in the first round, for this checkout only."""
    per_round = max(1, (runs + 1) // 2)
    out: dict[str, dict[str, dict]] = {t: {} for t in traces}
    for rnd in range(2):
        for trace, (csvs, events) in traces.items():
            for name, where in code.items():
                with_loop = loop and rnd == 0 and name == "this checkout"
                args = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--core-child",
                    str(per_round),
                    *map(str, csvs),
                    str(events),
                ]
                env = {**os.environ, "PYTHONPATH": str(where), "BENCH_CORE_LOOP": "1" if with_loop else ""}
                res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=where)
                if res.returncode:
                    raise SystemExit(f"{name}: the core's run failed:\n{res.stderr}")
                got = json.loads(res.stdout.strip().splitlines()[-1])
                o = out[trace].setdefault(name, {"cpus": [], "walls": []})
                o["cpus"] += got["cpus"]
                o["walls"] += got["walls"]
                o["samples"] = got["samples"]
                o.update({k: v for k, v in got.items() if k.startswith("loop")})
    for variants in out.values():
        for o in variants.values():
            o.update(
                core_s=statistics.median(o["walls"]),
                core_best_s=min(o["walls"]),
                core_cpu_s=statistics.median(o["cpus"]),
            )
    return out


def _core_child(argv: list[str]) -> None:
    """`--core-child RUNS CSV... EVENTS`: `run_core` in this fresh process, one JSON line."""
    runs, *paths = argv
    out = run_core(
        [Path(p) for p in paths[:-1]], Path(paths[-1]), int(runs), bool(os.environ.get("BENCH_CORE_LOOP"))
    )
    print(json.dumps(out))


def main() -> None:
    if sys.argv[1:2] == ["--core-child"]:
        return _core_child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--skip-loop", action="store_true", help="skip the slow per-sample loop baseline")
    ap.add_argument(
        "--baseline", metavar="REV", help="also run the command of this git revision, side by side"
    )
    a = ap.parse_args()
    csvs, events = data.ensure()
    real_csvs, real_events = data.ensure_real()
    with tempfile.TemporaryDirectory() as tmp:
        code = {"this checkout": ROOT}
        if a.baseline:
            code[a.baseline] = _export(a.baseline, Path(tmp))
        for where in code.values():  # as an installed package has it (pip writes the bytecode)
            compileall.compile_dir(where / "costexporter", quiet=1)
        cmds = run_command(csvs, events, a.runs, code)
        reals = run_command(real_csvs, real_events, a.runs, code)
        traces = {"256 GPUs x 1 h": (csvs, events), "real-like 100 ms": (real_csvs, real_events)}
        cores = core_runs(traces, a.runs, not a.skip_loop, code)
    cmd, real = cmds["this checkout"], reals["this checkout"]
    rows = cmd["rows"]
    load = os.getloadavg()[0]
    lines = [
        (
            "whole command (incl. start-up)",
            _rate(rows, cmd["wall_s"]),
            ">= 1M rows/s",
            f"median {cmd['wall_s']:.2f} s of {a.runs}; "
            f"CPU {cmd['cpu_s']:.2f} s = {_rate(rows, cmd['cpu_s'])}",
        ),
        (
            "parse + classify + book, in-process",
            _rate(rows, cmd["inproc_s"]),
            ">= 1M rows/s",
            f"median {cmd['inproc_s']:.3f} s",
        ),
        ("peak memory of the command", f"{cmd['peak_mb']:.0f} MB", "<= 1024 MB", ""),
    ]
    lines.append(
        (
            "real-like 100 ms index-less, whole cmd",
            _rate(real["rows"], real["wall_s"]),
            ">= 1M rows/s",
            f"{real['rows']:,} rows, median {real['wall_s']:.2f} s; CPU {real['cpu_s']:.2f} s = "
            f"{_rate(real['rows'], real['cpu_s'])}; in-process {_rate(real['rows'], real['inproc_s'])}; "
            f"peak {real['peak_mb']:.0f} MB",
        )
    )
    for trace, variants in cores.items():
        for name, c in variants.items():
            this = name == "this checkout"
            lines.append(
                (
                    f"core alone, {trace}" if this else f"  {name}: core, {trace}",
                    f"{c['samples'] / c['core_cpu_s'] / 1e6:.2f}M samples/s",
                    ">= 10M samples/s" if this else "(before)",
                    f"CPU {c['core_cpu_s'] * 1000:.0f} ms (median of {len(c['cpus'])}, 2 processes); "
                    f"wall median {c['core_s'] * 1000:.0f} ms, best {c['core_best_s'] * 1000:.0f} ms",
                )
            )
            if "loop_s" in c:
                lines.append(
                    (
                        f"per-sample Python loop, {trace}",
                        f"{c['samples'] / c['loop_cpu_s'] / 1e6:.2f}M samples/s",
                        ">= 50x slower",
                        f"CPU {c['loop_cpu_s']:.2f} s; the core {c['loop_cpu_s'] / c['core_cpu_s']:.1f}x "
                        f"faster by CPU time, {c['loop_s'] / c['core_s']:.1f}x by wall; totals differ by "
                        f"<= {100 * c['loop_max_diff_share']:.3f}% of GPU time",
                    )
                )
    for name in code:
        if name == "this checkout":
            continue
        b, br = cmds[name], reals[name]
        lines += [
            (
                f"  {name}: whole command",
                _rate(rows, b["wall_s"]),
                "(before)",
                f"median {b['wall_s']:.2f} s; CPU {b['cpu_s']:.2f} s = {_rate(rows, b['cpu_s'])}; "
                f"peak {b['peak_mb']:.0f} MB",
            ),
            (
                f"  {name}: real-like, whole cmd",
                _rate(br["rows"], br["wall_s"]),
                "(before)",
                f"median {br['wall_s']:.2f} s; CPU {br['cpu_s']:.2f} s = {_rate(br['rows'], br['cpu_s'])}; "
                f"peak {br['peak_mb']:.0f} MB",
            ),
        ]
    print(
        f"replay benchmark: {rows:,} rows, 256 GPUs x 1 h at 1 s, {len(csvs)} files; load average {load:.1f}"
    )
    for name, fig, target, note in lines:
        print(f"  {name:<42} {fig:>18}   target {target:<16} {note}")
    ok = min(rows / cmd["wall_s"], real["rows"] / real["wall_s"]) >= TARGET_ROWS_S
    print(f"whole command >= 1M rows/s on both traces: {'MET' if ok else 'MISSED'}")
    print(f"peak memory <= 1024 MB: {'MET' if max(cmd['peak_mb'], real['peak_mb']) <= 1024 else 'MISSED'}")
    ours = {t: v["this checkout"] for t, v in cores.items()}
    rate = {t: c["samples"] / c["core_cpu_s"] for t, c in ours.items()}
    print(
        f"core alone >= 10M samples/s (by CPU time): {'MET' if min(rate.values()) >= 10e6 else 'MISSED'} "
        f"({'; '.join(f'{v / 1e6:.1f}M on {t}' for t, v in rate.items())})"
    )
    if all("loop_s" in c for c in ours.values()):
        x = {t: c["loop_cpu_s"] / c["core_cpu_s"] for t, c in ours.items()}
        print(
            f"core >= 50x the per-sample loop (by CPU time): {'MET' if min(x.values()) >= 50 else 'MISSED'} "
            f"({'; '.join(f'{v:.1f}x on {t}' for t, v in x.items())})"
        )
    print("json: " + json.dumps({"command": cmds, "core": cores, "real_like": reals}))


if __name__ == "__main__":
    main()
