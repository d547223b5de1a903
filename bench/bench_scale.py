"""Scale benchmark (issue 16): python bench/bench_scale.py [--part agent] [--steps 1000,100000,300000]

A thin driver: one section per part, each printing its figures next to its targets.

* agent: round CPU and RSS against a job's history, and restart catch-up (bench/scale_agent.py).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", action="append", choices=["agent"], help="run only these parts")
    ap.add_argument("--steps", default="1000,100000,300000", help="agent: history sizes (steps)")
    a = ap.parse_args()
    parts = a.part or ["agent"]
    if "agent" in parts:
        agent_section([int(x) for x in a.steps.split(",")])


if __name__ == "__main__":
    main()
