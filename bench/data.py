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


def day_scenario(b: TraceBuilder, gpus: tuple[int, ...]) -> None:
    """A day of one job on every GPU of `b` (samples for `gpus` only): hourly checkpoints, a
    communication-bound and a starved stretch each hour, and a deadlock in its last 20 minutes."""
    b.meta(gpu_model="NVIDIA B300")
    b.run("start")
    for hour in range(24):
        compute = 2400 if hour == 23 else 3000
        b.stretch("compute", compute, step_s=1.72, tokens=4_194_304, gpus=gpus)
        if hour == 23:
            b.stretch("deadlock", 1200, zero_ranks=(3,), gpus=gpus)
            break
        b.phase("checkpoint", "begin")
        b.stretch("checkpoint", 120, zero_ranks=(0,), gpus=gpus)
        b.phase("checkpoint", "end", step=b.step)
        b.stretch("communication", 300, step_s=2.5, tokens=4_194_304, gpus=gpus)
        b.stretch("starvation", 180, step_s=2.5, tokens=4_194_304, straggler=b.n_gpus // 3, gpus=gpus)


def _write_host_csv(samples, host: str, path: Path) -> None:
    """nvidia-smi's CSV of one host's samples, in blocks (its text is built a block at a time)."""
    import numpy as np

    from costexporter.sources.synth import _local_stamps

    gids = [i for i, g in enumerate(samples.gpus) if g.host == host]
    sel = np.flatnonzero(np.isin(samples.gpu, gids))
    order = sel[np.lexsort((samples.gpu[sel], samples.ts_ms[sel]))]
    index = np.array([g.index for g in samples.gpus])
    uuid = np.array([g.uuid or "" for g in samples.gpus])
    with path.open("w") as f:
        f.write("timestamp, index, uuid, power.draw [W], utilization.gpu [%]\n")
        for a in range(0, order.size, 200_000):
            o = order[a : a + 200_000]
            g = samples.gpu[o]
            cols = [
                _local_stamps(samples.ts_ms[o], None),
                index[g].astype(str),
                uuid[g],
                np.char.add(np.char.mod("%.2f", samples.power_w[o]), " W"),
                np.char.add(np.char.mod("%.0f", samples.util_pct[o]), " %"),
            ]
            rows = cols[0]
            for c in cols[1:]:
                rows = np.char.add(np.char.add(rows, ", "), c)
            f.write("\n".join(rows.tolist()) + "\n")


def ensure_day(n_gpus: int) -> tuple[list[Path], Path]:
    """`n_gpus` GPUs (hosts of 8) for 24 h at 1 s: n_gpus x 86,400 CSV rows, a file per host,
    written host by host (never the whole trace in memory). Cached under bench/.data."""
    import numpy as np

    where = Path(__file__).parent / ".data" / f"{n_gpus}x24h"
    n_hosts = n_gpus // PER_HOST
    csvs = sorted(where.glob("node*.csv"))
    events = where / "events.jsonl"
    if len(csvs) == n_hosts and events.exists():
        return csvs, events
    where.mkdir(parents=True, exist_ok=True)
    for h in range(n_hosts):
        b = TraceBuilder(n_gpus=n_gpus, per_host=PER_HOST, interval_s=1.0, job="day", seed=24)
        b.rng = np.random.default_rng(1000 + h)
        day_scenario(b, tuple(range(h * PER_HOST, (h + 1) * PER_HOST)))
        _write_host_csv(b.samples(), f"node{h}", where / f"node{h}.csv")
        if h == 0:
            b.write_events(events)
    return sorted(where.glob("node*.csv")), events
