"""The benchmark trace: 256 GPUs (32 hosts x 8) for 1 h at 1 s, as nvidia-smi CSV plus events.

921,600 CSV rows in 32 files, and the events of a job that trains at R7's 1.72 s per step,
checkpoints, runs communication-bound for a while and deadlocks for the last 10 minutes.
Cached under bench/.data (regenerated when missing).
"""

from __future__ import annotations

from pathlib import Path

from costexporter.sources.synth import TraceBuilder, write_nvidia_smi_csv

DATA = Path(__file__).parent / ".data" / "256x1h"
N_GPUS, PER_HOST = 256, 8


def scenario() -> TraceBuilder:
    b = TraceBuilder(n_gpus=N_GPUS, per_host=PER_HOST, interval_s=1.0, job="bench", seed=256)
    b.meta(gpu_model="NVIDIA B300", team="bench")
    b.run("start")
    b.stretch("compute", 1500, step_s=1.72, tokens=4_194_304)
    b.phase("checkpoint", "begin")
    b.stretch("checkpoint", 120, zero_ranks=(0,))
    b.phase("checkpoint", "end", step=b.step)
    b.stretch("communication", 600, step_s=2.5, tokens=4_194_304)
    b.stretch("starvation", 300, step_s=2.5, tokens=4_194_304, straggler=77)
    b.stretch("compute", 480, step_s=1.72, tokens=4_194_304)
    b.stretch("deadlock", 600, zero_ranks=(3,))
    return b


def ensure() -> tuple[list[Path], Path]:
    csvs = sorted(DATA.glob("node*.csv"))
    events = DATA / "events.jsonl"
    if len(csvs) == N_GPUS // PER_HOST and events.exists():
        return csvs, events
    b = scenario()
    csvs = write_nvidia_smi_csv(b.samples(), DATA)
    b.write_events(events)
    return sorted(csvs), events


REAL = Path(__file__).parent / ".data" / "real-8x100ms"


def ensure_real() -> tuple[list[Path], Path]:
    """A real-like 100 ms index-less trace of 8 H100-like GPUs, ~3.8 h (about 1.1M CSV rows):
    early-stamped GPU 0 lines, ramps, noise tails, logger gaps, checkpoint waits (tests/realtrace)."""
    csv_path, events = REAL / "node0.csv", REAL / "events.jsonl"
    if csv_path.exists() and events.exists():
        return [csv_path], events
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from tests.realtrace import Scenario, write_csv, write_events

    REAL.mkdir(parents=True, exist_ok=True)
    tr = Scenario.h100(seed=100, compute_s=1200.0, checkpoints=10, checkpoint_s=30.0, idle_s=60.0).build()
    write_csv(tr, csv_path)
    write_events(tr, events)
    return [csv_path], events
