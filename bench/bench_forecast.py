"""Cost-to-finish benchmark: python bench/bench_forecast.py

Replays runs cut at 25%, 50% and 75% of their time, as if they were still running, and holds
each cut's forecast (`cost_at_finish`: spent plus the recent cost per valid step x the steps left
of the trainer's total_steps) to what the whole run cost. Runs: steady compute with checkpoints;
real-like 8xH100 100 ms traces (ramps, logger gaps, checkpoint waits); the demo's 40-minute
story (a deadlock, an idle gap, a crash loop, a resume that voids steps); runs whose steps slow
down halfway. Prints each error, the median absolute error per cut (target <= 10% at 50%) and how
often the interval [spent + low, spent + high] held the whole run's cost (its coverage).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from costexporter.core.model import Event, Samples  # noqa: E402
from costexporter.core.replay import ReplayConfig, book_trace, job_report  # noqa: E402
from costexporter.sources.synth import TraceBuilder, scenario_mini  # noqa: E402
from tests.realtrace import Scenario  # noqa: E402

CUTS = (0.25, 0.5, 0.75)


def with_total(samples: Samples, events: list[Event], job: str) -> tuple[Samples, list[Event]]:
    """The run's events with a meta `total_steps`: its last step (rank 0's), posted at its start."""
    last = max(int(e.get("step")) for e in events if e.type == "step" and e.rank == 0)
    t0 = min(e.ts_ms for e in events)
    meta = Event("meta", job, t0, 0, "bench-meta", 0, {"total_steps": float(last)})
    return samples, [meta, *events]


def cut(samples: Samples, events: list[Event], t_ms: int) -> tuple[Samples, list[Event]]:
    keep = samples.ts_ms <= t_ms
    s = Samples(
        samples.gpus,
        samples.gpu[keep],
        samples.ts_ms[keep],
        samples.power_w[keep],
        samples.util_pct[keep],
        samples.energy_mj[keep],
    )
    return s, [e for e in events if e.ts_ms <= t_ms]


def runs() -> list[tuple[str, Samples, list[Event]]]:
    out = []
    for seed in range(3):
        b = TraceBuilder(n_gpus=8, per_host=8, job=f"steady-{seed}", seed=seed)
        b.run("start")
        for _ in range(4):
            b.stretch("compute", 1800, step_s=5, tokens=1000)
            b.phase("checkpoint", "begin")
            b.stretch("checkpoint", 120, zero_ranks=(0,))
            b.phase("checkpoint", "end", step=b.step)
        b.run("end")
        out.append((b.job, *with_total(b.samples(), b.events, b.job)))
    for seed in range(3):
        tr = Scenario.field(seed=seed, compute_s=900.0, checkpoints=4).build()
        job = tr.events[0].job
        out.append((f"real-like-{seed}", *with_total(tr.samples, tr.events, job)))
    b = scenario_mini()
    out.append(("story-mini (deadlock, crash loop, resume)", *with_total(b.samples(), b.events, b.job)))
    b = TraceBuilder(n_gpus=8, per_host=8, job="slows-down", seed=5)
    b.run("start")
    b.stretch("compute", 3600, step_s=5, tokens=1000)
    b.stretch("compute", 3600, step_s=6, tokens=1000)  # a data-loader regression: steps 20% slower
    b.run("end")
    out.append(("slows down 20% halfway", *with_total(b.samples(), b.events, b.job)))
    return out


def main() -> None:
    print("cost to finish: cost_at_finish at a cut / the whole run's cost - 1")
    print(f"  {'run':<44}" + "".join(f"{f'at {c:.0%}':>12}" for c in CUTS) + "   interval held it")
    errs: dict[float, list[float]] = {c: [] for c in CUTS}
    held = total = 0
    for name, samples, events in runs():
        [whole], _ = book_trace(samples, events, ReplayConfig())
        final = job_report(whole, ReplayConfig())["cost_total"]
        lo, hi = int(samples.ts_ms.min()), int(samples.ts_ms.max())
        cells, marks = [], []
        for c in CUTS:
            s, ev = cut(samples, events, lo + int(c * (hi - lo)))
            [job], _ = book_trace(s, ev, ReplayConfig())
            rep = job_report(job, ReplayConfig())
            f = rep["forecast"]
            if f["cost_at_finish"] is None:
                cells.append("none")
                marks.append("-")
                continue
            err = f["cost_at_finish"] / final - 1
            errs[c].append(abs(err))
            cells.append(f"{err:+.1%}")
            if f["low"] is not None:
                total += 1
                ok = rep["cost_total"] + f["low"] <= final <= rep["cost_total"] + f["high"]
                held += ok
                marks.append("y" if ok else "n")
            else:
                marks.append("-")
        print(f"  {name:<44}" + "".join(f"{x:>12}" for x in cells) + f"   {' '.join(marks)}")
    med = {c: statistics.median(v) if v else float("nan") for c, v in errs.items()}
    print("  median |error|: " + ", ".join(f"{med[c]:.1%} at {c:.0%}" for c in CUTS))
    ok = med[0.5] <= 0.10
    print(f"  at 50% of a run: {med[0.5]:.1%}   target <= 10%: {'MET' if ok else 'MISSED'}")
    cover = held / total if total else float("nan")
    print(f"  interval coverage: {held} of {total} cuts ({cover:.0%}); stated, no target")


if __name__ == "__main__":
    main()
