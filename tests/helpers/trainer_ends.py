"""A trainer that ends one chosen way: python trainer_ends.py JOB PREFIX URL SPOOL HOW

It posts five steps, waits until they reached Redis, prints `stepping`, then ends as HOW says
(the names are the test's). For the signals it waits to be killed.
"""

import os
import signal
import sys
import time

from costexporter.trainer.reporter import StepReporter

job, prefix, url, spool, how = sys.argv[1:6]


def start() -> StepReporter:
    rep = StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=3600)
    for s in range(1, 6):
        rep.step(s, tokens=10)
    rep.flush(5)
    if how.startswith("signal") or how == "own_sigterm_handler":
        rep.step(6)  # not flushed: the signal path must still send it
    print("stepping", flush=True)
    return rep


def main() -> None:
    if how == "with_exit0":
        with StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=3600) as rep:
            rep.step(1)
            sys.exit(0)
    if how == "with_exit1":
        with StepReporter(job, url, prefix=prefix, spool_dir=spool, heartbeat_s=3600) as rep:
            rep.step(1)
            sys.exit(1)
    rep = start()
    if how == "return":
        return
    if how == "builtin_exit1":
        exit(1)
    if how == "builtin_quit3":
        quit(3)
    if how == "builtin_exit0":
        exit(0)
    if how == "builtin_exit_caught":
        try:  # noqa: SIM105 - the way a program writes it
            exit(2)
        except SystemExit:
            pass
        return
    if how == "sys_exit0":
        sys.exit(0)
    if how == "sys_exit1":
        sys.exit(1)
    if how == "sys_exit_none":
        sys.exit(None)
    if how == "sys_exit_msg":
        sys.exit("loss diverged")
    if how == "sys_exit1_caught_then_return":
        try:
            sys.exit(1)
        except SystemExit as e:
            assert e.code == 1  # the program may read the code: still caught, not the end
        return
    if how == "sys_exit0_caught_then_sys_exit3":
        try:  # noqa: SIM105
            sys.exit(0)
        except SystemExit:
            pass
        sys.exit(3)
    if how == "finally_exit0":
        try:
            sys.exit(0)
        finally:
            rep.close()
    if how == "finally_exit1":
        try:
            sys.exit(1)
        finally:
            rep.close()
    if how == "uncaught":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if how == "os_exit0":
        os._exit(0)
    if how == "os_exit1":
        os._exit(1)
    if how == "own_sigterm_handler":  # the program handles SIGTERM itself and ends cleanly
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print("handler", flush=True)
    if how.startswith("signal") or how == "own_sigterm_handler":
        time.sleep(60)
        raise SystemExit("not killed")


main()
