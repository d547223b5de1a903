"""The benchmark trace: 256 GPUs (32 hosts x 8) for 1 h at 1 s, as nvidia-smi CSV plus events.

921,600 CSV rows in 32 files, and the events of a job that trains at R7's 1.72 s per step,
checkpoints, runs communication-bound for a while and deadlocks for the last 10 minutes.
Cached under bench/.data (regenerated when missing).
"""

from __future__ import annotations

from pathlib import Path

from costexporter.synth import TraceBuilder, write_nvidia_smi_csv

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
