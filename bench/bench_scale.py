"""Scale benchmark (issue 16): python bench/bench_scale.py [--part api] [--jobs 1000,10000]

A thin driver: each part lives in a module of its own (bench/scale_<part>.py) and prints its
figures next to its targets. Parts: api (the finance API at 1,000 and 10,000 jobs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = ("api",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=PARTS, action="append", help="run only these parts (default: all)")
    ap.add_argument("--jobs", default="1000,10000", help="API: job counts to seed (comma-separated)")
    a = ap.parse_args()
    parts = a.part or list(PARTS)

    # ---- the finance API ----------------------------------------------------------------------
    if "api" in parts:
        import scale_api

        scale_api.run(tuple(int(x) for x in a.jobs.split(",")))


if __name__ == "__main__":
    main()
