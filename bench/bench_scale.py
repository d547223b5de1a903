"""Scale benchmark (issue 16): python bench/bench_scale.py [--part agent] [--part watcher]

A thin driver: one section per part, each printing its figures next to its targets.

* agent: round CPU and RSS against a job's history, and restart catch-up (bench/scale_agent.py).
* watcher: poll time at 1,000 jobs x 1k steps and 1 job x 100k steps (bench/scale_agent.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scale_agent


def agent_section(steps: list[int]) -> None:
    print("== agent ==")
    scale_agent.report(scale_agent.measure(steps))


def watcher_section(shapes: list[tuple[int, int]]) -> None:
    print("== watcher ==")
    scale_agent.report_watcher(scale_agent.measure_watcher(shapes))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", action="append", choices=["agent", "watcher"], help="run only these parts")
    ap.add_argument("--steps", default="1000,100000,300000", help="agent: history sizes (steps)")
    ap.add_argument("--watcher", default="1000x1000,1x100000", help="watcher: JOBSxSTEPS shapes")
    a = ap.parse_args()
    parts = a.part or ["agent", "watcher"]
    if "agent" in parts:
        agent_section([int(x) for x in a.steps.split(",")])
    if "watcher" in parts:
        watcher_section([tuple(map(int, x.split("x"))) for x in a.watcher.split(",")])


if __name__ == "__main__":
    main()
