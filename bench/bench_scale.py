"""Scale benchmark: python bench/bench_scale.py [--part agent|wide|watcher|api]

A thin driver: one section per part, each in a module of its own, printing its figures next to
its targets.

* agent: round CPU and RSS against a job's history, and restart catch-up (bench/scale_agent.py).
* wide: round CPU, RSS and Redis commands/CPU per round of an agent owning 8 GPUs of a job
  64, 512 and 4,096 GPUs wide, its peers publishing sample streams and every rank its default
  10-s heartbeat (bench/scale_wide.py; --heartbeat 0 for none; --cluster: on a 3-master Redis
  Cluster, the busiest master's share shown).
* watcher: poll time at 1,000 jobs x 1k steps (one watcher, and two sharing the jobs), 1 job x
  100k steps, and 10,000 jobs of which 1,000 are running, the others ended (a day's jobs)
  (bench/scale_agent.py).
* api: the finance API at 1,000 and 10,000 jobs, and Redis bytes per job (bench/scale_api.py;
  --seed-dir keeps the seeded Redis for the next run).

--baseline REV (watcher, api): that git revision (the previous release) side by side with this
tree, each on a Redis of its own seeded and fed by its own code (its keys, its layout, its
protocol: a tree reads what it wrote), asked in turns, in alternating order, under the same load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = ("agent", "wide", "watcher", "api")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", action="append", choices=PARTS, help="run only these parts (default: all)")
    ap.add_argument("--steps", default="1000,100000,300000", help="agent: history sizes (steps)")
    ap.add_argument("--widths", default="64,512,4096", help="wide: job widths (GPUs)")
    ap.add_argument("--heartbeat", type=float, default=10.0, help="wide: each rank's heartbeat, s (0: none)")
    ap.add_argument("--cluster", action="store_true", help="wide: on a private 3-master Redis Cluster")
    ap.add_argument(
        "--watcher",
        default="1000x1000,1000x1000/2,1x100000,10000x100:1000",
        help="watcher: JOBSxSTEPS[:RUNNING][/SHARDS] shapes (:1000: 1,000 of the jobs running, the "
        "others ended; /2: two watchers, each polling half the jobs)",
    )
    ap.add_argument("--jobs", default="1000,10000", help="api: job counts to seed (comma-separated)")
    ap.add_argument("--seed-dir", type=Path, help="api: keep each seeded Redis here and load it next time")
    ap.add_argument(
        "--baseline", metavar="REV", help="api, watcher: also time this git revision's, side by side"
    )
    ap.add_argument("--rounds", type=int, default=3, help="api: requests per figure (per API)")
    a = ap.parse_args()
    parts = a.part or list(PARTS)

    if "agent" in parts:
        import scale_agent

        print("== agent ==")
        scale_agent.report(scale_agent.measure([int(x) for x in a.steps.split(",")]))
    if "wide" in parts:
        import scale_wide

        print("== wide ==")
        scale_wide.report(scale_wide.measure([int(x) for x in a.widths.split(",")], a.heartbeat, a.cluster))
    if "watcher" in parts:
        import scale_agent

        print("== watcher ==")
        shapes = scale_agent.parse_shapes(a.watcher)
        scale_agent.report_watcher(scale_agent.measure_watcher(shapes, a.baseline))
    if "api" in parts:
        import scale_api

        print("== api ==")
        scale_api.run(tuple(int(x) for x in a.jobs.split(",")), a.seed_dir, a.baseline, a.rounds)


if __name__ == "__main__":
    main()
