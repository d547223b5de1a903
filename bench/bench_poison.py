"""Poison matrix: python bench/bench_poison.py

Every key a trainer may write (its job's events, heartbeats, ranks and meta; the jobs index; the
registrations counter), written as another type by the poisoned job's own trainer user under its
generated `--job` rule, against every reader under its generated rule on a private Redis: the
agent books another job exactly, the watcher judges it `done`, the API serves it whole. Prints
one line a case, PASS or FAIL, and the time; exits 1 if any fails. (CI runs a few of these cases:
tests/test_poison_roles.py.)
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.poison_roles import POISONS, ROLES, check  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def main() -> int:
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            for role in ROLES:
                for poison in POISONS:
                    t = time.perf_counter()
                    try:
                        check(server.port, server.client(), role, poison)
                        verdict = "PASS"
                    except Exception:  # noqa: BLE001 - a case's failure is reported, the rest run
                        verdict, failed = "FAIL", failed + 1
                        traceback.print_exc()
                    print(f"{role:8} {poison:14} {verdict}  {time.perf_counter() - t:5.2f} s", flush=True)
        finally:
            server.stop()
    print(f"{len(ROLES) * len(POISONS) - failed} of {len(ROLES) * len(POISONS)} cases PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
